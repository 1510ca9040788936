"""Start-up time to ready and idle RSS of ``gpu-agent serve --simulate`` (real processes)."""

from __future__ import annotations

import http.client
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

PRESETS = ("dgx-h100", "dgx-a100", "hgx-h200", "a100-pcie-bridged", "l40s")
IDLE_SECONDS = 3.0


def _get(url: str, path: str) -> int:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def one_start(preset: str) -> tuple[float, float, float]:
    """(seconds to /readyz 200, RSS MiB idle, RSS MiB after 20 inventory reads)."""
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "serve", "--simulate", preset, "--state-dir",
             str(state), "--listen", "127.0.0.1:0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            listeners = state / "listeners.json"
            while not listeners.exists():
                time.sleep(0.005)
            url = json.loads(listeners.read_text())["listeners"][0]
            while _get(url, "/readyz") != 200:
                time.sleep(0.005)
            ready = time.perf_counter() - started
            time.sleep(IDLE_SECONDS)
            rss_idle = psutil.Process(proc.pid).memory_info().rss / 2**20
            for _ in range(20):
                _get(url, "/v1/gpus")
            rss_busy = psutil.Process(proc.pid).memory_info().rss / 2**20
            return ready, rss_idle, rss_busy
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def main(runs: int) -> None:
    cpu = platform.machine()
    print(f"# start-up and idle RSS: {runs} starts per preset, medians (min-max); "
          f"{os.cpu_count()} CPUs {cpu}, Python {platform.python_version()}")
    print(f"{'preset':<20} {'ready s':>18} {'idle RSS MiB':>20} {'RSS after 20 reads':>22}")
    for preset in PRESETS:
        samples = [one_start(preset) for _ in range(runs)]
        cols = []
        for i in range(3):
            values = [s[i] for s in samples]
            cols.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        print(f"{preset:<20} {cols[0]:>18} {cols[1]:>20} {cols[2]:>22}")
