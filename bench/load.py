"""Load driver: concurrent claim prepare/unprepare cycles against a real agent process.

A real ``gpu-agent serve --simulate dgx-h100`` process (simulated NVML latencies off, so what
is measured is the agent). Layout of the node:

* GPUs 0-1: MIG off, whole-GPU claims (``{"kind": "gpu", "device": "<index>"}``);
* GPUs 2-4: MIG on, 7 x 1g.10gb existing devices, claimed by MIG UUID;
* GPUs 5-6: MIG on and empty, on-demand ``1g.10gb`` slices (``"gpu"`` pins them there;
  7 slots each);
* GPU 7: geometry changes only, alternating between two layouts; no claim uses it.

``clients`` asyncio tasks share one aiohttp session; each loops: pick one of the 37 targets
at random (from the seed), ``PUT /v1/claims/{uid}`` with a fresh uid, and when that is
acknowledged ``DELETE`` it. Devices are shared, so prepares collide: 409 (busy) is an answer
the agent may give. Meanwhile ``/metrics`` is scraped every 100 ms, ``GET /v1/claims`` is
checked against what the clients know every 250 ms, and GPU 7's geometry is changed every
500 ms (waiting for each transition to end, which must succeed).

Checked: every answer is one of the specified codes (prepare 200/409, unprepare 204, MIG PUT
200/202/409, metrics and claim list 200; anything else, a 5xx above all, or a transport error
is a failure); no claim is lost, duplicated or invented (each ``/v1/claims`` snapshot holds
every uid acknowledged before it was asked for and not since being unprepared, and only uids
whose prepare was sent before it answered and that were not refused or unprepared before it
was asked for); at the end no claim remains, the checkpoint on disk equals ``/v1/claims``
(both empty) and GPUs 0-6 have their start layout again.

``python -m bench --only load`` (10,000 operations, 64 clients) or ``python -m bench.load
--operations N --clients C --seed S`` prints a table (operations are claim prepares plus
unprepares; scrapes and MIG changes come on top); the CI test runs a bounded version.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import re
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from agent.claims.checkpoint import decode
from bench.claims import machine, percentile
from tests.agent_process import AgentProcess, start_agent

WHOLE_GPUS = ("0", "1")
MIG_GPUS = ("2", "3", "4")
SLICE_GPUS = ("5", "6")
GEOMETRY_GPU = "7"
ONE_G = "1g.10gb"
GEOMETRIES: tuple[dict[str, Any], ...] = (
    {"profiles": ["7g.80gb"]},
    {"profiles": ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]},
)
SCRAPE_S = 0.1
CLAIMS_CHECK_S = 0.25
GEOMETRY_S = 0.5
EXPECTED = {"prepare": {200, 409}, "unprepare": {204}, "mig": {200, 202, 409},
            "metrics": {200}, "claims": {200}, "transition": {200}}


@dataclass
class Figures:
    operations: int = 0  # claim prepares + unprepares answered
    elapsed_s: float = 0.0
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    codes: dict[str, dict[int, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    failures: list[str] = field(default_factory=list)
    snapshots: int = 0  # /v1/claims snapshots checked
    transitions: int = 0  # geometry transitions that ended (succeeded)
    max_claims: int = 0  # most claims seen at once
    refusals: Counter[str] = field(default_factory=Counter)  # 409s by operation and detail

    def errors(self, op: str) -> int:
        return sum(n for code, n in self.codes[op].items()
                   if code not in EXPECTED[op.split(":", maxsplit=1)[0]])


class _Wait(Exception):
    """A request got no answer (already recorded as a failure)."""


def _set_mig(agent: AgentProcess, gpu: str, body: dict[str, Any]) -> None:
    reply = agent.request("PUT", f"/v1/gpus/{gpu}/mig", body)
    if reply.status not in (200, 202):
        raise AssertionError(f"PUT /v1/gpus/{gpu}/mig: {reply.status} {reply.body}")
    if reply.status == 202:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = agent.request("GET", reply.headers["location"]).body
            if state["terminal"]:
                if state["state"] != "succeeded":
                    raise AssertionError(f"setup of GPU {gpu}: {state}")
                return
            time.sleep(0.01)
        raise AssertionError(f"setup of GPU {gpu} did not end")


def layouts(agent: AgentProcess) -> dict[str, list[str]]:
    """Every GPU's layout: ``["MIG off"]`` or its sorted ``profile@start:size`` list."""
    out = {}
    for gpu in range(8):
        body = agent.request("GET", f"/v1/gpus/{gpu}/mig").body
        out[str(gpu)] = (["MIG off"] if not body["mig_mode"]["current"] else sorted(
            f"{i['profile']}@{i['placement']['start']}:{i['placement']['size']}"
            for i in body["instances"]))
    return out


