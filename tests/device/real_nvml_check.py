"""Read-only check of the agent's real NVML backend on a GPU host (never run in CI: CI has no
GPU). Every NVML function that is not a plain read is refused by :mod:`readonly_nvml`, in
this process and in the agent it starts, so the check is safe on a shared machine.

    python -m tests.device.real_nvml_check --out DIR

It writes into DIR:

- ``summary.json``: what NVML answered (driver, GPUs), the agent's answer on every read
  endpoint, NVML read latencies (median/p99 of repeated calls), scrape timings, the
  mutations the guard refused (expected: none), and whether the agent started and stopped
  cleanly;
- ``metrics.txt``: one scrape of the agent's ``/metrics``;
- ``cdi.json``: ``gpu-agent cdi generate`` from the real NVML;
- ``agent.log``: the agent's own log, and ``nvml-timing.json``: NVML calls and seconds per
  function made by the agent over the whole run (its idle phase measures the collector's CPU
  at a 5 s interval);
- ``nvidia-smi.txt``: ``nvidia-smi -q``, ``topo -m`` and ``mig -lgip`` output to compare with.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.agent_process import cpu_seconds
from tests.device import readonly_nvml
from tests.waiting import wait_for

PORT = 18080
METRICS_PORT = 19400
GUARDED_AGENT = ("import sys; from tests.device import readonly_nvml; readonly_nvml.install(); "
                 "from agent.cli.main import main; sys.exit(main(sys.argv[1:]))")
LATENCY_CALLS = (
    "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetUUID",
    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetMigMode", "nvmlDeviceGetPciInfo", "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetNvLinkState",
)


def _get(url: str, timeout: float = 10.0) -> tuple[int, str, float]:
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as err:
        body, status = err.read().decode(), err.code
    except OSError as err:
        return 0, f"{type(err).__name__}: {err}", 0.0
    return status, body, (time.perf_counter() - started) * 1000


def _json_or_text(body: str) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body


def _latency_args(nvml: Any, name: str, handle: Any, uuid: str) -> tuple[Any, ...]:
    return {
        "nvmlDeviceGetHandleByIndex": (0,),
        "nvmlDeviceGetHandleByUUID": (uuid,),
        "nvmlDeviceGetTemperature": (handle, nvml.NVML_TEMPERATURE_GPU),
        "nvmlDeviceGetClockInfo": (handle, nvml.NVML_CLOCK_SM),
        "nvmlDeviceGetFieldValues": (handle, [nvml.NVML_FI_DEV_POWER_INSTANT,
                                              nvml.NVML_FI_DEV_ENERGY]),
        "nvmlDeviceGetNvLinkState": (handle, 0),
    }.get(name, (handle,))


def _recovery_answers(nvml: Any, handle: Any) -> dict[str, Any]:
    """How this driver answers NVML's recovery action (field 230) and the deprecated 226/227:
    each field's status, value type and value, and whether it offers the recovery-action
    event, which is what the simulator models (``agent/gpu/sim/nvml.py``)."""
    try:
        found = nvml.nvmlDeviceGetFieldValues(handle, [230, 226, 227])
        events = int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
    except nvml.NVMLError as err:
        return {"error": str(err)}
    return {"fields": {str(int(v.fieldId)): {
        "return": int(v.nvmlReturn), "value_type": int(v.valueType),
        "value": int(v.value.ullVal)} for v in found},
        "event_offered": bool(events & 0x8000)}  # nvmlEventTypeGpuRecoveryAction


def nvml_facts(repeats: int) -> dict[str, Any]:
    """Driver, GPUs and read latencies straight from pynvml (guarded)."""
    import pynvml as nvml  # noqa: PLC0415

    nvml.nvmlInit()
    try:
        facts: dict[str, Any] = {
            "driver": nvml.nvmlSystemGetDriverVersion(),
            "nvml": nvml.nvmlSystemGetNVMLVersion(),
            "cuda_driver": nvml.nvmlSystemGetCudaDriverVersion_v2(),
            "gpus": [], "latency_us": {},
        }
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            gpu: dict[str, Any] = {"index": index, "uuid": nvml.nvmlDeviceGetUUID(handle),
                                   "name": nvml.nvmlDeviceGetName(handle)}
            for key, fn in (("mig_mode", "nvmlDeviceGetMigMode"),
                            ("minor", "nvmlDeviceGetMinorNumber"),
                            ("memory_total", "nvmlDeviceGetMemoryInfo"),
                            ("bus_id", "nvmlDeviceGetPciInfo"),
                            ("max_mig_devices", "nvmlDeviceGetMaxMigDeviceCount")):
                try:
                    value = getattr(nvml, fn)(handle)
                    gpu[key] = (value.total if key == "memory_total" else
                                value.busId if key == "bus_id" else value)
                except nvml.NVMLError as err:
                    gpu[key] = f"error: {err}"
            gpu["recovery_action"] = _recovery_answers(nvml, handle)
            facts["gpus"].append(gpu)
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        for name in LATENCY_CALLS:
            args = _latency_args(nvml, name, handle, uuid)
            samples, error = [], None
            for _ in range(repeats):
                started = time.perf_counter()
                try:
                    getattr(nvml, name)(*args)
                except nvml.NVMLError as err:
                    error = str(err)
                samples.append((time.perf_counter() - started) * 1e6)
            samples.sort()
            facts["latency_us"][name] = {
                "median": round(statistics.median(samples), 1),
                "p99": round(samples[int(len(samples) * 0.99) - 1], 1),
                "error": error,
            }
        return facts
    finally:
        nvml.nvmlShutdown()


def run_agent(out: Path, work: Path, seconds: float, ready_timeout: float) -> dict[str, Any]:
    """Start the guarded agent on the real NVML, read every read endpoint, scrape, stop it."""
    result: dict[str, Any] = {"endpoints": {}}
    log = (out / "agent.log").open("w")
    command = [sys.executable, "-c", GUARDED_AGENT, "serve",
               "--state-dir", str(work / "state"), "--cdi-dir", str(work / "cdi"),
               "--listen", f"127.0.0.1:{PORT}", "--metrics-listen", f"127.0.0.1:{METRICS_PORT}",
               "--collect-interval", "5", "--log-format", "json", "--node-name", "device-check"]
    started = time.monotonic()
    env = dict(os.environ, **{readonly_nvml.TIMING_ENV: str(out / "nvml-timing.json")})
    agent = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{PORT}"

    def ready() -> float | None:
        """Seconds since the start once ready; -1 once the agent exited (it never will be)."""
        if agent.poll() is not None:
            return -1.0
        status, _body, _ms = _get(f"{base}/readyz", timeout=2)
        return time.monotonic() - started if status == 200 else None

    ready_after: float | None = None
    with contextlib.suppress(AssertionError):  # never ready in time: the result says so
        ready_after = wait_for(ready, "the agent to be ready", ready_timeout, every_s=0.2)
    result["ready_after_s"] = ready_after if ready_after != -1.0 else None
    status, body, _ms = _get(f"{base}/readyz")
    result["readyz"] = {"status": status, "body": _json_or_text(body)}
    if agent.poll() is None:
        result["idle"] = _idle_cpu(agent.pid, seconds)
        _status, body, _ms = _get(f"{base}/v1/gpus")
        gpus = _json_or_text(body)
        uuids = [g["uuid"] for g in gpus.get("gpus", [])] if isinstance(gpus, dict) else []
        paths = ["/healthz", "/v1/node", "/v1/gpus", "/v1/transitions", "/v1/claims", "/v1/cdi",
                 "/v1/events", "/v1/topology", "/v1/resourceslices",
                 "/v1/admin/claims-checkpoint"]
        for uuid in uuids:
            paths += [f"/v1/gpus/{uuid}", f"/v1/gpus/{uuid}/mig", f"/v1/gpus/{uuid}/mig/profiles"]
        for path in paths:
            status, body, ms = _get(base + path)
            result["endpoints"][path] = {"status": status, "ms": round(ms, 2),
                                         "body": _json_or_text(body)}
        scrapes = []
        for _ in range(50):
            status, body, ms = _get(f"http://127.0.0.1:{METRICS_PORT}/metrics")
            scrapes.append(ms)
        (out / "metrics.txt").write_text(body)
        scrapes.sort()
        result["scrape_ms"] = {"status": status, "median": round(statistics.median(scrapes), 2),
                               "max": round(scrapes[-1], 2), "series": sum(
                                   1 for line in body.splitlines() if line and line[0] != "#")}
    agent.send_signal(signal.SIGTERM)
    try:
        result["exit_code"] = agent.wait(timeout=30)
    except subprocess.TimeoutExpired:
        agent.kill()
        result["exit_code"] = "killed after 30 s"
    log.close()
    result["blocked_in_agent"] = [line.split()[-1] for line in
                                  (out / "agent.log").read_text().splitlines()
                                  if line.startswith("readonly-guard: blocked")]
    return result


def _idle_cpu(pid: int, seconds: float) -> dict[str, float]:
    """The whole agent's CPU over ``seconds`` with no requests: the collector and XID watcher."""
    cpu, started = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    used, wall = cpu_seconds(pid) - cpu, time.monotonic() - started
    return {"seconds": round(wall, 1), "cpu_seconds": round(used, 3),
            "percent_of_a_core": round(100 * used / wall, 3)}


