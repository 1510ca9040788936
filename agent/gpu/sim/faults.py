"""Injected NVML failures: make the Nth matching call of a function fail with a given code, or
kill the process at that call (a deterministic crash point for recovery tests). The simulated
driver tools (``nvidia-smi``, ``nvidia-cuda-mps-control -d``) take faults the same way: the
error is then the message the failing tool prints."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import pynvml

from agent.errors import InvalidRequest

CRASH = "CRASH"

# pynvml's nvml* functions that are pure Python helpers, not calls into the library.
_HELPERS = frozenset({"nvmlStructToFriendlyObject", "nvmlFriendlyObjectToStruct",
                      "nvmlExceptionClass"})

#: Every NVML call the pynvml module exposes (versioned names and aliases included).
NVML_FUNCTIONS: frozenset[str] = frozenset(
    name for name in dir(pynvml)
    if name.startswith("nvml") and name not in _HELPERS
    and inspect.isfunction(getattr(pynvml, name)))

#: ``NVML_ERROR_IN_USE`` -> 19, for every error code pynvml knows.
ERROR_CODES: dict[str, int] = {
    name: int(getattr(pynvml, name)) for name in dir(pynvml) if name.startswith("NVML_ERROR_")}


#: The simulated driver tools that take faults (a call of ``nvidia-smi``; a ``-d`` start of
#: ``nvidia-cuda-mps-control``; a start of ``nvidia-imex``) and latencies.
TOOL_FUNCTIONS: frozenset[str] = frozenset({"nvidia-smi", "nvidia-cuda-mps-control",
                                            "nvidia-imex"})
MAX_TOOL_MESSAGE = 200


def check_function(name: object, field: str = "function") -> str:
    """``name`` if it is an NVML call of pynvml or a simulated driver tool;
    :class:`InvalidRequest` otherwise."""
    if not isinstance(name, str) or (name not in NVML_FUNCTIONS and name not in TOOL_FUNCTIONS):
        raise InvalidRequest(
            f"{name!r} is not an NVML function of pynvml (e.g. nvmlDeviceCreateGpuInstance) "
            f"or a driver tool ({', '.join(sorted(TOOL_FUNCTIONS))})",
            errors=[{"field": field, "reason": "unknown NVML function or tool"}])
    return name


def _tool_message(error: object) -> str:
    """What a failing tool prints: any one line of text."""
    if not isinstance(error, str) or not error.strip() or "\n" in error \
            or len(error) > MAX_TOOL_MESSAGE:
        raise InvalidRequest(
            f"error: a tool fault's error is the one line the tool prints (1-"
            f"{MAX_TOOL_MESSAGE} characters)", errors=[{"field": "error",
                                                        "reason": "not one line of text"}])
    return error.strip()


def _error_name(error: object) -> str:
    """Canonical ``NVML_ERROR_*`` name (the prefix may be left out) or ``CRASH``."""
    if isinstance(error, str):
        if error == CRASH:
            return error
        name = error if error.startswith("NVML_ERROR_") else f"NVML_ERROR_{error}"
        if name in ERROR_CODES:
            return name
    raise InvalidRequest(
        f"{error!r} is not an NVML error name (e.g. NVML_ERROR_IN_USE) or {CRASH!r}",
        errors=[{"field": "error", "reason": "unknown NVML error"}])


def _count(value: object, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidRequest(f"{field} must be an integer >= {minimum}",
                             errors=[{"field": field, "reason": f"must be >= {minimum}"}])
    return value


@dataclass
class Fault:
    """One injected failure: after ``skip`` matching calls, the next ``times`` fail."""

    id: int
    function: str
    error: str
    gpu: str | None
    skip: int
    times: int
    skipped: int = 0
    fired: int = 0

    @property
    def code(self) -> int:
        return ERROR_CODES[self.error]

    @property
    def remaining(self) -> int:
        return self.times - self.fired

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "function": self.function, "error": self.error,
                "gpu": self.gpu, "skip": self.skip, "times": self.times,
                "skipped": self.skipped, "fired": self.fired, "remaining": self.remaining}


class FaultTable:
    """The injected failures, in the order they were added (not thread-safe on its own)."""

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._next_id = 1

    def add(self, function: str, error: str, gpu: str | None, skip: int, times: int) -> Fault:
        function = check_function(function)
        fault = Fault(id=self._next_id, function=function,
                      error=_tool_message(error) if function in TOOL_FUNCTIONS
                      else _error_name(error), gpu=gpu, skip=_count(skip, "skip", 0),
                      times=_count(times, "times", 1))
        self._next_id += 1
        self._faults.append(fault)
        return fault

    def clear(self) -> None:
        self._faults.clear()

    def wants_gpu(self, function: str) -> bool:
        """Whether matching a call of ``function`` needs the GPU its handle belongs to."""
        return any(f.function == function and f.gpu is not None and f.remaining
                   for f in self._faults)

    def match(self, function: str, gpu: str | None) -> Fault | None:
        """Count this call against every live fault it matches; return the one that fires.
        The first fault (by age) past its skip count fires; younger ones are not consulted."""
        for fault in self._faults:
            if fault.function != function or fault.remaining <= 0:
                continue
            if fault.gpu is not None and fault.gpu != gpu:
                continue
            if fault.skipped < fault.skip:
                fault.skipped += 1
                continue
            fault.fired += 1
            return fault
        return None

    def describe(self) -> list[dict[str, Any]]:
        return [f.describe() for f in self._faults]
