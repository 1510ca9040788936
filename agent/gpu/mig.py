"""MIG through NVML: walking GPU and compute instances, and the four mutations (GI/CI create
and destroy) plus MIG mode. Every function runs in an NVML worker thread.

The walk goes per GPU-instance profile and then per compute-instance profile, never through
MIG device handles: a GI whose CI failed to create is invisible to those (dra-driver #1452),
and cached handles go stale after any change (libcudacxx #224).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from typing import Any

from agent.errors import NvmlError
from agent.gpu.session import NvmlSession
from agent.gpu.types import (
    ComputeInstanceState,
    GiProfile,
    Gpu,
    GpuInstanceState,
    GpuProcess,
    MigDevice,
    MigMode,
    Placement,
)

_NOT_AVAILABLE = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT")
# What a handle answers once its instance is destroyed: a walk in the read pool can race a
# destroy on the GPU's mutation thread, and an instance gone mid-walk is simply not there.
_GONE = ("NVML_ERROR_INVALID_ARGUMENT", "NVML_ERROR_NOT_FOUND")
# NVML reports "no instance" in process records as 0xFFFFFFFF.
_NO_INSTANCE = 0xFFFFFFFF
# Enough room for every CI a GI can hold (7 on a 7g), and for every GI of one profile (7 1g).
_MAX_CIS = 8
_MAX_GIS = 8


def _ci_profiles(session: NvmlSession, gi: Any, uuid: str, gi_profile_id: int) -> list[Any]:
    """The compute-instance profiles a GPU instance offers (NVML profile info structs): fixed
    by the GPU and the GI's profile, so read once a session (a walk otherwise asks each GI
    eight times). A GI destroyed while they were read raises its ``_GONE`` error: a stale
    handle answers INVALID_ARGUMENT, which reads as "profile not offered", and a list cut
    short that way must not be remembered for every later GI of that profile."""
    def read() -> list[Any]:
        nvml = session.nvml
        found = []
        for constant in range(int(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)):
            try:
                found.append(session.call(
                    "nvmlGpuInstanceGetComputeInstanceProfileInfo", gi, constant,
                    nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, gpu=uuid))
            except NvmlError as err:
                if err.name not in _NOT_AVAILABLE:
                    raise
        session.call("nvmlGpuInstanceGetInfo", gi, gpu=uuid)  # still there throughout
        return found
    return session.fixed(("ci-profiles", uuid, gi_profile_id), read)


def _gi_profile_id(session: NvmlSession, gi: Any, uuid: str) -> int:
    return int(session.call("nvmlGpuInstanceGetInfo", gi, gpu=uuid).profileId)


def _compute_instances(session: NvmlSession, gi: Any, uuid: str,
                       gi_profile_id: int) -> list[tuple[Any, Any]]:
    """(handle, info) of every compute instance in a GPU instance."""
    nvml = session.nvml
    found: list[tuple[Any, Any]] = []
    try:
        profiles = _ci_profiles(session, gi, uuid, gi_profile_id)
    except NvmlError as err:
        if err.name not in _GONE:
            raise
        return found  # destroyed while this walk ran: no compute instances to list
    for profile in profiles:
        array = (nvml.c_nvmlComputeInstance_t * _MAX_CIS)()
        count = ctypes.c_uint(_MAX_CIS)
        try:
            session.call("nvmlGpuInstanceGetComputeInstances", gi, int(profile.id), array,
                         ctypes.byref(count), gpu=uuid)
            for ci in array[: count.value]:
                found.append((ci, session.call("nvmlComputeInstanceGetInfo", ci, gpu=uuid)))
        except NvmlError as err:
            if err.name not in _GONE:
                raise
    return found


def _instances_of(session: NvmlSession, handle: Any, uuid: str, profile_id: int,
                  capacity: int) -> Iterator[tuple[Any, Any]]:
    """(handle, info) of every GPU instance of one profile; one destroyed while this walk
    ran (a read racing a mutation) is simply not there."""
    nvml = session.nvml
    array = (nvml.c_nvmlGpuInstance_t * capacity)()
    count = ctypes.c_uint(capacity)
    session.call("nvmlDeviceGetGpuInstances", handle, profile_id, array, ctypes.byref(count),
                 gpu=uuid)
    for gi in array[: count.value]:
        try:
            yield gi, session.call("nvmlGpuInstanceGetInfo", gi, gpu=uuid)
        except NvmlError as err:
            if err.name not in _GONE:
                raise


def _state(session: NvmlSession, gi: Any, info: Any, uuid: str) -> GpuInstanceState:
    """A GPU instance with its compute instances (ordered by CI id)."""
    cis = tuple(sorted(
        (ComputeInstanceState(int(ci.id), int(ci.profileId),
                              Placement(int(ci.placement.start), int(ci.placement.size)))
         for _, ci in _compute_instances(session, gi, uuid, int(info.profileId))),
        key=lambda c: c.id))
    return GpuInstanceState(
        id=int(info.id), profile_id=int(info.profileId),
        placement=Placement(int(info.placement.start), int(info.placement.size)),
        compute_instances=cis)


def read_instances(session: NvmlSession, handle: Any, uuid: str,
                   profiles: Sequence[GiProfile]) -> tuple[GpuInstanceState, ...]:
    """Every GPU instance with its compute instances, ordered by GI id."""
    found = [_state(session, gi, info, uuid) for profile in profiles
             for gi, info in _instances_of(session, handle, uuid, profile.id,
                                           max(profile.max_instances, 1))]
    return tuple(sorted(found, key=lambda g: g.id))


def instance_at(session: NvmlSession, handle: Any, uuid: str, profile_id: int,
                placement: Placement) -> GpuInstanceState | None:
    """The GPU instance of ``profile_id`` at ``placement`` with its compute instances, or None:
    one profile's walk, not the whole GPU's (a step of a transition asks this of one
    instance)."""
    for gi, info in _instances_of(session, handle, uuid, profile_id, _MAX_GIS):
        if (int(info.placement.start), int(info.placement.size)) == \
                (placement.start, placement.size):
            return _state(session, gi, info, uuid)
    return None


def create_gpu_instance(session: NvmlSession, handle: Any, uuid: str, profile_id: int,
                        placement: Placement) -> int:
    """Create a GI at an explicit placement (never driver auto-placement); return its id."""
    c_placement = session.nvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)
    gi = session.call("nvmlDeviceCreateGpuInstanceWithPlacement", handle, profile_id,
                      ctypes.byref(c_placement), gpu=uuid)
    return int(session.call("nvmlGpuInstanceGetInfo", gi, gpu=uuid).id)


def create_compute_instance(session: NvmlSession, handle: Any, uuid: str, gi_id: int,
                            ci_profile_id: int | None = None) -> ComputeInstanceState:
    """Create a CI in GI ``gi_id``: the given CI profile, or the one with the most SMs (not the
    first listed: on an H100 1g.20gb that is 26 SMs instead of 16, go-nvlib #85)."""
    gi = session.call("nvmlDeviceGetGpuInstanceById", handle, gi_id, gpu=uuid)
    if ci_profile_id is None:
        offered = _ci_profiles(session, gi, uuid, _gi_profile_id(session, gi, uuid))
        if not offered:
            raise NvmlError(function="nvmlGpuInstanceGetComputeInstanceProfileInfo", code=3,
                            name="NVML_ERROR_NOT_SUPPORTED", gpu=uuid)
        best = max(offered, key=lambda p: (int(p.multiprocessorCount), int(p.sliceCount)))
        ci_profile_id = int(best.id)
    ci = session.call("nvmlGpuInstanceCreateComputeInstance", gi, ci_profile_id, gpu=uuid)
    info = session.call("nvmlComputeInstanceGetInfo", ci, gpu=uuid)
    return ComputeInstanceState(int(info.id), int(info.profileId),
                                Placement(int(info.placement.start), int(info.placement.size)))


def destroy_compute_instances(session: NvmlSession, handle: Any, uuid: str, gi_id: int) -> None:
    """Destroy every CI of GI ``gi_id`` (``IN_USE`` while a process runs on one)."""
    gi = session.call("nvmlDeviceGetGpuInstanceById", handle, gi_id, gpu=uuid)
    for ci, _ in _compute_instances(session, gi, uuid, _gi_profile_id(session, gi, uuid)):
        session.call("nvmlComputeInstanceDestroy", ci, gpu=uuid)


def destroy_gpu_instance(session: NvmlSession, handle: Any, uuid: str, gi_id: int) -> None:
    """Destroy GI ``gi_id``; its CIs must be gone first (NVML answers ``IN_USE`` otherwise)."""
    gi = session.call("nvmlDeviceGetGpuInstanceById", handle, gi_id, gpu=uuid)
    session.call("nvmlGpuInstanceDestroy", gi, gpu=uuid)


def mig_enabled(session: NvmlSession, handle: Any, uuid: str) -> bool:
    """Whether MIG is on now (the current mode, not the pending one)."""
    return mig_mode(session, handle, uuid).current


def mig_mode(session: NvmlSession, handle: Any, uuid: str) -> MigMode:
    """The current and the pending MIG mode."""
    current, pending = session.call("nvmlDeviceGetMigMode", handle, gpu=uuid)
    return MigMode(current=bool(current), pending=bool(pending))


def still_there(session: NvmlSession, gpu: Gpu, device: MigDevice | None) -> bool:
    """Whether the hardware still shows what a snapshot says of the device: a MIG device still
    answers by its UUID, a GPU without MIG still answers, a MIG-capable GPU still has the
    snapshot's MIG mode. An NVML error (a lost GPU) is a no."""
    try:
        if device is not None:
            session.call("nvmlDeviceGetHandleByUUID", device.uuid, gpu=gpu.uuid)
            return True
        handle = session.gpu_handle(gpu.uuid)
        if not gpu.static.mig_capable:
            session.call("nvmlDeviceGetMinorNumber", handle, gpu=gpu.uuid)
            return True
        return gpu.mig_mode is not None and \
            mig_enabled(session, handle, gpu.uuid) == gpu.mig_mode.current
    except NvmlError:
        return False


def gi_not_found(uuid: str) -> NvmlError:
    """What NVML answers for a GPU instance that is not there."""
    return NvmlError(function="nvmlDeviceGetGpuInstanceById", code=6,
                     name="NVML_ERROR_NOT_FOUND", gpu=uuid)


def set_mig_mode(session: NvmlSession, handle: Any, uuid: str, enabled: bool) -> tuple[MigMode,
                                                                                         int]:
    """Ask for MIG on or off; return the mode NVML then reports and the activation status
    (0, or e.g. ``IN_USE`` when the change stays pending until the GPU is idle or reset)."""
    nvml = session.nvml
    wanted = nvml.NVML_DEVICE_MIG_ENABLE if enabled else nvml.NVML_DEVICE_MIG_DISABLE
    status = int(session.call("nvmlDeviceSetMigMode", handle, wanted, gpu=uuid))
    current, pending = session.call("nvmlDeviceGetMigMode", handle, gpu=uuid)
    return MigMode(current=bool(current), pending=bool(pending)), status


def running_processes(session: NvmlSession, handle: Any, uuid: str) -> tuple[GpuProcess, ...]:
    """Compute processes on the GPU, with the MIG instance each runs on."""
    found = []
    for proc in session.call("nvmlDeviceGetComputeRunningProcesses", handle, gpu=uuid):
        gi = int(getattr(proc, "gpuInstanceId", _NO_INSTANCE))
        ci = int(getattr(proc, "computeInstanceId", _NO_INSTANCE))
        used = proc.usedGpuMemory
        found.append(GpuProcess(
            pid=int(proc.pid), used_memory_mib=int(used) // 2**20 if used is not None else 0,
            gi_id=None if gi == _NO_INSTANCE else gi, ci_id=None if ci == _NO_INSTANCE else ci))
    return tuple(found)


def mig_device_handles(session: NvmlSession, handle: Any, uuid: str) -> Iterator[tuple[int,
                                                                                      Any]]:
    """(NVML MIG device index, handle) of every MIG device: one per compute instance; empty
    indices (NOT_FOUND) are skipped. Handles are fresh: cached ones go stale on any change."""
    for index in range(int(session.call("nvmlDeviceGetMaxMigDeviceCount", handle, gpu=uuid))):
        try:
            yield index, session.call("nvmlDeviceGetMigDeviceHandleByIndex", handle, index,
                                      gpu=uuid)
        except NvmlError as err:
            if err.name != "NVML_ERROR_NOT_FOUND":
                raise


def mig_device_uuid(session: NvmlSession, handle: Any, uuid: str, gi_id: int,
                    ci_id: int) -> str | None:
    """The UUID of the MIG device of (GI, CI), from a fresh enumeration."""
    for _, mig in mig_device_handles(session, handle, uuid):
        if int(session.call("nvmlDeviceGetGpuInstanceId", mig, gpu=uuid)) == gi_id and \
                int(session.call("nvmlDeviceGetComputeInstanceId", mig, gpu=uuid)) == ci_id:
            value = session.call("nvmlDeviceGetUUID", mig, gpu=uuid)
            return value.decode() if isinstance(value, bytes) else str(value)
    return None