def cdi_generate(out: Path, work: Path) -> dict[str, Any]:
    command = [sys.executable, "-c", GUARDED_AGENT, "cdi", "generate",
               "--output", str(work / "cdi-offline")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    specs = sorted((work / "cdi-offline").glob("*.json"))
    if specs:
        (out / "cdi.json").write_bytes(specs[0].read_bytes())
    return {"exit_code": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


def nvidia_smi(out: Path) -> None:
    chunks = []
    for args in (["-q"], ["topo", "-m"], ["mig", "-lgip"], ["mig", "-lgipp"]):
        try:
            done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True,
                                  timeout=60, check=False)
            chunks.append(f"$ nvidia-smi {' '.join(args)}\n{done.stdout}{done.stderr}")
        except (OSError, subprocess.TimeoutExpired) as err:
            chunks.append(f"$ nvidia-smi {' '.join(args)}\n{err}")
    (out / "nvidia-smi.txt").write_text("\n".join(chunks))


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--out", required=True, type=Path)
    options.add_argument("--work", type=Path, default=Path("/tmp/gpu-agent-device-check"))
    options.add_argument("--repeats", type=int, default=500)
    options.add_argument("--seconds", type=float, default=30.0,
                         help="idle phase: the agent's CPU with no requests")
    options.add_argument("--ready-timeout", type=float, default=120.0)
    args = options.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    guarded = readonly_nvml.install()
    summary: dict[str, Any] = {"guarded_functions": len(guarded), "python": sys.version,
                               "uname": " ".join(os.uname())}
    nvidia_smi(args.out)
    for part, step in (("nvml", lambda: nvml_facts(args.repeats)),
                       ("cdi_generate", lambda: cdi_generate(args.out, args.work)),
                       ("agent", lambda: run_agent(args.out, args.work, args.seconds,
                                                 args.ready_timeout))):
        try:
            summary[part] = step()
        except Exception as err:
            summary[part] = {"error": f"{type(err).__name__}: {err}"}
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    summary["blocked_in_check"] = readonly_nvml.blocked
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({k: summary[k] for k in ("guarded_functions", "blocked_in_check")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
