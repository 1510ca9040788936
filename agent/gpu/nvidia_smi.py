"""``nvidia-smi`` for what NVML cannot do or the agent does as NVIDIA's driver does: the
compute mode (``-c``) and the time slice (``compute-policy --set-timeslice``; NVML has no
call for it, its scheduler calls are vGPU-only). Reading the compute mode is NVML's
:func:`compute_mode`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from agent.errors import SharingUnavailable
from agent.gpu.session import NvmlSession
from agent.gpu.tools import executable, run_tool, truncated

ComputeMode = Literal["DEFAULT", "EXCLUSIVE_PROCESS", "PROHIBITED"]
COMPUTE_MODES: tuple[ComputeMode, ...] = get_args(ComputeMode)

#: ``timeSlicingConfig.interval`` -> the ``--set-timeslice`` value (NVIDIA's mapping).
TIMESLICE: Mapping[str, int] = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}

#: NVML's ``nvmlComputeMode_t`` values (1, EXCLUSIVE_THREAD, is no longer supported).
NVML_COMPUTE_MODES: Mapping[int, ComputeMode] = {0: "DEFAULT", 2: "PROHIBITED",
                                                 3: "EXCLUSIVE_PROCESS"}
TOOL = "nvidia-smi"


class NvidiaSmi:
    """One ``nvidia-smi`` binary; every call is a subprocess with a deadline."""

    def __init__(self, path: Path, *, timeout_s: float = 15.0) -> None:
        self.path = Path(path)
        self.timeout_s = timeout_s

    def available(self) -> bool:
        """Whether the binary exists and is executable."""
        return executable(self.path)

    async def set_compute_mode(self, uuid: str, mode: ComputeMode) -> None:
        """``nvidia-smi -i <uuid> -c <mode>``; :class:`SharingUnavailable` on failure."""
        if mode not in COMPUTE_MODES:
            raise ValueError(f"compute mode {mode!r} is not one of {COMPUTE_MODES}")
        await self._run(["-i", uuid, "-c", mode], uuid)

    async def set_timeslice(self, uuid: str, value: int) -> None:
        """``nvidia-smi compute-policy -i <uuid> --set-timeslice <value>`` (0-3, see
        :data:`TIMESLICE`); :class:`SharingUnavailable` on failure."""
        if isinstance(value, bool) or value not in TIMESLICE.values():
            raise ValueError(f"time slice {value!r} is not one of {sorted(TIMESLICE.values())}")
        await self._run(["compute-policy", "-i", uuid, "--set-timeslice", str(value)], uuid)

    async def _run(self, args: list[str], uuid: str) -> None:
        if not self.available():
            raise SharingUnavailable(f"{TOOL} not found or not executable at {self.path}",
                                     tool=TOOL, reason="missing", gpu=uuid)
        done = await run_tool([str(self.path), *args], tool=TOOL, timeout_s=self.timeout_s,
                              gpu=uuid)
        if done.returncode != 0:
            raise SharingUnavailable(
                f"{TOOL} {' '.join(args)} exited {done.returncode}: "
                f"{truncated(done.output) or '(no output)'}", tool=TOOL,
                reason=f"exit status {done.returncode}", gpu=uuid)


def compute_mode(session: NvmlSession, uuid: str) -> ComputeMode:
    """A GPU's (or MIG device's) compute mode as NVML reports it (NVML worker thread; call
    through ``session.read``)."""
    handle: Any = session.call("nvmlDeviceGetHandleByUUID", uuid, gpu=uuid)
    value = int(session.call("nvmlDeviceGetComputeMode", handle, gpu=uuid))
    return NVML_COMPUTE_MODES.get(value, "DEFAULT")
