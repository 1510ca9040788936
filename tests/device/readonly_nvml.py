"""A guard for checks on shared GPU hosts: every NVML function that is not a plain read is
replaced by one that refuses (NVML_ERROR_NO_PERMISSION) and records the attempt, so a check
run against a real GPU cannot change MIG mode or geometry, clocks, power, persistence or
reset anything, whatever the agent under test tries."""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import re
import sys
import threading
import time
from typing import Any

ALLOWED = re.compile(
    r"^nvml(Init\w*|Shutdown|ErrorString"
    r"|(Device|System|GpuInstance|ComputeInstance|Unit|Vgpu\w*|Gpm\w*)?Get\w*"
    r"|EventSet(Create|Wait|Wait_v2|Free)|DeviceRegisterEvents|DeviceOnSameBoard"
    r"|DeviceIsMigDeviceHandle|GpmQueryDeviceSupport|GpmQueryIfStreamingEnabled"
    r"|GpmSampleAlloc|GpmSampleFree|GpmMetricsGet)$")

blocked: list[str] = []
# function -> [calls, seconds], when timing is on
timings: dict[str, list[float]] = {}
_timings_lock = threading.Lock()
TIMING_ENV = "GPU_AGENT_NVML_TIMING"


def _timed(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - started
            with _timings_lock:
                entry = timings.setdefault(name, [0, 0.0])
                entry[0] += 1
                entry[1] += elapsed
    return timed


def _dump_timings(path: str) -> None:
    with _timings_lock, open(path, "w") as out:
        json.dump(timings, out)


def install(nvml: Any = None) -> list[str]:
    """Wrap every non-read NVML function of ``nvml`` (default: ``pynvml``); the names wrapped.
    With ``$GPU_AGENT_NVML_TIMING`` set, the reads are also timed, and the calls and seconds
    per function are written to that file at exit."""
    if nvml is None:
        import pynvml as nvml  # noqa: PLC0415
    timing_file = os.environ.get(TIMING_ENV)
    if timing_file:
        for name, fn in list(vars(nvml).items()):
            if name.startswith("nvml") and inspect.isfunction(fn) and ALLOWED.match(name):
                setattr(nvml, name, _timed(name, fn))
        atexit.register(_dump_timings, timing_file)

    refused = nvml.NVMLError(nvml.NVML_ERROR_NO_PERMISSION)
    wrapped = []
    for name, fn in list(vars(nvml).items()):
        if not (name.startswith("nvml") and inspect.isfunction(fn)) or ALLOWED.match(name):
            continue

        @functools.wraps(fn)
        def refuse(*_args: Any, _name: str = name, **_kwargs: Any) -> Any:
            blocked.append(_name)
            print(f"readonly-guard: blocked {_name}", file=sys.stderr, flush=True)
            raise refused

        setattr(nvml, name, refuse)
        wrapped.append(name)
    return wrapped