class Load:
    def __init__(self, agent: AgentProcess, *, operations: int, clients: int, seed: int,
                 figures: Figures) -> None:
        self.agent = agent
        self.target = operations
        self.clients = clients
        self.rng = random.Random(seed)
        self.f = figures
        self.started = 0  # operations handed out
        self.serial = 0
        self.done = asyncio.Event()
        # what the clients know, by uid: perf_counter times
        self.prepare_sent: dict[str, float] = {}
        self.acked: dict[str, float] = {}
        self.refused: dict[str, float] = {}
        self.unprepare_sent: dict[str, float] = {}
        self.unprepared: dict[str, float] = {}
        self.devices: list[dict[str, Any]] = []

    def pool(self) -> None:
        gpus = {str(g["index"]): g for g in self.agent.request("GET", "/v1/gpus").body["gpus"]}
        whole = [{"kind": "gpu", "device": gpu} for gpu in WHOLE_GPUS]
        mig = [{"kind": "gpu", "device": d["uuid"]}
               for gpu in MIG_GPUS for d in gpus[gpu]["mig_devices"]]
        if len(mig) != 7 * len(MIG_GPUS):
            raise AssertionError(f"expected {7 * len(MIG_GPUS)} MIG devices, got {len(mig)}")
        slices = [{"kind": "slice", "profile": ONE_G, "gpu": gpu}
                  for gpu in SLICE_GPUS for _ in range(7)]
        # every target equally likely: 2 whole GPUs, 21 MIG devices, 14 slice slots; with more
        # clients than targets, prepares collide (409) on all three kinds
        self.devices = [*whole, *mig, *slices]

    def _record(self, op: str, status: int, seconds: float, what: str) -> None:
        self.f.codes[op][status] += 1
        self.f.latencies[op].append(seconds)
        if status not in EXPECTED[op.split(":", maxsplit=1)[0]]:
            self.f.failures.append(f"{op} {what}: unexpected {status}")

    async def _call(self, http: aiohttp.ClientSession, op: str, method: str, path: str,
                    body: Any = None) -> tuple[int, Any, dict[str, str]]:
        began = time.perf_counter()
        try:
            async with http.request(method, path, json=body) as r:
                raw = await r.read()
                status, headers = r.status, dict(r.headers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.f.failures.append(f"{op} {method} {path}: {type(exc).__name__}: {exc}")
            raise _Wait from exc
        self._record(op, status, time.perf_counter() - began, f"{method} {path} {raw[:300]!r}")
        parsed: Any = None
        if raw and headers.get("Content-Type", "").split(";")[0].endswith("json"):
            parsed = json.loads(raw)
        if status == 409 and isinstance(parsed, dict):
            detail = re.sub(r"MIG-[0-9a-f-]+|GPU-[0-9a-f-]+|load-\d+|\d+", "#",
                            str(parsed.get("detail", "")))
            self.f.refusals[f"{op}: {detail[:90]}"] += 1
        return status, parsed, headers

    def _take(self) -> bool:
        if self.started >= self.target:
            return False
        self.started += 1
        return True

    async def client(self, http: aiohttp.ClientSession) -> None:
        while self._take():
            device = self.rng.choice(self.devices)
            kind = "slice" if device["kind"] == "slice" else (
                "mig" if device["device"].startswith("MIG-") else "gpu")
            self.serial += 1
            uid = f"load-{self.serial}"
            self.prepare_sent[uid] = time.perf_counter()
            try:
                status, _, _ = await self._call(http, f"prepare:{kind}", "PUT", f"/v1/claims/{uid}",
                                                {"devices": [device]})
            except _Wait:
                continue
            self.f.operations += 1
            if status != 200:
                self.refused[uid] = time.perf_counter()
                continue
            self.acked[uid] = time.perf_counter()
            self.started += 1  # the unprepare is an operation too
            self.unprepare_sent[uid] = time.perf_counter()
            try:
                status, _, _ = await self._call(http, f"unprepare:{kind}", "DELETE",
                                                f"/v1/claims/{uid}")
            except _Wait:
                continue
            self.f.operations += 1
            if status == 204:
                self.unprepared[uid] = time.perf_counter()

    async def scraper(self, http: aiohttp.ClientSession) -> None:
        while not self.done.is_set():
            began = time.perf_counter()
            with contextlib.suppress(_Wait):
                await self._call(http, "metrics", "GET", "/metrics")
            await self._sleep(SCRAPE_S - (time.perf_counter() - began))

    async def claims_checker(self, http: aiohttp.ClientSession) -> None:
        while not self.done.is_set():
            await self.check_snapshot(http)
            await self._sleep(CLAIMS_CHECK_S)

    async def check_snapshot(self, http: aiohttp.ClientSession) -> set[str]:
        asked = time.perf_counter()
        try:
            status, body, _ = await self._call(http, "claims", "GET", "/v1/claims")
        except _Wait:
            return set()
        answered = time.perf_counter()
        if status != 200:
            return set()
        self.f.snapshots += 1
        listed = [c["uid"] for c in body["claims"]]
        seen = set(listed)
        self.f.max_claims = max(self.f.max_claims, len(seen))
        if len(listed) != len(seen):
            self.f.failures.append(f"duplicated claims in /v1/claims: {sorted(listed)}")
        for uid in seen:
            sent = self.prepare_sent.get(uid)
            if sent is None or sent > answered:
                self.f.failures.append(f"claim {uid} listed but never prepared")
            elif self.refused.get(uid, math.inf) < asked:
                self.f.failures.append(f"claim {uid} listed but its prepare was refused")
            elif self.unprepared.get(uid, math.inf) < asked:
                self.f.failures.append(f"claim {uid} listed after its unprepare")
        for uid, at in list(self.acked.items()):
            if at < asked and self.unprepare_sent.get(uid, math.inf) > answered \
                    and uid not in seen:
                self.f.failures.append(f"claim {uid} acknowledged but not listed (lost)")
        return seen

    async def geometry(self, http: aiohttp.ClientSession) -> None:
        turn = 0
        while not self.done.is_set():
            turn += 1
            try:
                status, _, headers = await self._call(
                    http, "mig", "PUT", f"/v1/gpus/{GEOMETRY_GPU}/mig",
                    GEOMETRIES[turn % len(GEOMETRIES)])
                if status == 202:
                    await self._transition(http, headers["Location"])
            except _Wait:
                pass
            await self._sleep(GEOMETRY_S)

    async def _transition(self, http: aiohttp.ClientSession, location: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status, state, _ = await self._call(http, "transition", "GET", location)
            if status == 200 and state["terminal"]:
                self.f.transitions += 1
                if state["state"] != "succeeded":
                    self.f.failures.append(f"GPU {GEOMETRY_GPU} transition: {state}")
                return
            await asyncio.sleep(0.02)
        self.f.failures.append(f"GPU {GEOMETRY_GPU} transition did not end")

    async def _sleep(self, seconds: float) -> None:
        if seconds <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.done.wait(), seconds)

    async def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.agent.token}"}
        connector = aiohttp.TCPConnector(limit=self.clients + 8)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(self.agent.url, headers=headers, connector=connector,
                                         timeout=timeout) as http:
            background = [asyncio.create_task(job(http)) for job in
                          (self.scraper, self.claims_checker, self.geometry)]
            began = time.perf_counter()
            await asyncio.gather(*(self.client(http) for _ in range(self.clients)))
            self.f.elapsed_s = time.perf_counter() - began
            self.done.set()
            await asyncio.gather(*background)
            seen = await self.check_snapshot(http)  # quiet now: must be exactly empty
            if seen:
                self.f.failures.append(f"claims left at the end: {sorted(seen)}")


