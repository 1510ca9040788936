"""The effects of a claim's sharing plan: compute mode and time slice through ``nvidia-smi``,
and the claim's MPS control daemon through ``nvidia-cuda-mps-control``.

The hardware-layer tools (``agent/gpu/nvidia_smi.py: NvidiaSmi``, ``agent/gpu/mps.py:
MpsControl``) are reached through the two protocols below (tests play them with fakes).
The claims service owns the order (validate, reserve, record durably, then call
:meth:`SharingRuntime.apply`) and the checkpoint; this module mutates only the
:class:`~agent.claims.checkpoint.ClaimRecord` it is handed (applied flags, daemon state),
and every step is safe to repeat, so an undo or a start-up roll-back may run it again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Protocol

from agent.claims.checkpoint import ClaimRecord, MpsDaemonRecord
from agent.claims.sharing import SharingPlan, daemon_root
from agent.errors import AgentError, SharingUnavailable
from agent.gpu.mps import MpsDaemonSpec as DaemonSpec
from agent.gpu.nvidia_smi import ComputeMode

log = logging.getLogger("agent.claims.sharing")

NVIDIA_SMI, MPS_CONTROL = "nvidia-smi", "nvidia-cuda-mps-control"


class ComputeTool(Protocol):
    """``nvidia-smi``: compute mode and time slice of a full GPU."""

    def available(self) -> bool: ...

    async def set_compute_mode(self, uuid: str, mode: ComputeMode) -> None: ...

    async def set_timeslice(self, uuid: str, value: int) -> None: ...


class MpsTool(Protocol):
    """``nvidia-cuda-mps-control``: one daemon per pipe directory root."""

    def available(self) -> bool: ...

    async def start(self, spec: DaemonSpec) -> None: ...

    async def alive(self, root: Path) -> bool: ...

    async def servers(self, root: Path) -> list[int]: ...

    async def clients(self, root: Path, server: int) -> list[int]: ...

    async def stop(self, root: Path) -> None: ...


#: ``needed(gpu, what)``: whether a claim other than the one being undone still needs the
#: GPU's ``"timeslice"`` or ``"exclusive_process"`` setting.
StillNeeded = Callable[[str, str], bool]
#: ``usage(device_uuid)``: MPS client pid -> device memory used (MiB), as NVML reports them
#: (``agent.gpu.mps.mps_processes`` through the NVML session).
Usage = Callable[[str], Awaitable[Mapping[int, int]]]


class SharingRuntime:
    """Applies and undoes sharing plans; a tool that is None or not available makes every
    plan that needs it a 503 :class:`SharingUnavailable` before anything changes."""

    def __init__(self, *, nvidia_smi: ComputeTool | None, mps: MpsTool | None,
                 mps_root: Path, usage: Usage | None = None) -> None:
        self.nvidia_smi = nvidia_smi
        self.mps = mps
        self.mps_root = mps_root
        self.usage = usage

    def check(self, plan: SharingPlan) -> None:
        """Raise :class:`SharingUnavailable` when a tool the plan needs is missing."""
        if plan.needs_nvidia_smi and (self.nvidia_smi is None or not self.nvidia_smi.available()):
            gpu = next(d.gpu for d in plan.devices if d.timeslice is not None
                       or d.exclusive_process)
            raise SharingUnavailable(
                f"{NVIDIA_SMI} is not available on this node (set nvidia_smi or "
                "--driver-root): time-slicing and MPS on a full GPU need it; nothing was "
                "prepared", tool=NVIDIA_SMI, gpu=gpu, reason="not found or not executable")
        if plan.daemon is not None and (self.mps is None or not self.mps.available()):
            raise SharingUnavailable(
                f"{MPS_CONTROL} is not available on this node (set mps_control or "
                "--driver-root): MPS needs it; nothing was prepared", tool=MPS_CONTROL,
                gpu=plan.daemon.devices[0], reason="not found or not executable")

    def daemon_records(self, uid: str, plan: SharingPlan) -> list[MpsDaemonRecord]:
        """The claim's daemons (one per MPS config) as recorded before they are started
        (state ``starting``), each in a directory of its own."""
        return [MpsDaemonRecord(root=str(daemon_root(self.mps_root, uid, i)),
                                devices=list(daemon.devices),
                                thread_percentage=daemon.thread_percentage,
                                pinned_limits_mib=dict(daemon.pinned_limits_mib))
                for i, daemon in enumerate(plan.daemons)]

    async def apply(self, record: ClaimRecord) -> None:
        """Carry out what ``record`` intends (recorded durably by the caller first): per
        full GPU, compute mode then time slice, then the claim's daemons. Raises
        :class:`SharingUnavailable` (the caller undoes)."""
        for device in record.devices:
            sharing = device.sharing_state
            if sharing is None:
                continue
            if sharing.timeslice is not None:
                smi = self._smi()
                # As NVIDIA's driver does: compute mode DEFAULT, then the interval.
                await smi.set_compute_mode(device.gpu, "DEFAULT")
                await smi.set_timeslice(device.gpu, sharing.timeslice)
                sharing.timeslice_applied = True
            if sharing.exclusive_process:
                await self._smi().set_compute_mode(device.gpu, "EXCLUSIVE_PROCESS")
                sharing.compute_mode_applied = True
        for daemon in record.daemons():
            await self._mps().start(spec_of(daemon))
            daemon.state, daemon.reason = "running", None

    async def reapply(self, record: ClaimRecord) -> None:
        """At start-up, for a prepared claim: set again the compute mode and time slice it
        applied (both idempotent), so a GPU reset or driver reload while the agent was down
        does not leave the claim's GPU with the defaults. Raises :class:`SharingUnavailable`
        (the caller reports it). The daemon is the caller's to adopt."""
        for device in record.devices:
            sharing = device.sharing_state
            if sharing is None:
                continue
            if sharing.timeslice is not None and sharing.timeslice_applied:
                await self._smi().set_timeslice(device.gpu, sharing.timeslice)
            if sharing.exclusive_process and sharing.compute_mode_applied:
                await self._smi().set_compute_mode(device.gpu, "EXCLUSIVE_PROCESS")

    async def undo(self, record: ClaimRecord, still_needed: StillNeeded) -> None:
        """Stop the claim's daemons, then put back compute mode (``DEFAULT``) and time slice
        (0) where this claim may have set them and no other claim still needs them. Raises
        :class:`AgentError` when something could not be undone (the caller keeps the
        claim's holds, so nobody gets a GPU in an unknown state)."""
        for daemon in record.daemons():
            await self._mps().stop(Path(daemon.root))
        for device in record.devices:
            sharing = device.sharing_state
            if sharing is None:
                continue
            if sharing.exclusive_process and sharing.compute_mode_applied is not False \
                    and not still_needed(device.gpu, "exclusive_process"):
                await self._smi().set_compute_mode(device.gpu, "DEFAULT")
                sharing.compute_mode_applied = False
            if sharing.timeslice is not None and sharing.timeslice_applied is not False \
                    and not still_needed(device.gpu, "timeslice"):
                await self._smi().set_timeslice(device.gpu, 0)
                sharing.timeslice_applied = False

    async def alive(self, daemon: MpsDaemonRecord) -> bool:
        """Whether the claim's daemon answers (False when MPS is not available at all)."""
        if self.mps is None:
            return False
        try:
            return await self.mps.alive(Path(daemon.root))
        except AgentError as err:
            log.warning("MPS daemon check failed", extra={"root": daemon.root,
                                                           "error": err.detail})
            return False

    async def clients(self, daemon: MpsDaemonRecord) -> set[int] | None:
        """The pids of the daemon's servers and their clients (None when it does not
        answer): to attribute per-process GPU memory to the claim."""
        if self.mps is None:
            return None
        root = Path(daemon.root)
        try:
            pids: set[int] = set()
            for server in await self.mps.servers(root):
                pids.add(server)
                pids.update(await self.mps.clients(root, server))
            return pids
        except AgentError:
            return None

    async def used_mib(self, daemon: MpsDaemonRecord, device: str) -> int | None:
        """The device memory the daemon's processes use on ``device`` (0 with no clients;
        None when it cannot be read: no usage source, or the daemon does not answer)."""
        if self.usage is None:
            return None
        pids = await self.clients(daemon)
        if pids is None:
            return None
        if not pids:
            return 0
        try:
            used = await self.usage(device)
        except AgentError:
            return None
        return sum(mib for pid, mib in used.items() if pid in pids)

    def _smi(self) -> ComputeTool:
        if self.nvidia_smi is None or not self.nvidia_smi.available():
            raise SharingUnavailable(f"{NVIDIA_SMI} is not available on this node",
                                     tool=NVIDIA_SMI, reason="not found or not executable")
        return self.nvidia_smi

    def _mps(self) -> MpsTool:
        if self.mps is None or not self.mps.available():
            raise SharingUnavailable(f"{MPS_CONTROL} is not available on this node",
                                     tool=MPS_CONTROL, reason="not found or not executable")
        return self.mps


def spec_of(daemon: MpsDaemonRecord) -> DaemonSpec:
    return DaemonSpec(root=Path(daemon.root), devices=tuple(daemon.devices),
                      active_thread_percentage=daemon.thread_percentage,
                      pinned_limits_mib=dict(daemon.pinned_limits_mib))
