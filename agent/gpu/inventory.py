"""Reading the node's GPUs from NVML into immutable values, and keeping the latest snapshot.

Static attributes are read once; MIG mode, MIG devices, the NVLink fabric and health are
re-read on refresh, because other tools (``nvidia-smi mig``, mig-parted) and the fabric
manager can change them behind the agent's back.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections.abc import Collection, Sequence
from functools import partial
from typing import Any

from agent.device_names import ascii_integer
from agent.errors import GpuLost, NotFound, NvmlError
from agent.gpu.fabric import read_fabric
from agent.gpu.mig import mig_device_handles, read_instances, still_there
from agent.gpu.naming import mig_profile_name
from agent.gpu.session import NvmlSession
from agent.gpu.types import (
    DriverInfo,
    Fabric,
    GiProfile,
    Gpu,
    GpuStatic,
    Health,
    MigDevice,
    MigMode,
    Placement,
)

log = logging.getLogger("agent.gpu.inventory")

_ARCHITECTURES = {2: "kepler", 3: "maxwell", 4: "pascal", 5: "volta", 6: "turing",
                  7: "ampere", 8: "ada", 9: "hopper", 10: "blackwell"}
_BRANDS = {1: "quadro", 2: "tesla", 3: "nvs", 5: "geforce", 6: "titan", 12: "quadro_rtx",
           13: "nvidia_rtx", 14: "nvidia"}
# NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: the "+me" profile that carries the media engines.
_PROFILE_INDEX_ME = 0x7
# Words of the CPU set passed to nvmlDeviceGetCpuAffinity: 1024 CPUs, more than any host has.
_CPU_SET_WORDS = 16
_NOT_AVAILABLE = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT")
# A MIG device handle whose instance was destroyed mid-walk answers one of these.
_GONE = ("NVML_ERROR_INVALID_ARGUMENT", "NVML_ERROR_NOT_FOUND")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def cpu_list(words: Sequence[int]) -> str:
    """A CPU bitmask (64-bit words, lowest CPU first) as a Linux cpulist like ``0-55,112-167``."""
    cpus = [w * 64 + b for w, word in enumerate(words) for b in range(64) if word >> b & 1]
    ranges: list[str] = []
    start = prev = None
    for cpu in [*cpus, None]:
        if cpu is not None and prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            ranges.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(ranges)


def read_driver(session: NvmlSession) -> DriverInfo:
    """Driver, CUDA driver and NVML versions."""
    cuda = int(session.call("nvmlSystemGetCudaDriverVersion"))
    return DriverInfo(
        driver_version=_text(session.call("nvmlSystemGetDriverVersion")),
        cuda_driver_version=f"{cuda // 1000}.{cuda % 1000 // 10}",
        nvml_version=_text(session.call("nvmlSystemGetNVMLVersion")),
    )


def read_static(session: NvmlSession, index: int) -> GpuStatic:
    """Attributes of GPU ``index`` that stay fixed while the driver is loaded."""
    call = session.call
    try:
        handle = call("nvmlDeviceGetHandleByIndex", index)
    except GpuLost:
        # NVML gives no handle, hence no UUID, for a GPU that fell off the bus; list it anyway
        # (unhealthy) so operators see it, rather than refusing to start.
        placeholder = f"GPU-LOST-{index}"
        session.mark_lost(placeholder, "nvmlDeviceGetHandleByIndex returned "
                                       "NVML_ERROR_GPU_IS_LOST at start-up")
        return GpuStatic(index=index, minor=-1, uuid=placeholder, name="unknown (GPU is lost)",
                         brand="unknown", architecture="unknown", cuda_compute_capability="",
                         pci_bus_id="", pci_device_id=0, pci_subsystem_id=0,
                         memory_total_mib=0, numa_node=None, cpu_affinity="",
                         mig_capable=False)
    uuid = _text(call("nvmlDeviceGetUUID", handle))
    major, minor = call("nvmlDeviceGetCudaComputeCapability", handle, gpu=uuid)
    try:
        call("nvmlDeviceGetMigMode", handle, gpu=uuid)
        mig_capable = True
    except NvmlError as err:
        if err.name != "NVML_ERROR_NOT_SUPPORTED":
            raise
        mig_capable = False
    try:
        numa: int | None = int(call("nvmlDeviceGetNumaNodeId", handle, gpu=uuid))
    except NvmlError as err:
        if err.name not in _NOT_AVAILABLE:
            raise
        numa = None
    affinity = call("nvmlDeviceGetCpuAffinity", handle, _CPU_SET_WORDS, gpu=uuid)
    pci = call("nvmlDeviceGetPciInfo", handle, gpu=uuid)
    memory = call("nvmlDeviceGetMemoryInfo", handle, gpu=uuid)
    return GpuStatic(
        index=index,
        minor=int(call("nvmlDeviceGetMinorNumber", handle, gpu=uuid)),
        uuid=uuid,
        name=_text(call("nvmlDeviceGetName", handle, gpu=uuid)),
        brand=_BRANDS.get(int(call("nvmlDeviceGetBrand", handle, gpu=uuid)), "unknown"),
        architecture=_ARCHITECTURES.get(int(call("nvmlDeviceGetArchitecture", handle, gpu=uuid)),
                                        "unknown"),
        cuda_compute_capability=f"{major}.{minor}",
        pci_bus_id=_text(pci.busId),
        pci_device_id=int(pci.pciDeviceId),
        pci_subsystem_id=int(pci.pciSubSystemId),
        memory_total_mib=int(memory.total) // (1024 * 1024),
        numa_node=numa,
        cpu_affinity=cpu_list([int(w) for w in affinity]),
        mig_capable=mig_capable,
    )


def read_gi_profiles(session: NvmlSession, handle: Any, static: GpuStatic) -> tuple[GiProfile, ...]:
    """Walk the GPU-instance profile index constants, skipping those the GPU lacks (as
    mig-parted does); ``id`` is the device profile ID that the create calls take."""
    nvml = session.nvml
    profiles: list[GiProfile] = []
    for index in range(int(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
        try:
            info = session.call("nvmlDeviceGetGpuInstanceProfileInfo", handle, index,
                                gpu=static.uuid)
        except NvmlError as err:
            if err.name in _NOT_AVAILABLE:
                continue
            raise
        memory = int(info.memorySizeMB)
        capacity = max(int(info.instanceCount), 1) * 8
        array = (nvml.c_nvmlGpuInstancePlacement_t * capacity)()
        count = ctypes.c_uint(capacity)
        session.call("nvmlDeviceGetGpuInstancePossiblePlacements", handle, int(info.id), array,
                     ctypes.byref(count), gpu=static.uuid)
        placements = tuple(Placement(int(p.start), int(p.size)) for p in array[: count.value])
        profiles.append(GiProfile(
            id=int(info.id), index=index,
            name=mig_profile_name(int(info.sliceCount), memory, static.memory_total_mib,
                                  media_extensions=index == _PROFILE_INDEX_ME),
            slices=int(info.sliceCount), memory_mib=memory,
            multiprocessors=int(info.multiprocessorCount),
            copy_engines=int(info.copyEngineCount), decoders=int(info.decoderCount),
            encoders=int(info.encoderCount), jpeg_engines=int(info.jpegCount),
            ofa_engines=int(info.ofaCount), max_instances=int(info.instanceCount),
            placements=placements, media_extensions=index == _PROFILE_INDEX_ME,
        ))
    return tuple(profiles)


def read_mig_devices(session: NvmlSession, handle: Any, uuid: str,
                     profiles: Sequence[GiProfile]) -> tuple[MigDevice, ...]:
    """MIG devices by NVML MIG device index, with the profile and placement of their GI."""
    names = {p.id: p.name for p in profiles}
    instances = {gi.id: (names.get(gi.profile_id, f"profile-{gi.profile_id}"), gi.placement)
                 for gi in read_instances(session, handle, uuid, profiles)}
    devices: list[MigDevice] = []
    for index, mig in mig_device_handles(session, handle, uuid):
        try:
            gi_id = int(session.call("nvmlDeviceGetGpuInstanceId", mig, gpu=uuid))
            attributes = session.call("nvmlDeviceGetAttributes", mig, gpu=uuid)
            device_uuid = _text(session.call("nvmlDeviceGetUUID", mig, gpu=uuid))
            ci_id = int(session.call("nvmlDeviceGetComputeInstanceId", mig, gpu=uuid))
        except NvmlError as err:
            if err.name not in _GONE:
                raise
            continue  # destroyed while this walk ran; the next refresh does not list it
        if gi_id not in instances:
            # Created between the two walks; the next refresh sees it whole.
            continue
        profile, placement = instances[gi_id]
        devices.append(MigDevice(
            index=index, uuid=device_uuid, profile=profile, gi_id=gi_id, ci_id=ci_id,
            placement=placement, memory_mib=int(attributes.memorySizeMB),
            multiprocessors=int(attributes.multiprocessorCount)))
    return tuple(devices)


def _read_fabric(session: NvmlSession, handle: Any, uuid: str) -> Fabric | None:
    """The GPU's fabric, or None; a failed read is logged, not a health problem of the GPU
    (a lost GPU is: that propagates)."""
    try:
        return read_fabric(session, handle, uuid)
    except GpuLost:
        raise
    except NvmlError as err:
        log.warning("fabric info unreadable", extra={"gpu": uuid, "error": err.detail})
        return None


def read_gpu(session: NvmlSession, static: GpuStatic,
             profiles: tuple[GiProfile, ...]) -> Gpu:
    """MIG mode, MIG devices, NVLink fabric and health of one GPU; a lost GPU keeps its
    static attributes."""
    reasons: list[str] = []
    mig_mode: MigMode | None = None
    devices: tuple[MigDevice, ...] = ()
    fabric: Fabric | None = None
    try:
        if static.minor < 0:
            raise GpuLost(function="nvmlDeviceGetHandleByIndex", code=15,
                          name="NVML_ERROR_GPU_IS_LOST", gpu=static.uuid)
        handle = session.gpu_handle(static.uuid)
        if static.mig_capable:
            current, pending = session.call("nvmlDeviceGetMigMode", handle, gpu=static.uuid)
            mig_mode = MigMode(current=bool(current), pending=bool(pending))
            if not profiles:
                profiles = read_gi_profiles(session, handle, static)
            if mig_mode.current:
                devices = read_mig_devices(session, handle, static.uuid, profiles)
        fabric = _read_fabric(session, handle, static.uuid)
    except NvmlError as err:
        reasons.append(err.detail)
    lost = session.lost_reason(static.uuid)
    if lost is not None and lost not in reasons:
        reasons.insert(0, f"GPU is lost: {lost}")
    return Gpu(static=static, mig_mode=mig_mode, mig_devices=devices,
               health=Health(healthy=not reasons, reasons=tuple(reasons)), profiles=profiles,
               fabric=fabric)


class GpuInventory:
    """The node's GPUs: loaded once NVML is up, refreshed on demand (one read of a GPU at a
    time; concurrent callers share the next)."""

    def __init__(self, session: NvmlSession) -> None:
        self._session = session
        self._static: tuple[GpuStatic, ...] = ()
        self._gpus: tuple[Gpu, ...] = ()
        self._driver: DriverInfo | None = None
        #: Per GPU: the read under way, and the one queued behind it that later callers share.
        self._reading: dict[str, asyncio.Future[Gpu]] = {}
        self._queued: dict[str, asyncio.Future[Gpu]] = {}
        self.refreshed_at = 0.0

    @property
    def loaded(self) -> bool:
        return self._driver is not None

    @property
    def driver(self) -> DriverInfo:
        if self._driver is None:
            raise RuntimeError("inventory not loaded")
        return self._driver

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        """The last snapshot, without touching NVML."""
        return self._gpus

    async def load(self) -> None:
        """Read driver versions and every GPU's static attributes, then a first snapshot."""
        def read_all() -> tuple[DriverInfo, tuple[GpuStatic, ...]]:
            count = int(self._session.call("nvmlDeviceGetCount"))
            return read_driver(self._session), tuple(
                read_static(self._session, i) for i in range(count))

        driver, statics = await self._session.read(read_all)
        self._static = statics
        self._driver = driver
        await self.refresh()
        log.info("inventory loaded", extra={"gpus": len(statics),
                                            "driver": driver.driver_version})

    async def refresh(self, only: Collection[str] = ()) -> tuple[Gpu, ...]:
        """Re-read the dynamic state of every GPU, or of the GPUs whose UUIDs ``only`` names
        (the others as last read), in parallel in the read pool. Each GPU's read begins after
        this call: a caller never gets a read begun before a change it just made, and callers
        that arrive while a read is under way share the one queued behind it."""
        statics = [s for s in self._static if not only or s.uuid in only]
        await asyncio.gather(*(asyncio.shield(self._next_read(s)) for s in statics))
        if not only:
            self.refreshed_at = time.monotonic()
        return self._gpus

    def _next_read(self, static: GpuStatic) -> asyncio.Future[Gpu]:
        queued = self._queued.get(static.uuid)
        if queued is None:
            queued = self._queued[static.uuid] = asyncio.ensure_future(
                self._read_after(static, self._reading.get(static.uuid)))
        return queued

    async def _read_after(self, static: GpuStatic, before: asyncio.Future[Gpu] | None) -> Gpu:
        if before is not None:
            await asyncio.wait([before])  # finished, whatever its outcome
        uuid = static.uuid
        self._reading[uuid] = self._queued.pop(uuid)
        previous = next((g.profiles for g in self._gpus if g.uuid == uuid), ())
        gpu = await self._session.read(partial(read_gpu, self._session, static, previous))
        fresh = {g.uuid: g for g in self._gpus}
        fresh[uuid] = gpu
        self._gpus = tuple(fresh[s.uuid] for s in self._static if s.uuid in fresh)
        return gpu

    async def still_there(self, devices: Sequence[tuple[Gpu, MigDevice | None]]) -> bool:
        """Whether the hardware still shows what a snapshot says of each (GPU, MIG device):
        one cheap NVML read per device (read pool), no walk."""
        return await self._session.read(lambda: all(
            still_there(self._session, gpu, device) for gpu, device in devices))

    def find(self, ref: str) -> Gpu:
        """A GPU by index (``"0"``) or UUID; :class:`NotFound` otherwise."""
        for gpu in self._gpus:
            if ref == gpu.uuid or ascii_integer(ref) == gpu.index:
                return gpu
        raise NotFound(f"no GPU {ref!r} on this node (known: indices 0-{len(self._gpus) - 1} "
                       "or GPU UUIDs)", gpu=ref)
