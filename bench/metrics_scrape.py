"""Scrape latency, collector CPU and agent RSS of ``/metrics`` (issue 5 targets).

1. A real ``gpu-agent serve --simulate dgx-h100`` with every GPU split into 7x 1g.10gb (8 GPUs
   + 56 MIG devices): scrape latency p50/p99 server-side (the agent's access log) and at the
   client, response sizes; the whole agent's CPU per collect interval with no scrapes; then a
   soak with one scrape a second: CPU, steady RSS and its growth.
2. The same exposition at dcgm-exporter's scale in-process: 30 fields x 64 entities = 1,920
   series carrying dcgm-exporter's labels (the simulator models fewer fields than a real H100
   has), rendered once per collection and served from the cache, against prometheus-client's
   ``generate_latest`` of the same series.
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import psutil
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from agent.metrics.agent import AgentMetrics
from agent.metrics.exposition import CachedBlock, DeviceSeries, labels_text, render, scrape
from agent.metrics.fields import FIELDS
from tests.agent_process import start_agent

INTERVAL_S = 5.0
SCRAPES = 400
IDLE_S = 30.0
SOAK_S = 60.0
RSS_EVERY_S = 10.0
PROFILES = ["1g.10gb"] * 7

# dcgm-exporter's published figures (reference/dcgm-exporter-and-cdi.md, A4 and A5).
DCGM_EXPORTER = (
    ("RSS", "400-500 MiB default config (#609); 451-486 MiB on 8-GPU nodes, 48% OOM-killed "
            "at 512 MiB (pytorch/ci-infra#1011); grows to 512 MiB in 24-48 h (#702)"),
    ("CPU", "15-20% of a core (gpu-monitoring-tools#133); 131% on an idle host (#311); up to "
            "10 cores on H100/H200 MIG nodes (#599)"),
    ("scrape", "scrape_duration ~10 s, Prometheus' timeout (#607); i/o timeouts (#625, #372)"),
    ("limits", "Helm: 200m CPU / 512 MiB; collect interval 30 s"),
)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Agent:
    """The agent under test, with a JSON access log to read server-side durations from (reads
    log at debug since the access lines of successful GETs went there)."""

    def __init__(self, state: Path) -> None:
        self.process = start_agent(state, extra=[
            "--metrics-listen", "127.0.0.1:0", "--collect-interval", str(INTERVAL_S),
            "--log-format", "json", "--log-level", "debug"])
        self.log = self.process.log_path
        self.metrics = self.process.listener("metrics").removeprefix("http://")
        self.usage = psutil.Process(self.process.proc.pid)

    def split_all(self) -> None:
        for gpu in range(8):
            reply = self.process.request("PUT", f"/v1/gpus/{gpu}/mig", {"profiles": PROFILES})
            if reply.status not in (200, 202):
                raise RuntimeError(f"GPU {gpu}: {reply.status} {reply.body}")
            if reply.body.get("transition"):
                self.process.poll(f"/v1/transitions/{reply.body['transition']['id']}",
                                  lambda body: body["terminal"], interval=0.01)

    def scrapes(self, count: int, encoding: str) -> tuple[list[float], int, int]:
        """Client-side seconds per scrape on one keep-alive connection; size; series."""
        host, port = self.metrics.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        headers = {"Accept-Encoding": encoding} if encoding else {}
        times: list[float] = []
        body = b""
        for _ in range(count):
            started = time.perf_counter()
            conn.request("GET", "/metrics", headers=headers)
            body = conn.getresponse().read()
            times.append(time.perf_counter() - started)
        conn.close()
        text = gzip.decompress(body) if encoding else body
        series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
        return times, len(body), series

    def server_ms(self, since: int) -> list[float]:
        """The access log's duration_ms of /metrics requests after byte offset ``since``."""
        found = []
        with self.log.open("rb") as log:
            log.seek(since)
            for line in log:
                if b'"path": "/metrics"' in line:
                    found.append(float(json.loads(line)["duration_ms"]))
        return found

    def collection_totals(self) -> tuple[float, float]:
        """Seconds spent in collection rounds so far and their count, from the agent's own
        histogram."""
        host, port = self.metrics.rsplit(":", 1)
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

    def collection_rounds(self) -> float:
        """Mean wall time of a collection round (ms), from the agent's own histogram."""
        seconds, count = self.collection_totals()
        return seconds / count * 1000

    def log_size(self) -> int:
        return self.log.stat().st_size

    def cpu_s(self) -> float:
        times = self.usage.cpu_times()
        return float(times.user + times.system)

    def rss_mib(self) -> float:
        return float(self.usage.memory_info().rss) / 2**20

    def stop(self) -> None:
        self.process.stop(timeout=30)


