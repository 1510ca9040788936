"""Resource-stability soak: a real agent under a steady mix, sampled with psutil.

Runner: ``python -m tests.soak --minutes N`` (hours for a long run); CI runs
``tests/reliability/test_soak.py`` (about 30 s). The agent runs on the simulator with a fast
collection interval while one client drives, back to back: ``/metrics`` scrapes,
``GET /v1/gpus``, prepare/unprepare cycles on GPUs 0 and 1 (every tenth unprepare
repeated, as a kubelet retry would), and geometry changes on GPU 7
(two layouts, alternating, each transition waited for). A sampler reads the agent process's
open file descriptors, threads and RSS, and the collection staleness
(``now - gpu_agent_last_collection_timestamp_seconds``), every second.

The first third of the run is warm-up (imports, caches, thread pools filling). The check is
that the last third grows no further than the middle third by more than ``Bounds``, and that
staleness stays under 3 collect intervals at every sample. Timing figures are printed, not
asserted.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.agent_process import AgentProcess, start_agent

GEOMETRY_GPU = "7"
CLAIM_GPUS = ("0", "1")
LAYOUTS = (["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"], ["1g.10gb"] * 7)
STALENESS_METRIC = "gpu_agent_last_collection_timestamp_seconds"
MIB = 1024 * 1024


@dataclass(frozen=True)
class Bounds:
    """How much the last window may exceed the middle window's maximum."""
    fds: int = 4
    threads: int = 2
    rss_bytes: int = 8 * MIB
    staleness_intervals: float = 3.0


@dataclass(frozen=True)
class Sample:
    at: float  # seconds since the soak started
    fds: int
    threads: int
    rss: int
    staleness: float


@dataclass
class Window:
    name: str
    samples: list[Sample]

    def span(self, attr: str) -> tuple[int, int]:
        values = [getattr(s, attr) for s in self.samples]
        return min(values), max(values)