def run(operations: int, clients: int, seed: int, workdir: Path | None = None) -> Figures:
    """Start an agent, lay the node out, drive the load, check the end state."""
    figures = Figures()
    with tempfile.TemporaryDirectory(prefix="gpu-agent-load-") as tmp:
        state = (workdir or Path(tmp)) / "state"
        agent = start_agent(state)
        try:
            agent.request("PUT", "/v1/sim/latency", {})
            for gpu in WHOLE_GPUS:
                _set_mig(agent, gpu, {"mig_enabled": False})
            for gpu in MIG_GPUS:
                _set_mig(agent, gpu, {"profiles": [ONE_G] * 7})
            for gpu in SLICE_GPUS:
                _set_mig(agent, gpu, {"profiles": []})
            _set_mig(agent, GEOMETRY_GPU, GEOMETRIES[0])
            before = layouts(agent)
            load = Load(agent, operations=operations, clients=clients, seed=seed,
                        figures=figures)
            load.pool()
            asyncio.run(load.run())
            _final_checks(agent, state, before, figures)
        finally:
            agent.stop()
    return figures


def _final_checks(agent: AgentProcess, state: Path, before: dict[str, list[str]],
                  figures: Figures) -> None:
    api = {c["uid"]: sorted(d["uuid"] for d in c["devices"])
           for c in agent.request("GET", "/v1/claims").body["claims"]}
    on_disk = decode((state / "claims.checkpoint").read_bytes())
    disk = {uid: sorted(str(d.uuid) for d in r.devices) for uid, r in on_disk.claims.items()}
    if api != disk:
        figures.failures.append(f"checkpoint {disk} != API {api}")
    if api:
        figures.failures.append(f"claims remain at the end: {sorted(api)}")
    after = layouts(agent)
    for gpu in (*WHOLE_GPUS, *MIG_GPUS, *SLICE_GPUS):
        if after[gpu] != before[gpu]:
            figures.failures.append(f"GPU {gpu} layout {after[gpu]} != start {before[gpu]}")


