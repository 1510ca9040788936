"""Claims: prepare/unprepare latency and throughput against a running agent, fsyncs per
prepare, and the server-side prepare time against one durable atomic file write.

Over HTTP, a real ``gpu-agent serve --simulate dgx-h100`` process (simulated NVML latencies
off, so what is measured is the agent: HTTP, validation, NVML reads, CDI spec and checkpoint
writes). Each client loops: take a device from a shared pool, ``PUT /v1/claims/{uid}`` (a
fresh UID every time: unprepared UIDs are refused for the tombstone window), ``DELETE`` it,
return the device. The pool bounds how many claims can exist at once, and so the useful
concurrency: 8 devices for whole GPUs (MIG off), 56 for existing MIG devices (all 8 GPUs at
7x 1g.10gb, set through ``PUT /v1/gpus/{i}/mig``), 56 slots for 1g.10gb slices made on demand
(all 8 GPUs MIG on and empty; the agent places them). A cycle is one prepare plus one
unprepare; throughput is cycles per second over the row.

In-process (no HTTP), a :class:`ClaimService` over a :class:`SimulatedNode` in a directory on
the same disk: one :func:`agent.durable.write_atomic` (temp, fsync, rename, fsync dir) of the
checkpoint's bytes as they stand (what the prepare's commit then writes; it grows with the
tombstones of the claims unprepared so far, as on a busy node) alternates with one prepare of
an existing whole GPU (and its unprepare), so both see the same disk at the same time; the
target is prepare p99 <= 2x the write's p99.
Then N prepares at once (``asyncio.gather``) count the checkpoint writes
(``ClaimCheckpoint.fsyncs``: one group commit each) and every ``os.fsync`` call (checkpoint,
claim CDI specs, the node-wide spec, directory entries) per prepare.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from agent.claims.checkpoint import encode
from agent.claims.requests import DeviceRequest
from agent.durable import write_atomic
from agent.errors import AgentError
from tests.agent_process import AgentProcess, cpu_seconds, start_agent
from tests.service_node import ServiceNode, open_services

if TYPE_CHECKING:
    from _typeshed import HasFileno

CLIENTS = (1, 16, 64)
CYCLES = 384  # per row at least; 8 per client at least
SAMPLES = 1000  # interleaved write / prepare pairs in-process
CONCURRENT = (1, 16, 56)  # in-process prepares at once (56: every MIG device of the node)
REPEATS = 3  # of each in-process concurrent batch
GPUS = 8
ONE_G = "1g.10gb"
SLICE_SLOTS = 7  # 1g.10gb instances per H100
FSYNC_METRIC = "gpu_agent_claims_checkpoint_writes_total"
PREPARE_P99_TARGET = 2.0  # x one durable write's p99
SCALING_TARGET = 10.0  # 64 clients vs 1


@dataclass(frozen=True)
class HttpRow:
    """One (scenario, clients) row against the agent process."""

    scenario: str  # "gpu" (whole GPUs), "mig" (existing MIG devices), "slice" (on demand)
    clients: int
    pool: int  # devices (or slice slots) the clients share: claims at once <= this
    cycles: int  # prepare + unprepare cycles that succeeded
    errors: int  # answers other than 200 / 204
    elapsed_s: float
    prepare_p50_s: float
    prepare_p99_s: float
    unprepare_p50_s: float
    unprepare_p99_s: float
    checkpoint_writes: int | None  # from the agent's metric, when it exports one
    agent_cpu_s: float = math.nan  # CPU time of the agent process over the row

    @property
    def cpu_per_cycle_s(self) -> float:
        return self.agent_cpu_s / self.cycles if self.cycles else math.nan

    @property
    def throughput(self) -> float:
        """Cycles per second."""
        return self.cycles / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def writes_per_cycle(self) -> float | None:
        if self.checkpoint_writes is None or not self.cycles:
            return None
        return self.checkpoint_writes / self.cycles


@dataclass(frozen=True)
class Batch:
    """N prepares at once in-process, then N unprepares at once (summed over repeats)."""

    kind: str  # "gpu", "mig", "slice"
    concurrent: int
    prepares: int  # that succeeded
    errors: int  # prepares that failed (each is reported; a correct agent has none here)
    prepare_checkpoint_writes: int
    prepare_fsyncs: int  # os.fsync calls during the prepares (files and directories)
    unprepare_checkpoint_writes: int
    prepare_s: float  # wall time of the prepare batches

    @property
    def writes_per_prepare(self) -> float:
        return self.prepare_checkpoint_writes / self.prepares if self.prepares else math.nan

    @property
    def fsyncs_per_prepare(self) -> float:
        return self.prepare_fsyncs / self.prepares if self.prepares else math.nan

    @property
    def writes_per_unprepare(self) -> float:
        return self.unprepare_checkpoint_writes / self.prepares if self.prepares else math.nan

    @property
    def prepares_per_s(self) -> float:
        return self.prepares / self.prepare_s if self.prepare_s else 0.0


@dataclass(frozen=True)
class InProcess:
    samples: int
    write_bytes: int
    write_p50_s: float
    write_p99_s: float
    prepare_p50_s: float  # ClaimService.prepare of an existing whole GPU, one at a time
    prepare_p99_s: float
    unprepare_p50_s: float
    unprepare_p99_s: float
    batches: tuple[Batch, ...]

    @property
    def prepare_vs_write(self) -> float:
        """Prepare p99 over write p99 (target <= 2)."""
        return self.prepare_p99_s / self.write_p99_s if self.write_p99_s else math.inf


@dataclass(frozen=True)
class ClaimsResult:
    http: tuple[HttpRow, ...]
    in_process: InProcess
    machine: str
    spec_dir: str = "beside the state"  # where the CDI specs were written

    def row(self, scenario: str, clients: int) -> HttpRow | None:
        return next((r for r in self.http if (r.scenario, r.clients) == (scenario, clients)),
                    None)

    def scaling(self, scenario: str) -> float | None:
        """Throughput with the most clients over throughput with one."""
        rows = sorted((r for r in self.http if r.scenario == scenario), key=lambda r: r.clients)
        if len(rows) < 2 or rows[0].clients != 1 or not rows[0].throughput:
            return None
        return rows[-1].throughput / rows[0].throughput


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def machine() -> str:
    return (f"{os.cpu_count()} CPUs {platform.machine()}, "
            f"Python {platform.python_version()}")


def spec_root() -> Path | None:
    """A tmpfs to hold the CDI spec directory, as ``/var/run/cdi`` is on systemd hosts (``/run``
    is a tmpfs there), or None to keep it beside the state on disk."""
    for candidate in (Path("/run"), Path("/dev/shm")):
        if _filesystem(candidate).endswith("(tmpfs)") and os.access(candidate, os.W_OK):
            return candidate
    return None


def _filesystem(path: Path) -> str:
    """The mount point and type holding ``path`` (from /proc/mounts), for the report."""
    best = ("/", "?")
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "?"
    resolved = str(path.resolve())
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and (resolved == parts[1] or resolved.startswith(
                parts[1].rstrip("/") + "/")) and len(parts[1]) >= len(best[0]):
            best = (parts[1], parts[2])
    return f"{best[0]} ({best[1]})"


# --- over HTTP, against the agent process --------------------------------------------------


def _set_all_mig(agent: AgentProcess, body: dict[str, Any]) -> None:
    """The same MIG request on every GPU at once, then wait for all of them."""
    ids = []
    for index in range(GPUS):
        reply = agent.request("PUT", f"/v1/gpus/{index}/mig", body)
        if reply.status not in (200, 202):
            raise RuntimeError(f"PUT /v1/gpus/{index}/mig: {reply.status} {reply.body}")
        if reply.body["transition"] is not None:
            ids.append(reply.body["transition"]["id"])
    for transition in ids:
        done = agent.poll(f"/v1/transitions/{transition}", lambda answer: answer["terminal"])
        if done["state"] != "succeeded":
            raise RuntimeError(f"transition {transition}: {done['state']} {done['error']}")


def _checkpoint_writes(agent: AgentProcess) -> float | None:
    """The agent's checkpoint-write counter, or None when it does not export one."""
    text = agent.request("GET", "/metrics").body
    for line in text.splitlines():
        if line.startswith(FSYNC_METRIC + " ") or line.startswith(FSYNC_METRIC + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def _load(agent: AgentProcess, pool: Sequence[dict[str, Any]], *, clients: int, cycles: int,
                tag: str) -> tuple[list[float], list[float], int, float]:
    """Run ``cycles`` prepare/unprepare cycles with ``clients`` concurrent clients sharing
    ``pool``; (prepare times, unprepare times, errors, elapsed seconds)."""
    devices: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for device in pool:
        devices.put_nowait(device)
    prepares: list[float] = []
    unprepares: list[float] = []
    errors = 0
    tickets = iter(range(cycles))
    headers = {"Authorization": f"Bearer {agent.token}"}
    connector = aiohttp.TCPConnector(limit=clients, force_close=False)
    async with aiohttp.ClientSession(agent.url, headers=headers,
                                     connector=connector) as http:

        async def client() -> None:
            nonlocal errors
            for ticket in tickets:
                device = await devices.get()
                uid = f"{tag}-{ticket}"
                try:
                    began = time.perf_counter()
                    async with http.put(f"/v1/claims/{uid}", json={"devices": [device]}) as r:
                        await r.read()
                        status = r.status
                    prepared = time.perf_counter()
                    if status != 200:
                        errors += 1
                        continue
                    async with http.delete(f"/v1/claims/{uid}") as r:
                        await r.read()
                        status = r.status
                    done = time.perf_counter()
                    if status != 204:
                        errors += 1
                        continue
                    prepares.append(prepared - began)
                    unprepares.append(done - prepared)
                finally:
                    devices.put_nowait(device)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.perf_counter() - started
    return prepares, unprepares, errors, elapsed


def _http_rows(agent: AgentProcess, scenario: str, pool: Sequence[dict[str, Any]],
               clients: Sequence[int], cycles: int) -> list[HttpRow]:
    rows = []
    asyncio.run(_load(agent, pool, clients=min(4, len(pool)), cycles=min(16, cycles),
                      tag=f"warm-{scenario}"))
    for n in clients:
        count = max(cycles, 8 * n)
        before = _checkpoint_writes(agent)
        cpu = cpu_seconds(agent.proc.pid)
        prepares, unprepares, errors, elapsed = asyncio.run(
            _load(agent, pool, clients=n, cycles=count, tag=f"{scenario}-{n}"))
        cpu = cpu_seconds(agent.proc.pid) - cpu
        after = _checkpoint_writes(agent)
        rows.append(HttpRow(
            scenario=scenario, clients=n, pool=len(pool), cycles=len(prepares), errors=errors,
            elapsed_s=elapsed, prepare_p50_s=percentile(prepares, 50),
            prepare_p99_s=percentile(prepares, 99), unprepare_p50_s=percentile(unprepares, 50),
            unprepare_p99_s=percentile(unprepares, 99),
            checkpoint_writes=None if before is None or after is None else int(after - before),
            agent_cpu_s=cpu))
    return rows


def run_http(directory: Path, clients: Sequence[int] = CLIENTS,
             cycles: int = CYCLES, spec_dir: Path | None = None) -> tuple[HttpRow, ...]:
    agent = start_agent(directory / "agent-state",
                        extra=["--cdi-dir", str(spec_dir or directory / "agent-cdi")])
    try:
        agent.request("PUT", "/v1/sim/latency", {})
        rows = _http_rows(agent, "gpu", [{"kind": "gpu", "device": str(i)}
                                         for i in range(GPUS)], clients, cycles)
        _set_all_mig(agent, {"profiles": [ONE_G] * SLICE_SLOTS})
        mig = [{"kind": "gpu", "device": d["uuid"]}
               for g in agent.request("GET", "/v1/gpus").body["gpus"]
               for d in g["mig_devices"]]
        rows += _http_rows(agent, "mig", mig, clients, cycles)
        _set_all_mig(agent, {"profiles": []})
        rows += _http_rows(agent, "slice", [{"kind": "slice", "profile": ONE_G}]
                           * (GPUS * SLICE_SLOTS), clients, cycles)
    finally:
        agent.stop()
    return tuple(rows)


# --- in-process ----------------------------------------------------------------------------


class _FsyncCounter:
    """Counts the agent's ``os.fsync`` calls while installed. The simulated driver persists
    its own state from the NVML threads (``nvml-*``); those calls stand in for the hardware
    and are not counted."""

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    @contextmanager
    def installed(self) -> Iterator[None]:
        real = os.fsync

        def counting(fd: int | HasFileno) -> None:
            if not threading.current_thread().name.startswith("nvml-"):
                with self._lock:
                    self.calls += 1
            real(fd)

        os.fsync = counting
        try:
            yield
        finally:
            os.fsync = real


async def _settle(counter: _FsyncCounter) -> None:
    """Wait until background writes (the coalesced node-spec rewrite after a MIG change or a
    slice) have stopped, so they are not charged to the next batch."""
    while True:
        before = counter.calls
        await asyncio.sleep(0.05)
        if counter.calls == before:
            return


async def _batches(node: ServiceNode, kind: str, requests: Sequence[DeviceRequest], *,
                   concurrent: Sequence[int], repeats: int, counter: _FsyncCounter,
                   uids: Iterator[int]) -> list[Batch]:
    service, checkpoint = node.claims, node.claims.checkpoint
    out = []
    for n in concurrent:
        if n > len(requests):
            continue
        prepares = errors = writes = fsyncs = unprepare_writes = 0
        seconds = 0.0
        for _ in range(repeats):
            batch = [(f"{kind}-{next(uids)}", r) for r in requests[:n]]
            writes_before, fsyncs_before = checkpoint.fsyncs, counter.calls
            began = time.perf_counter()
            outcomes = await asyncio.gather(
                *(service.prepare(uid, [r], {}) for uid, r in batch), return_exceptions=True)
            seconds += time.perf_counter() - began
            writes += checkpoint.fsyncs - writes_before
            fsyncs += counter.calls - fsyncs_before
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            for failure in failed:
                if not isinstance(failure, AgentError):
                    raise failure
            errors += len(failed)
            prepares += n - len(failed)
            writes_before = checkpoint.fsyncs
            await asyncio.gather(*(service.unprepare(uid) for uid, _ in batch))
            unprepare_writes += checkpoint.fsyncs - writes_before
            await _settle(counter)
        out.append(Batch(kind=kind, concurrent=n, prepares=prepares, errors=errors,
                         prepare_checkpoint_writes=writes, prepare_fsyncs=fsyncs,
                         unprepare_checkpoint_writes=unprepare_writes, prepare_s=seconds))
    return out


async def _in_process(directory: Path, samples: int, concurrent: Sequence[int],
                      repeats: int, spec_dir: Path | None) -> InProcess:
    node = await open_services(directory, spec_dir=spec_dir)
    counter = _FsyncCounter()
    uids = itertools.count()
    try:
        service = node.claims
        gpus = [DeviceRequest(request="gpu", kind="gpu", device=str(i)) for i in range(GPUS)]
        target = service.checkpoint.path.with_name("bench-write")
        sizes: list[int] = []
        writes: list[float] = []
        prepares: list[float] = []
        unprepares: list[float] = []
        for k in range(samples):
            # The checkpoint as it stands: what the prepare's commit writes (it grows with
            # the tombstones of the claims unprepared so far, as on a busy node).
            payload = encode(service.checkpoint.data)
            sizes.append(len(payload))
            began = time.perf_counter()
            write_atomic(target, payload, mode=0o600)
            writes.append(time.perf_counter() - began)
            uid = f"seq-{k}"
            began = time.perf_counter()
            await service.prepare(uid, [gpus[k % GPUS]], {})
            prepares.append(time.perf_counter() - began)
            began = time.perf_counter()
            await service.unprepare(uid)
            unprepares.append(time.perf_counter() - began)
        with counter.installed():
            batches = await _batches(node, "gpu", gpus, concurrent=concurrent,
                                     repeats=repeats, counter=counter, uids=uids)
            await node.mig_all([ONE_G] * SLICE_SLOTS)
            await _settle(counter)
            await node.inventory.refresh()
            mig = [DeviceRequest(request="gpu", kind="gpu", device=d.uuid)
                   for g in node.inventory.gpus for d in g.mig_devices]
            batches += await _batches(node, "mig", mig, concurrent=concurrent,
                                      repeats=repeats, counter=counter, uids=uids)
            await node.mig_all([])
            await _settle(counter)
            slices = [DeviceRequest(request="slice", kind="slice", profile=ONE_G)] * len(mig)
            batches += await _batches(node, "slice", slices, concurrent=concurrent,
                                      repeats=repeats, counter=counter, uids=uids)
    finally:
        await node.close()
    return InProcess(
        samples=samples, write_bytes=int(statistics.median(sizes)),
        write_p50_s=percentile(writes, 50), write_p99_s=percentile(writes, 99),
        prepare_p50_s=percentile(prepares, 50), prepare_p99_s=percentile(prepares, 99),
        unprepare_p50_s=percentile(unprepares, 50), unprepare_p99_s=percentile(unprepares, 99),
        batches=tuple(batches))


def run_in_process(directory: Path, samples: int = SAMPLES,
                   concurrent: Sequence[int] = CONCURRENT, repeats: int = REPEATS,
                   spec_dir: Path | None = None) -> InProcess:
    return asyncio.run(_in_process(directory / "in-process", samples, concurrent, repeats,
                                   spec_dir))


# --- the benchmark -------------------------------------------------------------------------


def run(clients: Sequence[int] = CLIENTS, cycles: int = CYCLES, samples: int = SAMPLES, *,
        concurrent: Sequence[int] = CONCURRENT, repeats: int = REPEATS,
        directory: Path | None = None) -> ClaimsResult:
    """Both halves with their state in one temporary directory (under ``directory``: the disk
    measured) and their CDI specs on a tmpfs, as on hosts, when there is one."""
    root = spec_root()
    with (tempfile.TemporaryDirectory(prefix="bench-claims-", dir=directory) as tmp,
          tempfile.TemporaryDirectory(prefix="bench-claims-cdi-", dir=root) as specs):
        spec_dir = Path(specs) if root is not None else None
        in_process = run_in_process(Path(tmp), samples, concurrent, repeats,
                                    spec_dir and spec_dir / "in-process")
        http = run_http(Path(tmp), clients, cycles, spec_dir and spec_dir / "agent")
    return ClaimsResult(http=http, in_process=in_process, machine=machine(),
                        spec_dir=_filesystem(spec_dir) if spec_dir else "beside the state")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _verdict(ok: bool) -> str:
    return "yes" if ok else "NO"


def report(result: ClaimsResult, disk: str = "?") -> list[str]:
    lines = [f"# Claims: prepare/unprepare against a running agent (simulated dgx-h100, NVML "
             f"latencies off), HTTP over loopback; {result.machine}; state on {disk}, CDI "
             f"specs on {result.spec_dir}",
             f"{'scenario':<8} {'pool':>4} {'clients':>7} {'cycles':>6} {'errors':>6} "
             f"{'prep ms p50':>11} {'p99':>7} {'unprep ms p50':>13} {'p99':>7} "
             f"{'cycles/s':>8} {'vs 1':>6} {'ckpt writes/cycle':>17} {'agent CPU ms/cycle':>18}"]
    base: dict[str, float] = {}
    for r in result.http:
        if r.clients == 1:
            base[r.scenario] = r.throughput
        scale = r.throughput / base[r.scenario] if base.get(r.scenario) else math.nan
        writes = "-" if r.writes_per_cycle is None else f"{r.writes_per_cycle:.2f}"
        lines.append(f"{r.scenario:<8} {r.pool:>4} {r.clients:>7} {r.cycles:>6} {r.errors:>6} "
                     f"{_ms(r.prepare_p50_s):>11} {_ms(r.prepare_p99_s):>7} "
                     f"{_ms(r.unprepare_p50_s):>13} {_ms(r.unprepare_p99_s):>7} "
                     f"{r.throughput:>8.1f} {scale:>5.1f}x {writes:>17} "
                     f"{r.cpu_per_cycle_s * 1e3:>18.2f}")
    p = result.in_process
    lines += [
        "",
        f"# In-process (ClaimService over SimulatedNode, no HTTP), the same directories; "
        f"{p.samples} interleaved samples",
        f"{'operation':<62} {'ms p50':>7} {'ms p99':>7}",
        f"{f'durable write of the checkpoint ({p.write_bytes} B median)':<62} "
        f"{_ms(p.write_p50_s):>7} {_ms(p.write_p99_s):>7}",
        f"{'prepare, existing whole GPU, one at a time':<62} {_ms(p.prepare_p50_s):>7} "
        f"{_ms(p.prepare_p99_s):>7}",
        f"{'unprepare, existing whole GPU, one at a time':<62} {_ms(p.unprepare_p50_s):>7} "
        f"{_ms(p.unprepare_p99_s):>7}",
        "",
        f"{'kind':<6} {'at once':>7} {'prepares':>8} {'errors':>6} {'ckpt writes/prepare':>19} "
        f"{'fsyncs/prepare':>14} {'ckpt writes/unprepare':>21} {'prepares/s':>10}",
    ]
    for b in p.batches:
        lines.append(f"{b.kind:<6} {b.concurrent:>7} {b.prepares:>8} {b.errors:>6} "
                     f"{b.writes_per_prepare:>19.3f} {b.fsyncs_per_prepare:>14.2f} "
                     f"{b.writes_per_unprepare:>21.3f} {b.prepares_per_s:>10.0f}")
    lines += ["", "# Targets"]
    lines.append(f"server-side prepare p99 / durable write p99 = {p.prepare_vs_write:.2f} "
                 f"(target <= {PREPARE_P99_TARGET:g}): "
                 f"{_verdict(p.prepare_vs_write <= PREPARE_P99_TARGET)}")
    for scenario in ("gpu", "mig", "slice"):
        scaling = result.scaling(scenario)
        rows = [r for r in result.http if r.scenario == scenario]
        if scaling is None or not rows:
            continue
        most = max(rows, key=lambda r: r.clients)
        one = next(r for r in rows if r.clients == 1)
        # The agent serves from one event loop: its CPU per cycle under load bounds the rate
        # any number of clients can get, and so the ratio.
        ceiling = 1 / most.cpu_per_cycle_s / one.throughput
        lines.append(f"throughput {most.clients} clients / 1 client, {scenario}: {scaling:.1f}x "
                     f"(target >= {SCALING_TARGET:g}): {_verdict(scaling >= SCALING_TARGET)}; "
                     f"ceiling set by the agent's CPU per cycle: {ceiling:.1f}x")
    return lines


# What ``bench.compare`` compares against a baseline tree: 1 client's prepare and unprepare
# p50 per scenario, the cycle time (the inverse of throughput) with the most clients, the
# agent's CPU per cycle, and the in-process prepare/unprepare p50. A baseline tree without
# this function is measured through the same fields by ``bench/compare_driver.py``.
COMPARE_CLIENTS = (1, 16)
COMPARE_CYCLES = 128
COMPARE_SAMPLES = 300


def figures_of(result: ClaimsResult) -> dict[str, float]:
    """The compared figures of one run, each lower-is-better (ms)."""
    out: dict[str, float] = {}
    most = max(r.clients for r in result.http)
    for r in result.http:
        if r.clients == 1:
            out[f"http {r.scenario} prepare p50 ms, 1 client"] = r.prepare_p50_s * 1e3
            out[f"http {r.scenario} unprepare p50 ms, 1 client"] = r.unprepare_p50_s * 1e3
        if r.clients == most:
            out[f"http {r.scenario} ms per cycle, {most} clients"] = (
                1e3 / r.throughput if r.throughput else math.inf)
            out[f"http {r.scenario} agent CPU ms per cycle, {most} clients"] = (
                r.cpu_per_cycle_s * 1e3)
    p = result.in_process
    out["in-process prepare p50 ms"] = p.prepare_p50_s * 1e3
    out["in-process unprepare p50 ms"] = p.unprepare_p50_s * 1e3
    return out


def figures(clients: Sequence[int] = COMPARE_CLIENTS, cycles: int = COMPARE_CYCLES,
            samples: int = COMPARE_SAMPLES) -> dict[str, float]:
    """One short run for ``bench.compare`` (one prepare per in-process batch kind): name ->
    value, lower is better."""
    result = run(clients, cycles, samples, concurrent=(1,), repeats=1,
                 directory=Path(tempfile.gettempdir()))
    return figures_of(result)


def main(clients: Sequence[int] = CLIENTS, cycles: int = CYCLES, samples: int = SAMPLES) -> None:
    directory = Path(tempfile.gettempdir())
    result = run(clients, cycles, samples, directory=directory)
    print("\n".join(report(result, _filesystem(directory))))


if __name__ == "__main__":
    main()