def real_agent(idle_s: float, soak_s: float) -> list[str]:
    rows: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        agent = Agent(Path(tmp) / "state")
        try:
            agent.split_all()
            time.sleep(INTERVAL_S + 0.5)  # a collection that sees all 56 MIG devices
            for encoding in ("", "gzip"):
                mark = agent.log_size()
                client, size, series = agent.scrapes(SCRAPES, encoding)
                server = agent.server_ms(mark)
                rows.append(
                    f"{'scrape ' + (encoding or 'plain'):<22} {series:>7} {size / 1024:>9.1f} "
                    f"{_pct(server, 0.5):>9.2f} {_pct(server, 0.99):>9.2f} "
                    f"{_pct(client, 0.5) * 1000:>9.2f} {_pct(client, 0.99) * 1000:>9.2f} "
                    f"{'yes' if _pct(server, 0.99) <= 5 else 'NO':>8}")
            time.sleep(1.0)
            cpu0, wall0 = agent.cpu_s(), time.monotonic()
            time.sleep(idle_s)
            cpu = agent.cpu_s() - cpu0
            share = cpu / (time.monotonic() - wall0) * 100
            per_interval = cpu / ((time.monotonic() - wall0) / INTERVAL_S) * 1000
            rounds = agent.collection_rounds()
            rows.append(f"{'idle, no scrapes':<22} CPU {share:.2f}% of a core = "
                        f"{per_interval:.1f} ms per {INTERVAL_S:g} s interval (whole agent); "
                        f"collection round {rounds:.1f} ms (mean wall); "
                        f"target <= 2%: {'yes' if share <= 2 else 'NO'}")
            rss: list[float] = []
            host, port = agent.metrics.rsplit(":", 1)
            cpu0, wall0 = agent.cpu_s(), time.monotonic()
            next_rss = wall0
            while time.monotonic() - wall0 < soak_s:
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                conn.request("GET", "/metrics")
                conn.getresponse().read()
                conn.close()
                if time.monotonic() >= next_rss:
                    rss.append(agent.rss_mib())
                    next_rss += RSS_EVERY_S
                time.sleep(1.0)
            rss.append(agent.rss_mib())
            share = (agent.cpu_s() - cpu0) / (time.monotonic() - wall0) * 100
            steady = statistics.median(rss)
            growth = rss[-1] - rss[0]
            rows.append(f"{f'soak {soak_s:g} s, 1 scrape/s':<22} CPU {share:.2f}% of a core; "
                        f"RSS {steady:.1f} MiB (min {min(rss):.1f}, max {max(rss):.1f}), "
                        f"growth {growth:+.1f} MiB; target <= 80 MiB: "
                        f"{'yes' if max(rss) <= 80 else 'NO'}")
        finally:
            agent.stop()
    return rows


Pairs = list[tuple[str, str]]


def dcgm_scale_entities(fields: int = 30) -> list[tuple[Pairs, dict[str, float]]]:
    """8 GPUs + 56 MIG GPU instances, ``fields`` DCGM fields each, dcgm-exporter's labels."""
    names = [f.name for f in FIELDS if f.name != "DCGM_FI_DEV_XID_ERRORS"][:fields]
    values = {name: 1000 + i * 0.5 for i, name in enumerate(names)}
    tail = [("Hostname", "gpu-node-017"), ("DCGM_FI_DRIVER_VERSION", "570.133.20")]
    entities: list[tuple[Pairs, dict[str, float]]] = []
    for gpu in range(8):
        head = [("gpu", str(gpu)), ("UUID", f"GPU-{gpu:08x}-1111-2222-3333-444455556666"),
                ("pci_bus_id", f"00000000:{0x1B + gpu * 16:02X}:00.0"),
                ("device", f"nvidia{gpu}"), ("modelName", "NVIDIA H100 80GB HBM3")]
        entities.append(([*head, *tail], values))
        for gi in range(7):
            entities.append(([*head, ("GPU_I_PROFILE", "1g.10gb"), ("GPU_I_ID", str(7 + gi)),
                              *tail], values))
    return entities


class _Families:
    """The same series through prometheus-client, for the baseline."""

    def __init__(self, entities: list[tuple[Pairs, dict[str, float]]]) -> None:
        self._entities = entities

    def collect(self) -> Iterable[GaugeMetricFamily]:
        for field in FIELDS:
            rows = [(pairs, values) for pairs, values in self._entities if field.name in values]
            if not rows:
                continue
            family = GaugeMetricFamily(field.name, field.help)
            for pairs, values in rows:
                family.add_sample(field.name, dict(pairs), values[field.name])
            yield family