@dataclass
class SoakResult:
    duration_s: float
    collect_interval: float
    samples: list[Sample]
    requests: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    transitions: int = 0
    claim_cycles: int = 0

    def windows(self) -> tuple[Window, Window, Window]:
        third = self.duration_s / 3
        parts: list[list[Sample]] = [[], [], []]
        for s in self.samples:
            parts[min(2, int(s.at // third))].append(s)
        return Window("warm-up", parts[0]), Window("middle", parts[1]), Window("last", parts[2])

    @property
    def max_staleness(self) -> float:
        return max(s.staleness for s in self.samples)

    def violations(self, bounds: Bounds = Bounds()) -> list[str]:
        """Every broken bound, in words; empty when the soak passed."""
        found = list(self.errors[:20])
        _, middle, last = self.windows()
        if len(middle.samples) < 2 or len(last.samples) < 2:
            return [*found, f"too few samples per window ({len(self.samples)} in all)"]
        for attr, slack in (("fds", bounds.fds), ("threads", bounds.threads),
                            ("rss", bounds.rss_bytes)):
            grown = last.span(attr)[1] - middle.span(attr)[1]
            if grown > slack:
                found.append(f"{attr} grew by {grown} (> {slack}) from the middle to the last "
                             f"window: {middle.span(attr)} -> {last.span(attr)}")
        limit = bounds.staleness_intervals * self.collect_interval
        stale = [s for s in self.samples if s.staleness >= limit]
        if stale:
            found.append(f"{len(stale)} samples with staleness >= {limit:.2f}s "
                         f"(worst {self.max_staleness:.2f}s at t={stale[0].at:.1f}s)")
        if self.transitions < 1 or self.claim_cycles < 1:
            found.append(f"the mix did not run: {self.transitions} transitions, "
                         f"{self.claim_cycles} claim cycles")
        return found

    def summary(self) -> str:
        rows = [f"soak: {self.duration_s:.0f}s, collect interval {self.collect_interval}s, "
                f"{len(self.samples)} samples, {sum(self.requests.values())} requests "
                f"({', '.join(f'{k} {v}' for k, v in sorted(self.requests.items()))}), "
                f"{self.claim_cycles} claim cycles, {self.transitions} transitions, "
                f"{len(self.errors)} errors",
                f"{'window':<8} {'samples':>7} {'fds min-max':>12} {'threads':>9} "
                f"{'RSS MiB min-max':>16} {'max stale s':>11}"]
        for w in self.windows():
            if not w.samples:
                continue
            fds, threads, rss = w.span("fds"), w.span("threads"), w.span("rss")
            stale = max(s.staleness for s in w.samples)
            rows.append(f"{w.name:<8} {len(w.samples):>7} {f'{fds[0]}-{fds[1]}':>12} "
                        f"{f'{threads[0]}-{threads[1]}':>9} "
                        f"{f'{rss[0] / MIB:.1f}-{rss[1] / MIB:.1f}':>16} {stale:>11.3f}")
        return "\n".join(rows)


def last_collection(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(STALENESS_METRIC + " "):
            return float(line.split()[1])
    raise AssertionError(f"{STALENESS_METRIC} missing from /metrics")


class _Driver:
    """One client driving the mix, back to back, until told to stop."""

    def __init__(self, agent: AgentProcess, result: SoakResult, lock: threading.Lock) -> None:
        self.agent, self.result, self.lock = agent, result, lock
        self.transition: str | None = None
        self.layout = 0
        self.uid = 0

    def call(self, method: str, path: str, body: Any = None, *, expect: tuple[int, ...],
             label: str) -> Any:
        reply = self.agent.request(method, path, body)
        with self.lock:
            self.result.requests[label] += 1
            if reply.status not in expect:
                self.result.errors.append(f"{method} {path}: {reply.status} {reply.body}")
        return reply

    def geometry_step(self) -> None:
        if self.transition is not None:
            body = self.call("GET", self.transition, expect=(200,), label="transition").body
            if not body.get("terminal"):
                return
            if body.get("state") != "succeeded":
                self.result.errors.append(f"transition {self.transition}: {body.get('state')} "
                                          f"{body.get('error')}")
            self.transition = None
            self.result.transitions += 1
        self.layout ^= 1
        reply = self.call("PUT", f"/v1/gpus/{GEOMETRY_GPU}/mig",
                          {"profiles": LAYOUTS[self.layout]}, expect=(200, 202), label="mig")
        if reply.status == 202:
            self.transition = reply.headers["location"]

    def claim_cycle(self, gpu: str) -> None:
        self.uid += 1
        uid = f"soak-{gpu}-{self.uid}"
        self.call("PUT", f"/v1/claims/{uid}", {"devices": [{"kind": "gpu", "device": gpu}]},
                  expect=(200, 201), label="claim")
        self.call("DELETE", f"/v1/claims/{uid}", expect=(204,), label="unclaim")
        if self.uid % 10 == 0:  # a kubelet retry: unprepare is idempotent
            self.call("DELETE", f"/v1/claims/{uid}", expect=(204,), label="unclaim")
        self.result.claim_cycles += 1

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.call("GET", "/metrics", expect=(200,), label="metrics")
                self.call("GET", "/v1/gpus", expect=(200,), label="gpus")
                self.geometry_step()
                for gpu in CLAIM_GPUS:
                    self.claim_cycle(gpu)
            except Exception as e:  # a dropped connection or a bad body: record, keep going
                with self.lock:
                    self.result.errors.append(f"driver: {type(e).__name__}: {e}")
                time.sleep(0.1)


def run_soak(duration_s: float, state_dir: Path, *, collect_interval: float = 0.5,
             sample_every: float = 1.0, agent_args: list[str] | None = None) -> SoakResult:
    """Run the agent under the mix for ``duration_s`` and sample it; the caller checks."""
    agent = start_agent(state_dir, extra=["--collect-interval", str(collect_interval),
                                          *(agent_args or [])])
    result = SoakResult(duration_s, collect_interval, [])
    lock = threading.Lock()
    stop = threading.Event()
    driver = _Driver(agent, result, lock)
    worker = threading.Thread(target=driver.run, args=(stop,), name="soak-driver", daemon=True)
    try:
        proc = psutil.Process(agent.proc.pid)
        start = time.monotonic()
        worker.start()
        next_at = start
        while (now := time.monotonic()) - start < duration_s:
            if agent.proc.poll() is not None:
                result.errors.append(f"agent exited with {agent.proc.returncode}")
                break
            metrics = agent.request("GET", "/metrics", token=None).body
            staleness = time.time() - last_collection(metrics)
            result.samples.append(Sample(now - start, proc.num_fds(), proc.num_threads(),
                                         proc.memory_info().rss, staleness))
            next_at += sample_every
            time.sleep(max(0.0, next_at - time.monotonic()))
        stop.set()
        worker.join(timeout=60)
        if worker.is_alive():
            result.errors.append("the driver did not stop")
    finally:
        stop.set()
        agent.stop(signal.SIGKILL)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--collect-interval", type=float, default=0.5)
    parser.add_argument("--state-dir", type=Path,
                        help="where the agent keeps its state (default: a temporary directory)")
    parser.add_argument("--agent-arg", action="append", default=[], metavar="ARG",
                        help="pass ARG to `gpu-agent serve` (repeat; e.g. "
                             "--agent-arg=--claim-tombstone-s --agent-arg=5)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpu-agent-soak-") as tmp:
        state = args.state_dir or Path(tmp) / "state"
        result = run_soak(args.minutes * 60, state, collect_interval=args.collect_interval,
                          agent_args=args.agent_arg)
    print(result.summary())
    problems = result.violations()
    for p in problems:
        print("FAIL:", p)
    print("PASS" if not problems else f"FAIL ({len(problems)} problems)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