def table(figures: Figures, *, clients: int, seed: int) -> str:
    lines = [f"load: {figures.operations} claim operations, {clients} clients, seed {seed}, "
             f"{figures.elapsed_s:.1f} s, {machine()}",
             f"{'operation':<11} {'count':>7} {'errors':>6} {'per s':>8} {'p50 ms':>8} "
             f"{'p99 ms':>8}  codes"]
    for op in ("prepare", "prepare:gpu", "prepare:mig", "prepare:slice", "unprepare",
               "unprepare:gpu", "unprepare:mig", "unprepare:slice", "metrics", "claims", "mig",
               "transition"):
        keys = [k for k in figures.latencies if k == op or k.startswith(op + ":")]
        values = [v for k in keys for v in figures.latencies[k]]
        merged: dict[int, int] = defaultdict(int)
        for k in keys:
            for code, n in figures.codes[k].items():
                merged[code] += n
        codes = ", ".join(f"{c}: {n}" for c, n in sorted(merged.items()))
        errors = sum(figures.errors(k) for k in keys)
        rate = len(values) / figures.elapsed_s if figures.elapsed_s else 0.0
        lines.append(f"{op:<11} {len(values):>7} {errors:>6} {rate:>8.1f} "
                     f"{percentile(values, 50) * 1000:>8.1f} "
                     f"{percentile(values, 99) * 1000:>8.1f}  {codes}")
    lines.append(f"claim operations/s: {figures.operations / figures.elapsed_s:.1f}; "
                 f"most claims at once: {figures.max_claims}; /v1/claims snapshots checked: "
                 f"{figures.snapshots}; GPU {GEOMETRY_GPU} transitions: {figures.transitions}")
    lines.append("409 answers:")
    lines += [f"  {n:>6}  {what}" for what, n in figures.refusals.most_common(8)]
    lines.append(f"failures: {len(figures.failures)}")
    lines += [f"  {f}" for f in figures.failures[:20]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--operations", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    figures = run(args.operations, args.clients, args.seed)
    print(table(figures, clients=args.clients, seed=args.seed))
    return 1 if figures.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