def _timed(fn: Callable[[], object], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return times


def in_process() -> list[str]:
    entities = dcgm_scale_entities()
    series = [DeviceSeries(labels_text(pairs), values) for pairs, values in entities]
    count = sum(len(d.values) for d in series)
    metrics = AgentMetrics()
    block = CachedBlock(render(series))
    rows = []
    build = _timed(lambda: CachedBlock(render(series)), 50)
    rows.append(f"{'render + gzip (collector)':<34} {count:>6} {_pct(build, 0.5):>9.2f} "
                f"{_pct(build, 0.99):>9.2f}")
    for label, encoding in (("scrape from cache, plain", ""), ("scrape from cache, gzip", "gzip")):
        served = _timed(partial(scrape, block, metrics.registry, accept_encoding=encoding), 500)
        rows.append(f"{label:<34} {count:>6} {_pct(served, 0.5):>9.2f} {_pct(served, 0.99):>9.2f}")
    registry = CollectorRegistry()
    registry.register(_Families(entities))
    baseline = _timed(lambda: generate_latest(registry), 30)
    rows.append(f"{'prometheus-client generate_latest':<34} {count:>6} "
                f"{_pct(baseline, 0.5):>9.2f} {_pct(baseline, 0.99):>9.2f}")
    return rows


def figures(scrapes: int = 200, rounds: int = 2) -> dict[str, float]:
    """For ``bench.compare``: the real agent's scrape p50s (server and client side, plain and
    gzip), its RSS after them, the mean collection round over the next ``rounds`` rounds (0:
    every round so far), and the in-process render and cached-scrape p50s at
    dcgm-exporter's scale; name -> value, lower is better."""
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        agent = Agent(Path(tmp) / "state")
        try:
            agent.split_all()
            # Rounds from here on see all 56 MIG devices; the scrapes wait for one of them.
            seconds0, count0 = agent.collection_totals() if rounds else (0.0, 0.0)
            time.sleep(INTERVAL_S + 0.5)
            for encoding in ("", "gzip"):
                mark = agent.log_size()
                client, _, _ = agent.scrapes(scrapes, encoding)
                server = agent.server_ms(mark)
                out[f"scrape {encoding or 'plain'} srv p50 ms"] = _pct(server, 0.5)
                out[f"scrape {encoding or 'plain'} cli p50 ms"] = _pct(client, 0.5) * 1000
            out["agent RSS MiB after the scrapes"] = agent.rss_mib()
            deadline = time.monotonic() + rounds * INTERVAL_S + 10
            seconds, count = agent.collection_totals()
            while count < count0 + rounds and time.monotonic() < deadline:
                time.sleep(0.5)
                seconds, count = agent.collection_totals()
            if count <= count0:
                raise RuntimeError(f"no collection round in {rounds * INTERVAL_S + 10:g} s")
            out["collection round mean ms"] = (seconds - seconds0) / (count - count0) * 1000
        finally:
            agent.stop()
    series = [DeviceSeries(labels_text(pairs), values) for pairs, values in dcgm_scale_entities()]
    metrics = AgentMetrics()
    block = CachedBlock(render(series))
    out["in-process render + gzip p50 ms"] = _pct(
        _timed(lambda: CachedBlock(render(series)), 50), 0.5)
    for label, encoding in (("plain", ""), ("gzip", "gzip")):
        served = _timed(partial(scrape, block, metrics.registry, accept_encoding=encoding), 500)
        out[f"in-process scrape from cache {label} p50 ms"] = _pct(served, 0.5)
    return out


def main(idle_s: float = IDLE_S, soak_s: float = SOAK_S) -> None:
    cpu = platform.machine()
    print(f"# /metrics: dgx-h100, every GPU 7x 1g.10gb (8 GPUs + 56 MIG devices), collect "
          f"interval {INTERVAL_S:g} s; {os.cpu_count()} CPUs {cpu}, "
          f"Python {platform.python_version()}")
    print(f"{'real agent process':<22} {'series':>7} {'size KiB':>9} {'srv p50':>9} "
          f"{'srv p99':>9} {'cli p50':>9} {'cli p99':>9} {'p99<=5ms':>8}   (ms)")
    for row in real_agent(idle_s, soak_s):
        print(row)
    print()
    print("# the same exposition at dcgm-exporter's scale, in-process (ms)")
    print(f"{'':<34} {'series':>6} {'p50':>9} {'p99':>9}")
    for row in in_process():
        print(row)
    print()
    print("# dcgm-exporter, published figures")
    for what, figure in DCGM_EXPORTER:
        print(f"{what:<8} {figure}")


if __name__ == "__main__":
    main()
