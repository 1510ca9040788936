"""A simulated ``nvidia-smi`` for what the agent runs it for: ``-i <id> -c <mode>`` (compute
mode) and ``compute-policy -i <id> --set-timeslice <0-3>``. It reaches the simulated driver
through the node's socket (``$GPU_AGENT_SIM_DRIVER``; the node's wrapper sets it), so the
change is hardware state: NVML reads it back and it survives an agent restart.

Exit status as the real tool's: 0 done, 2 invalid argument, 3 not supported, 6 not found,
9 no driver; 1 for an injected fault (its message printed).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from agent.gpu.sim import wire

USAGE = """NVIDIA System Management Interface (simulated)

    nvidia-smi -i <id> -c <DEFAULT|EXCLUSIVE_PROCESS|PROHIBITED|0|2|3>
    nvidia-smi compute-policy -i <id> --set-timeslice <0|1|2|3>

<id> is a GPU index, a GPU or MIG device UUID, or a PCI bus id."""
#: ``-c`` takes the names or NVML's numbers (1, EXCLUSIVE_THREAD, is no longer supported).
COMPUTE_MODES = {"DEFAULT": 0, "PROHIBITED": 2, "EXCLUSIVE_PROCESS": 3}
EXIT_FAULT, EXIT_INVALID, EXIT_NOT_SUPPORTED, EXIT_NOT_FOUND, EXIT_NO_DRIVER = 1, 2, 3, 6, 9
_EXIT_OF_KIND = {"invalid": EXIT_INVALID, "not_found": EXIT_NOT_FOUND,
                 "conflict": EXIT_NOT_SUPPORTED}


class Failed(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _driver(message: dict[str, Any]) -> dict[str, Any]:
    path = os.environ.get("GPU_AGENT_SIM_DRIVER")
    if not path:
        raise Failed("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
                     "driver (GPU_AGENT_SIM_DRIVER is not set).", EXIT_NO_DRIVER)
    try:
        return wire.request(Path(path), message)
    except (OSError, ValueError) as err:
        raise Failed("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
                     f"driver ({path}: {err}).", EXIT_NO_DRIVER) from None


def _invalid(why: str) -> Failed:
    return Failed(f"{why}\n\n{USAGE}", EXIT_INVALID)


def parse(args: list[str]) -> dict[str, Any]:
    """The driver request ``args`` ask for; :class:`Failed` (exit 2) for anything else."""
    policy = bool(args) and args[0] == "compute-policy"
    rest = args[1:] if policy else args
    options: dict[str, str] = {}
    i = 0
    while i < len(rest):
        flag = rest[i]
        name, _, inline = flag.partition("=")
        if name not in ("-i", "--id", "-c", "--compute-mode", "--set-timeslice") or \
                (policy and name in ("-c", "--compute-mode")) or \
                (not policy and name == "--set-timeslice"):
            raise _invalid(f"Invalid combination of input arguments: {flag!r}.")
        if inline:
            value = inline
            i += 1
        elif i + 1 < len(rest):
            value = rest[i + 1]
            i += 2
        else:
            raise _invalid(f"Option {name} needs a value.")
        options[{"--id": "-i", "--compute-mode": "-c"}.get(name, name)] = value
    if "-i" not in options:
        raise _invalid("Missing -i <id>.")
    if policy:
        slice_ = options.get("--set-timeslice")
        if slice_ is None or slice_ not in ("0", "1", "2", "3"):
            raise _invalid(f"Invalid timeslice {slice_!r}: 0 (Default), 1 (Short), "
                           "2 (Medium) or 3 (Long).")
        return {"op": "set_timeslice", "device": options["-i"], "value": int(slice_)}
    mode = options.get("-c")
    if mode is None:
        raise _invalid("Missing -c <mode>.")
    number = int(mode) if mode.isdigit() else COMPUTE_MODES.get(mode.upper())
    if number not in COMPUTE_MODES.values():
        raise _invalid(f"Invalid compute mode {mode!r}.")
    return {"op": "set_compute_mode", "device": options["-i"], "mode": number}


def run(args: list[str]) -> str:
    """Do what ``args`` ask; the output, or :class:`Failed`."""
    if args in (["-h"], ["--help"]):
        return USAGE
    request = parse(args)
    started = _driver({"op": "tool", "tool": "nvidia-smi", "device": request["device"]})
    if started.get("error") is None:
        latency = float(started.get("latency_s") or 0.0)
        if latency > 0:
            time.sleep(latency)
        if started.get("fail"):
            raise Failed(str(started["fail"]), EXIT_FAULT)
    reply = _driver(request)
    error = reply.get("error")
    if isinstance(error, dict):
        raise Failed(str(error.get("detail")), _EXIT_OF_KIND.get(str(error.get("kind")),
                                                                 EXIT_NOT_SUPPORTED))
    return f"{reply.get('output', '')}\nAll done."


def main(argv: list[str] | None = None) -> int:
    try:
        print(run(sys.argv[1:] if argv is None else argv))
    except Failed as failed:
        print(failed, file=sys.stderr)
        return failed.status
    return 0


if __name__ == "__main__":
    sys.exit(main())
