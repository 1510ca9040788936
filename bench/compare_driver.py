"""One measurement of one tree, for ``bench.compare``: run as ``python -c <this source> NAME
SIZES OUT`` in the tree's root with ``PYTHONPATH`` set to it, so the bench, and the agent
processes it starts, are that tree's code. Writes ``{"figures": {name: value}, ...}`` to OUT.

A tree whose bench module has ``figures(**sizes)`` is measured through it. A tree without one
(the ``main`` before ``bench.compare`` existed) is measured through the functions its benches
already had, by the ``_legacy_*`` adapters below: they compute the same figures the same way,
and they are pinned to that API on purpose, so the benches may change without breaking a
comparison against the old tree. This file imports only the standard library at the top: it
runs against trees that do not contain it.
"""

from __future__ import annotations

import http.client
import importlib
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

MODULES = {"claims": "bench.claims", "mig-transition": "bench.mig_transition",
           "metrics-scrape": "bench.metrics_scrape"}


def _legacy_claims(bench: ModuleType, clients: list[int], cycles: int,
                   samples: int) -> dict[str, float]:
    result = bench.run(tuple(clients), cycles, samples, concurrent=(1,), repeats=1,
                       directory=Path(tempfile.gettempdir()))
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


def _legacy_mig_transition(bench: ModuleType, runs: int, scenarios: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        agent = bench.start_agent(Path(tmp) / "state")
        try:
            for scenario in bench.SCENARIOS[:scenarios]:
                samples = [bench.measure(agent, scenario) for _ in range(runs)]
                hardware = samples[0].hardware_s
                one = statistics.median(s.one_gpu_s for s in samples)
                every = statistics.median(s.all_gpus_s for s in samples)
                out[f"1 GPU overhead ms: {scenario[0]}"] = (one - hardware) * 1e3
                out[f"8 GPUs overhead ms: {scenario[0]}"] = (every - hardware) * 1e3
        finally:
            agent.stop()
    return out


def _collection_totals(address: str) -> tuple[float, float]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    found = {}
    for line in text.splitlines():
        for suffix in ("sum", "count"):
            if line.startswith(f"gpu_agent_collection_duration_seconds_{suffix} "):
                found[suffix] = float(line.split()[1])
    return found["sum"], found["count"]


def _legacy_metrics_scrape(bench: ModuleType, scrapes: int, rounds: int) -> dict[str, float]:
    out: dict[str, float] = {}
    pct, interval = bench._pct, bench.INTERVAL_S
    with tempfile.TemporaryDirectory() as tmp:
        agent = bench.Agent(Path(tmp) / "state")
        try:
            agent.split_all()
            # Rounds from here on see all 56 MIG devices; the scrapes wait for one of them.
            seconds0, count0 = _collection_totals(agent.metrics) if rounds else (0.0, 0.0)
            time.sleep(interval + 0.5)
            for encoding in ("", "gzip"):
                mark = agent.log_size()
                client, _, _ = agent.scrapes(scrapes, encoding)
                server = agent.server_ms(mark)
                out[f"scrape {encoding or 'plain'} srv p50 ms"] = pct(server, 0.5)
                out[f"scrape {encoding or 'plain'} cli p50 ms"] = pct(client, 0.5) * 1000
            out["agent RSS MiB after the scrapes"] = agent.rss_mib()
            deadline = time.monotonic() + rounds * interval + 10
            seconds, count = _collection_totals(agent.metrics)
            while count < count0 + rounds and time.monotonic() < deadline:
                time.sleep(0.5)
                seconds, count = _collection_totals(agent.metrics)
            if count <= count0:
                raise RuntimeError(f"no collection round in {rounds * interval + 10:g} s")
            out["collection round mean ms"] = (seconds - seconds0) / (count - count0) * 1000
        finally:
            agent.stop()
    series = [bench.DeviceSeries(bench.labels_text(pairs), values)
              for pairs, values in bench.dcgm_scale_entities()]
    metrics = bench.AgentMetrics()
    block = bench.CachedBlock(bench.render(series))
    out["in-process render + gzip p50 ms"] = pct(
        bench._timed(lambda: bench.CachedBlock(bench.render(series)), 50), 0.5)
    for label, encoding in (("plain", ""), ("gzip", "gzip")):
        served = bench._timed(partial(bench.scrape, block, metrics.registry,
                                      accept_encoding=encoding), 500)
        out[f"in-process scrape from cache {label} p50 ms"] = pct(served, 0.5)
    return out


LEGACY = {"claims": _legacy_claims, "mig-transition": _legacy_mig_transition,
          "metrics-scrape": _legacy_metrics_scrape}


def _stop(signum: int, frame: FrameType | None) -> None:
    # SIGTERM from the runner's timeout: unwind, so the benches' finally blocks stop the agent
    # processes they started (they run in sessions of their own and would outlive a kill).
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> None:
    name, sizes_json, out_path = argv
    signal.signal(signal.SIGTERM, _stop)
    tree = Path.cwd().resolve()
    sizes: dict[str, Any] = json.loads(sizes_json)
    bench = importlib.import_module(MODULES[name])
    # The tree's, through PYTHONPATH: checked, or the comparison means nothing.
    for module in (importlib.import_module("agent"), bench):
        where = Path(str(module.__file__)).resolve()
        if not where.is_relative_to(tree):
            raise SystemExit(f"{module.__name__} comes from {where}, not from {tree}: "
                             f"PYTHONPATH={os.environ.get('PYTHONPATH')}")
    began = time.perf_counter()
    if hasattr(bench, "figures"):
        figures, via = bench.figures(**sizes), f"{MODULES[name]}.figures"
    else:
        figures, via = LEGACY[name](bench, **sizes), "compare_driver legacy adapter"
    Path(out_path).write_text(json.dumps({
        "figures": figures, "via": via, "seconds": time.perf_counter() - began,
        "python": sys.version.split()[0]}))


if __name__ == "__main__":
    main(sys.argv[1:])
