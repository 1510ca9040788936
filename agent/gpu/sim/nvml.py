"""A stand-in for the ``pynvml`` module: same function names, arguments, return types and
``NVMLError`` codes, backed by :class:`~agent.gpu.sim.hardware.SimulatedHardware`.

Handles are real ctypes pointers (``c_nvmlDevice_t`` and friends) holding fake addresses that
are never reused, so the real pynvml structs can carry them exactly as the C library fills
them. Anything not implemented here resolves to the ``pynvml`` attribute of the same name
(constants, struct classes, ``NVMLError``) or, for an NVML call, to a function that fails with
``NVML_ERROR_FUNCTION_NOT_FOUND`` as pynvml does when the driver lacks the symbol.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

import pynvml

from agent.gpu.sim import links
from agent.gpu.sim.faults import CRASH, NVML_FUNCTIONS
from agent.gpu.sim.hardware import (
    MIG_DEVICES_PER_GPU,
    NO_INSTANCE,
    EventSet,
    SimulatedHardware,
    fail,
)
from agent.gpu.sim.presets import CiProfile, GiProfile
from agent.gpu.sim.state import CiState, GiState, GpuState
from agent.gpu.sim.telemetry import (
    memory_temperature_c,
    memory_utilization,
    sm_clock_mhz,
    temperature_c,
    video_utilization,
)

P = ParamSpec("P")
R = TypeVar("R")
Kind = Literal["gpu", "mig", "gi", "ci", "event_set", "gpm_sample"]

_MIB = 1024 * 1024
# Fake addresses look like heap pointers and step by 64 bytes; they are never dereferenced.
_FIRST_ADDRESS = 0x7F3A_5000_0000
_ADDRESS_STEP = 0x40
_PRUNE_AT = 4096  # handles kept before those of destroyed instances are forgotten
_ARCHITECTURES = {"ampere": pynvml.NVML_DEVICE_ARCH_AMPERE,
                  "hopper": pynvml.NVML_DEVICE_ARCH_HOPPER, "ada": pynvml.NVML_DEVICE_ARCH_ADA,
                  "blackwell": pynvml.NVML_DEVICE_ARCH_BLACKWELL}
_HANDLE_TYPES = {"gpu": pynvml.c_nvmlDevice_t, "mig": pynvml.c_nvmlDevice_t,
                 "gi": pynvml.c_nvmlGpuInstance_t, "ci": pynvml.c_nvmlComputeInstance_t,
                 "event_set": pynvml.c_nvmlEventSet_t, "gpm_sample": pynvml.c_nvmlGpmSample_t}
_WITHOUT_INIT = frozenset({"nvmlInit", "nvmlInitWithFlags", "nvmlErrorString"})
# NVML's encoder/decoder sampling period (µs), as a real H100 reports it.
_VIDEO_PERIOD_US = 167_000
# scopeId meaning every link, for the NVLink field values.
_ALL_LINKS = 0xFFFFFFFF
_REMAP_FIELDS = frozenset({pynvml.NVML_FI_DEV_REMAPPED_COR, pynvml.NVML_FI_DEV_REMAPPED_UNC,
                           pynvml.NVML_FI_DEV_REMAPPED_PENDING,
                           pynvml.NVML_FI_DEV_REMAPPED_FAILURE})
_NVLINK_THROUGHPUT = {pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: "nvlink_tx",
                      pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: "nvlink_rx"}
_NVLINK_ERRORS = frozenset({pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
                            pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
                            pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
                            pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL})
# Healthy boards: no ECC errors, no throttling (the violation counters, in ns).
_ZERO_COUNTERS = frozenset({
    pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL, pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL,
    pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL, pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL,
    pynvml.NVML_FI_DEV_PERF_POLICY_POWER, pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL,
    pynvml.NVML_FI_DEV_PERF_POLICY_SYNC_BOOST, pynvml.NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT,
    pynvml.NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION, pynvml.NVML_FI_DEV_PERF_POLICY_RELIABILITY})
_RECOVERY_FIELDS = frozenset({pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION,
                              pynvml.NVML_FI_DEV_RESET_STATUS,
                              pynvml.NVML_FI_DEV_DRAIN_AND_RESET_STATUS})
_RESET_ACTIONS = frozenset({pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET,
                            pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET})
#: GPM metric id -> the activity counter (agent/gpu/sim/telemetry.py) it is the rate of.
_GPM_ACTIVITY = {
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: "graphics", pynvml.NVML_GPM_METRIC_SM_UTIL: "sm",
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: "occupancy",
    pynvml.NVML_GPM_METRIC_INTEGER_UTIL: "integer",
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: "tensor",
    pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL: "tensor",
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: "dram", pynvml.NVML_GPM_METRIC_FP64_UTIL: "fp64",
    pynvml.NVML_GPM_METRIC_FP32_UTIL: "fp32", pynvml.NVML_GPM_METRIC_FP16_UTIL: "fp16",
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: "pcie_tx",
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: "pcie_rx",
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: "nvlink_tx",
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: "nvlink_rx",
}
_LOOKUP_CALLS = frozenset({"nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByUUID",
                           "nvmlDeviceGetHandleByPciBusId"})


@dataclass(frozen=True)
class _Ref:
    """What a fake address points at. The objects stay referenced after destruction so a
    stale handle still names its GPU (for faults) and reads as INVALID_ARGUMENT; the dead
    ones are dropped in batches (see :meth:`SimulatedNvml._prune`), after which a stale
    handle still reads as INVALID_ARGUMENT."""

    kind: Kind
    gpu: GpuState | None = None
    gi: GiState | None = None
    ci: CiState | None = None
    event_set: EventSet | None = None
    sample: GpmSample | None = None


@dataclass(eq=False)
class GpmSample:
    """An ``nvmlGpmSample_t``: empty until a sample call fills it with a device's activity
    counters (``gi`` set for ``nvmlGpmMigSampleGet``)."""

    gpu: GpuState | None = None
    gi: GiState | None = None
    at: float = 0.0
    counters: dict[str, float] | None = None


def _alive(ref: _Ref) -> bool:
    """Whether the GPU or compute instance a handle names still exists."""
    gpu, gi, ci = ref.gpu, ref.gi, ref.ci
    if gi is not None and gpu is not None and all(g is not gi for g in gpu.gpu_instances):
        return False
    return not (ci is not None and gi is not None
                and all(c is not ci for c in gi.compute_instances))


Method = Callable[Concatenate["SimulatedNvml", P], R]


def _nvml(fn: Method[P, R]) -> Method[P, R]:
    """Make a method an NVML call: counted, subject to faults and latency, needing nvmlInit,
    and run under the hardware lock."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(self: SimulatedNvml, /, *args: P.args, **kwargs: P.kwargs) -> R:
        self._enter(name, args)
        with self._hw.lock:
            if name not in _WITHOUT_INIT and self._inits == 0:
                fail(pynvml.NVML_ERROR_UNINITIALIZED)
            return fn(self, *args, **kwargs)
    return call


def _alias(name: str, target: str) -> Callable[..., Any]:
    """An NVML call that pynvml implements by calling another (counted as both, like there)."""
    def call(self: SimulatedNvml, /, *args: Any, **kwargs: Any) -> Any:
        self._enter(name, args)
        return getattr(self, target)(*args, **kwargs)
    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"Alias of :meth:`{target}`, as in pynvml."
    return call


def _text(value: str | bytes) -> str:
    # pynvml's convertStrBytes encodes str arguments; accept either.
    return value.decode() if isinstance(value, bytes) else str(value)


def _cell(ref: Any) -> Any:
    """The ctypes integer behind a count argument: ``byref(c_uint)``, ``pointer(c_uint)`` or
    the ``c_uint`` itself."""
    if isinstance(ref, ctypes._SimpleCData):
        return ref
    if hasattr(ref, "_obj"):  # ctypes.byref(...)
        return ref._obj
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)


def _buffer(ref: Any) -> tuple[Any, int | None]:
    """The array a caller passed for results, and its length when ctypes knows it."""
    target = ref._obj if hasattr(ref, "_obj") else ref
    if isinstance(target, ctypes.Array):
        return target, len(target)
    if isinstance(target, ctypes._Pointer):
        return target, None
    fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)


def _struct(ref: Any) -> Any:
    """A placement argument: the struct, ``byref`` of it, or a pointer to it."""
    target = ref._obj if hasattr(ref, "_obj") else ref
    if isinstance(target, ctypes._Pointer):
        target = target.contents if target else None
    if not isinstance(target, ctypes.Structure) or not hasattr(target, "start"):
        fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return target


class SimulatedNvml:
    """The ``pynvml`` call surface over simulated GPUs (see the module docstring)."""

    def __init__(self, hardware: SimulatedHardware) -> None:
        self._hw = hardware
        self._inits = 0
        self._next_address = _FIRST_ADDRESS
        self._refs: dict[int, _Ref] = {}
        self._addresses: dict[tuple[Kind, object], int] = {}
        self._prune_at = _PRUNE_AT

    @property
    def handles_known(self) -> int:
        """The handles the simulator keeps (live objects', and destroyed ones' not yet
        forgotten): bounded however many instances were ever made."""
        return len(self._refs)

    # -- machinery -------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(pynvml, name)
        if name in NVML_FUNCTIONS:
            return self._missing(name)
        return value

    def _missing(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._enter(name, args)
            fail(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND if self._inits
                 else pynvml.NVML_ERROR_UNINITIALIZED)
        call.__name__ = name
        return call

    def _enter(self, name: str, args: tuple[Any, ...]) -> None:
        """Count the call, then fire a matching fault or sleep the configured latency."""
        hw = self._hw
        with hw.lock:
            hw.calls[name] += 1
            gpu = self._fault_gpu(name, args) if hw.faults.wants_gpu(name) else None
            fault = hw.faults.match(name, gpu)
            latency = hw.latencies.get(name, 0.0)
        if fault is not None:
            if fault.error == CRASH:
                os.kill(os.getpid(), signal.SIGKILL)
            fail(fault.code)
        if latency > 0:
            time.sleep(latency)

    def _fault_gpu(self, name: str, args: tuple[Any, ...]) -> str | None:
        """UUID of the GPU a call concerns, for faults limited to one GPU."""
        if not args:
            return None
        first = args[0]
        if name in _LOOKUP_CALLS:
            try:
                if name == "nvmlDeviceGetHandleByIndex":
                    gpus = self._hw.state.gpus
                    return gpus[int(first)].uuid if 0 <= int(first) < len(gpus) else None
                if name == "nvmlDeviceGetHandleByUUID":
                    return self._hw.find_device(_text(first))[0].uuid
                return next(g.uuid for g in self._hw.state.gpus
                            if self._hw.bus_id(g) == _bus_id(_text(first)))
            except (IndexError, KeyError, StopIteration, ValueError, TypeError):
                return None
        ref = self._refs.get(_address(first) or 0)
        return ref.gpu.uuid if ref is not None and ref.gpu is not None else None

    def _handle(self, kind: Kind, obj: object, **ref: Any) -> Any:
        """The handle of ``obj`` (one address per object, for as long as the process runs)."""
        address = self._addresses.get((kind, obj))
        if address is None:
            address = self._next_address
            self._next_address += _ADDRESS_STEP
            self._addresses[(kind, obj)] = address
            self._refs[address] = _Ref(kind=kind, **ref)
            if len(self._refs) > self._prune_at:
                self._prune()
        return ctypes.cast(ctypes.c_void_p(address), _HANDLE_TYPES[kind])

    def _prune(self) -> None:
        """Forget handles of destroyed instances: every GI and CI ever made would otherwise
        stay referenced for the life of the process (a soak's RSS grew by megabytes)."""
        dead = [(key, address) for key, address in self._addresses.items()
                if not _alive(self._refs[address])]
        for key, address in dead:
            del self._addresses[key]
            del self._refs[address]
        self._prune_at = max(_PRUNE_AT, 2 * len(self._refs))

    def _gpu_handle(self, gpu: GpuState) -> Any:
        return self._handle("gpu", gpu, gpu=gpu)

    def _mig_handle(self, gpu: GpuState, gi: GiState, ci: CiState) -> Any:
        return self._handle("mig", ci, gpu=gpu, gi=gi, ci=ci)

    def _gi_handle(self, gpu: GpuState, gi: GiState) -> Any:
        return self._handle("gi", gi, gpu=gpu, gi=gi)

    def _ci_handle(self, gpu: GpuState, gi: GiState, ci: CiState) -> Any:
        return self._handle("ci", ci, gpu=gpu, gi=gi, ci=ci)

    def _resolve(self, handle: Any, *kinds: Kind) -> _Ref:
        """The live object behind a handle of one of ``kinds``: INVALID_ARGUMENT for anything
        else (including a destroyed instance), GPU_IS_LOST for any handle of a lost GPU."""
        ref = self._refs.get(_address(handle) or 0)
        if ref is None or ref.kind not in kinds or not _alive(ref):
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if ref.gpu is not None and ref.gpu.lost:
            fail(pynvml.NVML_ERROR_GPU_IS_LOST)
        return ref

    def _device(self, handle: Any) -> tuple[GpuState, GiState | None, CiState | None]:
        """A GPU or MIG device handle."""
        ref = self._resolve(handle, "gpu", "mig")
        assert ref.gpu is not None
        return ref.gpu, ref.gi, ref.ci

    def _whole_gpu(self, handle: Any, *, mig_handle_error: int) -> GpuState:
        """A GPU handle; a MIG device handle fails with ``mig_handle_error``."""
        gpu, gi, _ = self._device(handle)
        if gi is not None:
            fail(mig_handle_error)
        return gpu

    def _mig_gpu(self, handle: Any) -> GpuState:
        """A GPU handle of a MIG-capable GPU whose current MIG mode is enabled."""
        gpu = self._whole_gpu(handle, mig_handle_error=pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not self._hw.model.mig_capable or not gpu.mig_current:
            fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _gpu_instance(self, handle: Any) -> tuple[GpuState, GiState]:
        ref = self._resolve(handle, "gi")
        assert ref.gpu is not None and ref.gi is not None
        return ref.gpu, ref.gi

    def _compute_instance(self, handle: Any) -> tuple[GpuState, GiState, CiState]:
        ref = self._resolve(handle, "ci")
        assert ref.gpu is not None and ref.gi is not None and ref.ci is not None
        return ref.gpu, ref.gi, ref.ci

    def _gi_profile(self, profile_id: int) -> GiProfile:
        """A device profile ID (19, 14, 9 ...) this SKU has; INVALID_ARGUMENT otherwise."""
        profile = self._hw.model.gi_profile(int(profile_id))
        if profile is None:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return profile

    def _ci_profile(self, gi: GiState, profile_id: int) -> CiProfile:
        profile = self._hw.model.ci_profile(self._hw.gi_profile(gi), int(profile_id))
        if profile is None:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return profile

    def _event_set(self, handle: Any) -> EventSet:
        ref = self._refs.get(_address(handle) or 0)
        if ref is None or ref.event_set is None or ref.event_set.freed:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ref.event_set

    # -- initialisation and system ---------------------------------------------------------

    @_nvml
    def nvmlInitWithFlags(self, flags: int) -> None:
        self._inits += 1

    def nvmlInit(self) -> None:
        """``nvmlInitWithFlags(0)``, as in pynvml (counted as both)."""
        self._enter("nvmlInit", ())
        self.nvmlInitWithFlags(0)

    @_nvml
    def nvmlShutdown(self) -> None:
        self._inits -= 1

    @_nvml
    def nvmlErrorString(self, result: int) -> str:
        return str(pynvml.NVMLError._errcode_to_string.get(int(result), "Unknown Error"))

    @_nvml
    def nvmlSystemGetDriverVersion(self) -> str:
        return self._hw.preset.driver.version

    @_nvml
    def nvmlSystemGetNVMLVersion(self) -> str:
        return self._hw.preset.driver.nvml_version

    @_nvml
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._hw.preset.driver.cuda_version

    @_nvml
    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self._hw.preset.driver.cuda_version

    # -- devices ---------------------------------------------------------------------------

    @_nvml
    def nvmlDeviceGetCount(self) -> int:
        return len(self._hw.state.gpus)

    @_nvml
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not 0 <= int(index) < len(self._hw.state.gpus):
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._hw.gpu(int(index))
        if gpu.lost:
            fail(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._gpu_handle(gpu)

    @_nvml
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:
        try:
            gpu, gi, ci = self._hw.find_device(_text(uuid))
        except KeyError:
            fail(pynvml.NVML_ERROR_NOT_FOUND)
        if gpu.lost:
            fail(pynvml.NVML_ERROR_GPU_IS_LOST)
        if gi is not None and ci is not None:
            return self._mig_handle(gpu, gi, ci)
        return self._gpu_handle(gpu)

    @_nvml
    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str | bytes) -> Any:
        try:
            wanted = _bus_id(_text(pciBusId))
        except ValueError:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for gpu in self._hw.state.gpus:
            if self._hw.bus_id(gpu) == wanted:
                if gpu.lost:
                    fail(pynvml.NVML_ERROR_GPU_IS_LOST)
                return self._gpu_handle(gpu)
        fail(pynvml.NVML_ERROR_NOT_FOUND)

    @_nvml
    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._whole_gpu(handle, mig_handle_error=pynvml.NVML_ERROR_NOT_SUPPORTED).index

    @_nvml
    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return self._whole_gpu(handle, mig_handle_error=pynvml.NVML_ERROR_NOT_SUPPORTED).index

    @_nvml
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        gpu, _, ci = self._device(handle)
        return ci.uuid if ci is not None else gpu.uuid

    @_nvml
    def nvmlDeviceGetName(self, handle: Any) -> str:
        _, gi, ci = self._device(handle)
        if gi is None or ci is None:
            return self._hw.model.name
        return f"{self._hw.model.name} MIG {self._hw.ci_profile(gi, ci).name}"

    @_nvml
    def nvmlDeviceGetBrand(self, handle: Any) -> int:
        self._device(handle)
        return int(pynvml.NVML_BRAND_NVIDIA)

    @_nvml
    def nvmlDeviceGetArchitecture(self, device: Any) -> int:
        self._device(device)
        return int(_ARCHITECTURES[self._hw.model.architecture])

    @_nvml
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        self._device(handle)
        return self._hw.model.cuda_capability

    @_nvml
    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> Any:
        gpu, _, _ = self._device(handle)  # a MIG device reports its parent's PCI location
        info = pynvml.nvmlPciInfo_t()
        bus = self._hw.preset.bus_numbers[gpu.index]
        info.busIdLegacy = f"0000:{bus:02X}:00.0".encode()
        info.busId = self._hw.bus_id(gpu).encode()
        info.domain, info.bus, info.device = 0, bus, 0
        info.pciDeviceId = self._hw.model.pci_device_id
        info.pciSubSystemId = self._hw.model.pci_subsystem_id
        return info

    nvmlDeviceGetPciInfo = _alias("nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v3")

    @_nvml
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        gpu, gi, _ = self._device(handle)
        if gi is None:
            total, used = self._hw.model.memory_mib, self._hw.memory_used_mib(gpu)
        else:
            total, used = self._hw.gi_profile(gi).memory_mib, self._hw.memory_used_mib(gpu, gi)
        if not version:
            memory = pynvml.c_nvmlMemory_t()
            memory.total, memory.used = total * _MIB, used * _MIB
            memory.free = memory.total - memory.used
            return memory
        memory = pynvml.c_nvmlMemory_v2_t()
        memory.version = version
        reserved = 0 if gi is not None else _reserved_mib(total)
        memory.total, memory.reserved, memory.used = total * _MIB, reserved * _MIB, used * _MIB
        memory.free = max(0, memory.total - memory.reserved - memory.used)
        return memory

    @_nvml
    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        gpu, _, _ = self._device(handle)
        return self._hw.preset.numa_nodes[gpu.index]

    @_nvml
    def nvmlDeviceGetCpuAffinity(self, handle: Any, cpuSetSize: int) -> Any:
        gpu, _, _ = self._device(handle)
        words = (ctypes.c_ulonglong * int(cpuSetSize))()
        for cpu in self._hw.preset.cpus.numa_cpus(self._hw.preset.numa_nodes[gpu.index]):
            if cpu // 64 < len(words):
                words[cpu // 64] |= 1 << (cpu % 64)
        return words

    # -- interconnect: NVLink, PCIe topology, P2P, fabric ---------------------------------

    def _link(self, handle: Any, link: int) -> tuple[GpuState, links.LinkEnd]:
        """A GPU handle and one of its wired links: INVALID_ARGUMENT past NVML's link limit,
        NOT_SUPPORTED for a link the GPU does not have (what NVML answers there)."""
        gpu = self._whole_gpu(handle, mig_handle_error=pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if isinstance(link, bool) or not isinstance(link, int) or not (
                0 <= link < pynvml.NVML_NVLINK_MAX_LINKS):
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        end = links.link_end(self._hw.preset, gpu.index, link)
        if end is None:
            fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu, end

    @_nvml
    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        self._link(device, link)
        return int(pynvml.NVML_FEATURE_ENABLED)

    @_nvml
    def nvmlDeviceGetNvLinkVersion(self, device: Any, link: int) -> int:
        self._link(device, link)
        return self._hw.model.nvlink_version

    @_nvml
    def nvmlDeviceGetNvLinkCapability(self, device: Any, link: int, capability: int) -> int:
        self._link(device, link)
        if not 0 <= int(capability) < pynvml.NVML_NVLINK_CAP_COUNT:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(int(capability) != pynvml.NVML_NVLINK_CAP_SLI_BRIDGE)

    @_nvml
    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Any, link: int) -> Any:
        """pynvml's wrapper of the ``_v2`` symbol."""
        _, end = self._link(device, link)
        info = pynvml.nvmlPciInfo_t()  # nvml.h: pciSubSystemId is not filled
        info.busIdLegacy = f"0000:{end.remote_bus:02X}:00.0".encode()
        info.busId = f"00000000:{end.remote_bus:02X}:00.0".encode()
        info.domain, info.bus, info.device = 0, end.remote_bus, 0
        if end.remote_gpu is not None:
            info.pciDeviceId = self._hw.model.pci_device_id
        return info

    @_nvml
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        return self._link(handle, link)[1].remote_type

    def _gpu_pair(self, device1: Any, device2: Any) -> tuple[GpuState, GpuState]:
        error = pynvml.NVML_ERROR_INVALID_ARGUMENT
        a = self._whole_gpu(device1, mig_handle_error=error)
        b = self._whole_gpu(device2, mig_handle_error=error)
        if a is b:
            fail(error)
        return a, b

    @_nvml
    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int:
        a, b = self._gpu_pair(device1, device2)
        return links.common_ancestor(self._hw.preset, a.index, b.index)

    @_nvml
    def nvmlDeviceGetP2PStatus(self, device1: Any, device2: Any, p2pIndex: int) -> int:
        a, b = self._gpu_pair(device1, device2)
        if not 0 <= int(p2pIndex) < pynvml.NVML_P2P_CAPS_INDEX_UNKNOWN:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return links.p2p_status(self._hw.preset, a.index, b.index, int(p2pIndex))

    def _fabric(self, device: Any, info: Any, *, versioned: bool) -> int:
        # nvml.h: Hopper and newer, for GPUs the fabric manager registers. HGX/DGX H100 on
        # NVSwitch answer (COMPLETED, zero cluster UUID: no multi-node NVLink); Ampere, Ada
        # and GPUs without NVSwitch answer NOT_SUPPORTED (topology.md 2.5).
        gpu = self._whole_gpu(device, mig_handle_error=pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not self._hw.preset.fabric_capable:
            fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        target = info._obj if hasattr(info, "_obj") else info
        if isinstance(target, ctypes._Pointer):
            target = target.contents
        if not isinstance(target, ctypes.Structure) or not hasattr(target, "cliqueId"):
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if versioned and int(getattr(target, "version", 0)) not in (
                pynvml.nvmlGpuFabricInfo_v2, pynvml.nvmlGpuFabricInfo_v3):
            fail(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        answer = links.fabric_answer(self._hw.preset, gpu.fabric, gpu.fabric_status)
        raw = uuid_bytes(answer.cluster_uuid) if answer.cluster_uuid else bytes(16)
        for i, byte in enumerate(raw):
            target.clusterUuid[i] = byte
        target.status = answer.status
        target.cliqueId = answer.clique_id
        target.state = answer.state
        if hasattr(target, "healthMask"):
            target.healthMask = answer.health_mask
        if hasattr(target, "healthSummary"):
            target.healthSummary = answer.health_summary
        return int(pynvml.NVML_SUCCESS)

    @_nvml
    def nvmlDeviceGetGpuFabricInfoV(self, device: Any, gpuFabricInfo: Any) -> int:
        return self._fabric(device, gpuFabricInfo, versioned=True)

    @_nvml
    def nvmlDeviceGetGpuFabricInfo(self, device: Any, gpuFabricInfo: Any) -> int:
        return self._fabric(device, gpuFabricInfo, versioned=False)

    @_nvml
    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        self._telemetry_gpu(handle)
        return self._hw.model.pcie_generation

    nvmlDeviceGetGpuMaxPcieLinkGeneration = _alias("nvmlDeviceGetGpuMaxPcieLinkGeneration",
                                                   "nvmlDeviceGetMaxPcieLinkGeneration")

    @_nvml
    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        self._telemetry_gpu(handle)
        return self._hw.model.pcie_width

    @_nvml
    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        gpu = self._telemetry_gpu(handle)
        # An idle GPU trains its link down to save power; under load it runs at the maximum.
        return self._hw.model.pcie_generation if self._hw.utilization(gpu) else 1

    @_nvml
    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        self._telemetry_gpu(handle)
        return self._hw.model.pcie_width

    def _process_info(self, pid: int, used_mib: int, gi: GiState | None,
                      ci: CiState | None) -> Any:
        info = pynvml.c_nvmlProcessInfo_v2_t()
        info.pid = pid
        info.usedGpuMemory = used_mib * _MIB
        info.gpuInstanceId = gi.id if gi is not None else NO_INSTANCE
        info.computeInstanceId = ci.id if ci is not None else NO_INSTANCE
        return pynvml.nvmlStructToFriendlyObject(info)

    def _processes(self, handle: Any, *, mps_clients: bool = False) -> list[Any]:
        """Compute processes on a device: plain ones and MPS servers (a server's memory is
        its clients' on that device, as NVML attributes client work to the server); with
        ``mps_clients``, the MPS clients instead."""
        gpu, _, ci = self._device(handle)
        hw = self._hw
        hw.prune_mps()
        found = []
        placed = [p for p in hw.placed_processes(gpu) if ci is None or p.ci is ci]
        for p in placed:
            if (p.process.mps_server is not None) == mps_clients:
                found.append(self._process_info(p.process.pid, p.process.used_memory_mib,
                                                p.gi, p.ci))
        if mps_clients:
            return found
        devices: dict[str, tuple[GiState | None, CiState | None]] = (
            {gpu.uuid: (None, None)} if ci is None else {})
        devices.update({c.uuid: (g, c) for g, c in hw.mig_devices(gpu)
                        if ci is None or c is ci})
        for server in hw.servers_on(set(devices)):
            for device in server.devices:
                if device not in devices:
                    continue
                used = sum(p.used_memory_mib for p in hw.clients(server)
                           if p.device_uuid == device)
                found.append(self._process_info(server.pid, used, *devices[device]))
        return found

    @_nvml
    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any) -> list[Any]:
        return self._processes(handle)

    @_nvml
    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
        return self._processes(handle)

    nvmlDeviceGetComputeRunningProcesses = _alias("nvmlDeviceGetComputeRunningProcesses",
                                                  "nvmlDeviceGetComputeRunningProcesses_v3")

    @_nvml
    def nvmlDeviceGetMPSComputeRunningProcesses_v3(self, handle: Any) -> list[Any]:
        return self._processes(handle, mps_clients=True)

    @_nvml
    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
        return self._processes(handle, mps_clients=True)

    nvmlDeviceGetMPSComputeRunningProcesses = _alias(
        "nvmlDeviceGetMPSComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses_v3")

    @_nvml
    def nvmlDeviceGetComputeMode(self, handle: Any) -> int:
        gpu, _, ci = self._device(handle)
        return self._hw.compute_mode(gpu, ci)

    @_nvml
    def nvmlDeviceSetComputeMode(self, handle: Any, mode: int) -> None:
        gpu, _, ci = self._device(handle)
        self._hw.set_compute_mode(gpu, ci, int(mode))

    @_nvml
    def nvmlDeviceGetAttributes_v2(self, device: Any) -> Any:
        _, gi, ci = self._device(device)
        if gi is None or ci is None:
            fail(pynvml.NVML_ERROR_NOT_SUPPORTED)  # nvml.h: only MIG device handles
        gi_profile, ci_profile = self._hw.gi_profile(gi), self._hw.ci_profile(gi, ci)
        attributes = pynvml.c_nvmlDeviceAttributes()
        attributes.multiprocessorCount = ci_profile.multiprocessors
        engines = gi_profile.engines
        attributes.sharedCopyEngineCount = engines.copy
        attributes.sharedDecoderCount = engines.decoder
        attributes.sharedEncoderCount = engines.encoder
        attributes.sharedJpegCount = engines.jpeg
        attributes.sharedOfaCount = engines.ofa
        attributes.gpuInstanceSliceCount = gi_profile.slices
        attributes.computeInstanceSliceCount = ci_profile.slices
        attributes.memorySizeMB = gi_profile.memory_mib
        return attributes

    nvmlDeviceGetAttributes = _alias("nvmlDeviceGetAttributes", "nvmlDeviceGetAttributes_v2")

    # -- telemetry (whole GPUs; MIG device handles get NOT_SUPPORTED, as from NVML) ---------

    def _telemetry_gpu(self, handle: Any) -> GpuState:
        return self._whole_gpu(handle, mig_handle_error=pynvml.NVML_ERROR_NOT_SUPPORTED)

    @_nvml
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu = self._telemetry_gpu(handle)
        if gpu.mig_current:
            fail(pynvml.NVML_ERROR_NOT_SUPPORTED)  # NVML has no utilisation in MIG mode
        util = self._hw.utilization(gpu)
        rates = pynvml.c_nvmlUtilization_t()
        rates.gpu, rates.memory = util, memory_utilization(util)
        return rates

    @_nvml
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._hw.power_mw(self._telemetry_gpu(handle))

    @_nvml
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        self._telemetry_gpu(handle)
        return self._hw.model.tdp_w * 1000

    @_nvml
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        gpu = self._telemetry_gpu(handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return temperature_c(self._hw.model, self._hw.utilization(gpu))

    @_nvml
    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        gpu = self._telemetry_gpu(handle)
        model = self._hw.model
        if type in (pynvml.NVML_CLOCK_GRAPHICS, pynvml.NVML_CLOCK_SM):
            return sm_clock_mhz(model, self._hw.utilization(gpu))
        if type == pynvml.NVML_CLOCK_MEM:
            return model.mem_clock_mhz
        if type == pynvml.NVML_CLOCK_VIDEO:
            return sm_clock_mhz(model, self._hw.utilization(gpu)) * 9 // 10
        fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    @_nvml
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return self._hw.energy_mj(self._telemetry_gpu(handle))

    @_nvml
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        gpu = self._telemetry_gpu(handle)
        # Nothing running: clocks held low because the GPU is idle; otherwise none.
        return 0 if self._hw.utilization(gpu) else int(pynvml.nvmlClocksEventReasonGpuIdle)

    @_nvml
    def nvmlDeviceGetEncoderUtilization(self, handle: Any) -> list[int]:
        return [self._video(handle, encoder=True), _VIDEO_PERIOD_US]

    @_nvml
    def nvmlDeviceGetDecoderUtilization(self, handle: Any) -> list[int]:
        return [self._video(handle, encoder=False), _VIDEO_PERIOD_US]

    def _video(self, handle: Any, *, encoder: bool) -> int:
        gpu = self._telemetry_gpu(handle)
        if gpu.mig_current:
            fail(pynvml.NVML_ERROR_NOT_SUPPORTED)  # per-engine only, like utilisation
        model = self._hw.model
        pids = [p.process.pid for p in self._hw.placed_processes(gpu)]
        return video_utilization(pids, model.encoders if encoder else model.decoders,
                                 encoder=encoder)

    @_nvml
    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return self._telemetry_gpu(handle).pcie_replays

    @_nvml
    def nvmlDeviceGetPcieThroughput(self, device: Any, counter: int) -> int:
        gpu = self._telemetry_gpu(device)
        names = {pynvml.NVML_PCIE_UTIL_TX_BYTES: "pcie_tx", pynvml.NVML_PCIE_UTIL_RX_BYTES:
                 "pcie_rx"}
        if counter not in names:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(self._hw.rates(gpu)[names[counter]] * 1024)  # MiB/s -> KB/s

    @_nvml
    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        gpu = self._telemetry_gpu(device)
        return (gpu.remapped_correctable, gpu.remapped_uncorrectable, 0,
                int(gpu.remap_failed))

    @_nvml
    def nvmlDeviceGetGridLicensableFeatures(self, handle: Any) -> Any:
        self._telemetry_gpu(handle)
        # Bare metal: the call answers, and no vGPU licensing is offered.
        features = pynvml.c_nvmlGridLicensableFeatures_v4_t()
        features.isGridLicenseSupported = 0
        features.licensableFeaturesCount = 0
        return features

    nvmlDeviceGetGridLicensableFeatures_v4 = _alias("nvmlDeviceGetGridLicensableFeatures_v4",
                                                    "nvmlDeviceGetGridLicensableFeatures")

    @_nvml
    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Sequence[Any]) -> Any:
        """Each requested field with its own status, as NVML fills ``nvmlFieldValue_t``:
        the call succeeds and an absent feature is NOT_SUPPORTED in that field only."""
        gpu, gi, _ = self._device(handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        stamp = int(time.time() * 1_000_000)
        for i, requested in enumerate(fieldIds):
            field_id, scope = (requested if isinstance(requested, tuple)
                               else (requested, 0))
            value = values[i]
            value.fieldId, value.scopeId, value.timestamp = int(field_id), int(scope), stamp
            found = None if gi is not None else self._field(gpu, int(field_id), int(scope))
            if found is None:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            kind, number = found
            value.nvmlReturn = pynvml.NVML_SUCCESS
            value.valueType = kind
            if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
                value.value.uiVal = int(number)
            else:
                value.value.ullVal = int(number)
        return values

    def _field(self, gpu: GpuState, field_id: int, scope: int) -> tuple[int, int] | None:
        """(value type, value) of one field of a whole GPU; None where NVML says
        NOT_SUPPORTED on this model (memory temperature off HBM, NVLink without links,
        page retirement on Ampere and later, which remap rows instead) or driver (the
        recovery action before it had one)."""
        hw, uint, ull = self._hw, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, \
            pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
        if field_id == pynvml.NVML_FI_DEV_MEMORY_TEMP:
            if not hw.model.hbm:
                return None
            return uint, memory_temperature_c(hw.model, hw.utilization(gpu))
        if field_id in _REMAP_FIELDS:
            return uint, {
                pynvml.NVML_FI_DEV_REMAPPED_COR: gpu.remapped_correctable,
                pynvml.NVML_FI_DEV_REMAPPED_UNC: gpu.remapped_uncorrectable,
                pynvml.NVML_FI_DEV_REMAPPED_PENDING: 0,
                pynvml.NVML_FI_DEV_REMAPPED_FAILURE: int(gpu.remap_failed)}[field_id]
        if field_id in _NVLINK_THROUGHPUT:
            wired = links.link_count(hw.preset)
            if not wired or not (scope == _ALL_LINKS or 0 <= scope < wired):
                return None
            _, counters = hw.activity(gpu)
            mib = counters[_NVLINK_THROUGHPUT[field_id]]
            return ull, int(mib * 1024 / (1 if scope == _ALL_LINKS else wired))  # KiB
        if field_id in _NVLINK_ERRORS:
            return (ull, 0) if links.link_count(hw.preset) else None
        if field_id in _ZERO_COUNTERS:
            return ull, 0
        if field_id == pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
            return ull, hw.energy_mj(gpu)
        if field_id == pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER:
            return uint, gpu.pcie_replays
        if field_id in _RECOVERY_FIELDS:
            if not hw.preset.driver.recovery_action:
                return None
            action = gpu.recovery_action
            # 226/227, deprecated for 230, still answer: "reset required", "drain and reset
            # recommended" (nvidia-smi -q's "GPU Reset Status"), 0 or 1.
            return uint, {pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: action,
                          pynvml.NVML_FI_DEV_RESET_STATUS: int(action in _RESET_ACTIONS),
                          pynvml.NVML_FI_DEV_DRAIN_AND_RESET_STATUS:
                              int(action == pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET),
                          }[field_id]
        return None

    # -- GPM (Hopper and later) ------------------------------------------------------------

    @_nvml
    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any:
        self._whole_gpu(device, mig_handle_error=pynvml.NVML_ERROR_NOT_SUPPORTED)
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        # nvml.h: answers on every GPU; only the flag says whether GPM is there.
        support.isSupportedDevice = int(self._hw.model.gpm)
        return support

    @_nvml
    def nvmlGpmSampleAlloc(self) -> Any:
        sample = GpmSample()
        return self._handle("gpm_sample", sample, sample=sample)

    @_nvml
    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        address = _address(gpmSample) or 0
        ref = self._refs.get(address)
        if ref is None or ref.sample is None:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        # Freed memory: the address is never handed out again, so a use after free fails.
        del self._refs[address]
        del self._addresses[("gpm_sample", ref.sample)]

    def _sample(self, handle: Any) -> GpmSample:
        ref = self._refs.get(_address(handle) or 0)
        if ref is None or ref.sample is None:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ref.sample

    def _gpm_gpu(self, device: Any) -> GpuState:
        gpu = self._whole_gpu(device, mig_handle_error=pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not self._hw.model.gpm:
            fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    @_nvml
    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> Any:
        gpu = self._gpm_gpu(device)
        if gpu.mig_current:
            # In MIG mode the counters are per GPU instance (nvmlGpmMigSampleGet).
            fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._take(self._sample(gpmSample), gpu, None)
        return gpmSample

    @_nvml
    def nvmlGpmMigSampleGet(self, device: Any, gpuInstanceId: int, gpmSample: Any) -> Any:
        gpu = self._gpm_gpu(device)
        if not gpu.mig_current:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gi = next((g for g in gpu.gpu_instances if g.id == int(gpuInstanceId)), None)
        if gi is None:
            fail(pynvml.NVML_ERROR_NOT_FOUND)
        self._take(self._sample(gpmSample), gpu, gi)
        return gpmSample

    def _take(self, sample: GpmSample, gpu: GpuState, gi: GiState | None) -> None:
        sample.gpu, sample.gi = gpu, gi
        sample.at, sample.counters = self._hw.activity(gpu, gi)

    @_nvml
    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        """Each metric the mean rate between the two samples; a metric the simulator does not
        model is NOT_SUPPORTED in its own entry, as NVML reports per metric."""
        request = metricsGet._obj if hasattr(metricsGet, "_obj") else metricsGet
        if not isinstance(request, pynvml.c_nvmlGpmMetricsGet_t):
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if int(request.version) != pynvml.NVML_GPM_METRICS_GET_VERSION:
            fail(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        count = int(request.numMetrics)
        first, second = self._sample(request.sample1), self._sample(request.sample2)
        if (not 0 < count <= pynvml.NVML_GPM_METRIC_MAX or first.counters is None
                or second.counters is None or first.gpu is not second.gpu
                or first.gi is not second.gi or second.at <= first.at):
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        elapsed = second.at - first.at
        entries = request.metrics
        for i in range(count):
            metric = entries[i]
            name = _GPM_ACTIVITY.get(int(metric.metricId))
            if name is None:
                metric.nvmlReturn, metric.value = pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0
                continue
            metric.nvmlReturn = pynvml.NVML_SUCCESS
            metric.value = (second.counters[name] - first.counters[name]) / elapsed
        return metricsGet

    # -- MIG mode --------------------------------------------------------------------------

    def _mig_capable_gpu(self, handle: Any) -> GpuState:
        gpu = self._whole_gpu(handle, mig_handle_error=pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not self._hw.model.mig_capable:
            fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    @_nvml
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        gpu = self._mig_capable_gpu(device)
        return [gpu.mig_current, gpu.mig_pending]

    @_nvml
    def nvmlDeviceSetMigMode(self, device: Any, mode: int) -> int:
        return self._hw.set_mig_mode(self._mig_capable_gpu(device), int(mode))

    # -- GPU instances ---------------------------------------------------------------------

    def _gi_profile_info(self, profile: GiProfile, version: int) -> Any:
        info = (pynvml.c_nvmlGpuInstanceProfileInfo_v2_t() if version == 2
                else pynvml.c_nvmlGpuInstanceProfileInfo_t())
        model = self._hw.model
        info.id = profile.id
        info.isP2pSupported = int(model.architecture in ("hopper", "blackwell"))
        info.sliceCount = profile.slices
        info.instanceCount = profile.instance_count
        info.multiprocessorCount = profile.multiprocessors
        info.copyEngineCount = profile.engines.copy
        info.decoderCount = profile.engines.decoder
        info.encoderCount = profile.engines.encoder
        info.jpegCount = profile.engines.jpeg
        info.ofaCount = profile.engines.ofa
        info.memorySizeMB = profile.memory_mib
        if version == 2:
            info.name = f"MIG {profile.name(model.memory_mib)}".encode()
        return info

    @_nvml
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Any, profile: int,
                                            version: int = 2) -> Any:
        if version not in (1, 2):
            fail(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # pynvml refuses other versions
        gpu = self._mig_capable_gpu(device)
        if not 0 <= int(profile) < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        # Profile info answers with MIG off too: the placements call, which nvml.h documents
        # as working "regardless of whether MIG is enabled", takes the id this returns.
        del gpu
        found = self._hw.model.gi_profile_by_index(int(profile))
        if found is None:
            fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._gi_profile_info(found, version)

    nvmlDeviceGetGpuInstanceProfileInfoV = _alias("nvmlDeviceGetGpuInstanceProfileInfoV",
                                                  "nvmlDeviceGetGpuInstanceProfileInfo")

    @_nvml
    def nvmlDeviceGetGpuInstanceProfileInfoById(self, device: Any, profileId: int) -> Any:
        self._mig_capable_gpu(device)
        return self._gi_profile_info(self._gi_profile(profileId), 2)

    nvmlDeviceGetGpuInstanceProfileInfoByIdV = _alias(
        "nvmlDeviceGetGpuInstanceProfileInfoByIdV", "nvmlDeviceGetGpuInstanceProfileInfoById")

    @_nvml
    def nvmlDeviceGetGpuInstancePossiblePlacements(self, device: Any, profileId: int,
                                                   placementsRef: Any, countRef: Any) -> int:
        # nvml.h: "returns all the possible placements ... regardless of whether MIG is
        # enabled or not", so this one needs a MIG-capable GPU but not MIG mode.
        self._mig_capable_gpu(device)
        profile = self._gi_profile(profileId)

        def put(array: Any, i: int, start: int) -> None:
            array[i].start, array[i].size = start, profile.size
        _fill(placementsRef, countRef, profile.starts, put)
        return int(pynvml.NVML_SUCCESS)

    @_nvml
    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: Any, profileId: int) -> int:
        gpu = self._mig_gpu(device)
        return self._hw.gi_remaining(gpu, self._gi_profile(profileId))

    @_nvml
    def nvmlDeviceCreateGpuInstance(self, device: Any, profileId: int) -> Any:
        gpu = self._mig_gpu(device)
        gi = self._hw.create_gi(gpu, self._gi_profile(profileId), None)
        return self._gi_handle(gpu, gi)

    @_nvml
    def nvmlDeviceCreateGpuInstanceWithPlacement(self, device: Any, profileId: int,
                                                 placement: Any) -> Any:
        gpu = self._mig_gpu(device)
        profile = self._gi_profile(profileId)
        wanted = _struct(placement)
        start, size = int(wanted.start), int(wanted.size)
        if start not in profile.starts or size != profile.size:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gi = self._hw.create_gi(gpu, profile, start)
        return self._gi_handle(gpu, gi)

    @_nvml
    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        gpu, gi = self._gpu_instance(gpuInstance)
        self._hw.destroy_gi(gpu, gi)
        return int(pynvml.NVML_SUCCESS)

    @_nvml
    def nvmlDeviceGetGpuInstances(self, device: Any, profileId: int, gpuInstancesRef: Any,
                                  countRef: Any) -> int:
        gpu = self._mig_gpu(device)
        profile = self._gi_profile(profileId)
        found = [gi for gi in gpu.gpu_instances if gi.profile_id == profile.id]

        def put(array: Any, i: int, gi: GiState) -> None:
            array[i] = self._gi_handle(gpu, gi)
        _fill(gpuInstancesRef, countRef, found, put)
        return int(pynvml.NVML_SUCCESS)

    @_nvml
    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:
        gpu = self._mig_gpu(device)
        gi = next((g for g in gpu.gpu_instances if g.id == int(gpuInstanceId)), None)
        if gi is None:
            fail(pynvml.NVML_ERROR_NOT_FOUND)
        return self._gi_handle(gpu, gi)

    @_nvml
    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        gpu, gi = self._gpu_instance(gpuInstance)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = self._gpu_handle(gpu)
        info.id, info.profileId = gi.id, gi.profile_id
        info.placement.start, info.placement.size = gi.start, gi.size
        return info

    # -- compute instances -----------------------------------------------------------------

    @_nvml
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, device: Any, profile: int,
                                                     engProfile: int, version: int = 2) -> Any:
        if version not in (1, 2):
            fail(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        _, gi = self._gpu_instance(device)
        if (not 0 <= int(profile) < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT
                or engProfile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED):
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gi_profile = self._hw.gi_profile(gi)
        found = self._hw.model.ci_profile(gi_profile, int(profile))
        if found is None:
            fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = (pynvml.c_nvmlComputeInstanceProfileInfo_v2_t() if version == 2
                else pynvml.c_nvmlComputeInstanceProfileInfo_t())
        info.id = found.id
        info.sliceCount = found.slices
        info.instanceCount = found.instance_count
        info.multiprocessorCount = found.multiprocessors
        info.sharedCopyEngineCount = gi_profile.engines.copy
        info.sharedDecoderCount = gi_profile.engines.decoder
        info.sharedEncoderCount = gi_profile.engines.encoder
        info.sharedJpegCount = gi_profile.engines.jpeg
        info.sharedOfaCount = gi_profile.engines.ofa
        if version == 2:
            info.name = f"MIG {found.name}".encode()
        return info

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = _alias(
        "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
        "nvmlGpuInstanceGetComputeInstanceProfileInfo")

    @_nvml
    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(self, gpuInstance: Any,
                                                           profileId: int) -> int:
        _, gi = self._gpu_instance(gpuInstance)
        return self._hw.ci_remaining(gi, self._ci_profile(gi, profileId))

    @_nvml
    def nvmlGpuInstanceGetComputeInstancePossiblePlacements(
            self, gpuInstance: Any, profileId: int, placementsRef: Any, countRef: Any) -> int:
        _, gi = self._gpu_instance(gpuInstance)
        profile = self._ci_profile(gi, profileId)

        def put(array: Any, i: int, placement: tuple[int, int]) -> None:
            array[i].start, array[i].size = placement
        _fill(placementsRef, countRef, profile.placements, put)
        return int(pynvml.NVML_SUCCESS)

    @_nvml
    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        gpu, gi = self._gpu_instance(gpuInstance)
        ci = self._hw.create_ci(gpu, gi, self._ci_profile(gi, profileId), None)
        return self._ci_handle(gpu, gi, ci)

    @_nvml
    def nvmlGpuInstanceCreateComputeInstanceWithPlacement(self, gpuInstance: Any,
                                                          profileId: int, placement: Any) -> Any:
        gpu, gi = self._gpu_instance(gpuInstance)
        profile = self._ci_profile(gi, profileId)
        wanted = _struct(placement)
        where = (int(wanted.start), int(wanted.size))
        if where not in profile.placements:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        ci = self._hw.create_ci(gpu, gi, profile, where)
        return self._ci_handle(gpu, gi, ci)

    @_nvml
    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        gpu, gi, ci = self._compute_instance(computeInstance)
        self._hw.destroy_ci(gpu, gi, ci)
        return int(pynvml.NVML_SUCCESS)

    @_nvml
    def nvmlGpuInstanceGetComputeInstances(self, gpuInstance: Any, profileId: int,
                                           computeInstancesRef: Any, countRef: Any) -> int:
        gpu, gi = self._gpu_instance(gpuInstance)
        profile = self._ci_profile(gi, profileId)
        found = [ci for ci in gi.compute_instances if ci.profile_id == profile.id]

        def put(array: Any, i: int, ci: CiState) -> None:
            array[i] = self._ci_handle(gpu, gi, ci)
        _fill(computeInstancesRef, countRef, found, put)
        return int(pynvml.NVML_SUCCESS)

    @_nvml
    def nvmlGpuInstanceGetComputeInstanceById(self, gpuInstance: Any,
                                              computeInstanceId: int) -> Any:
        gpu, gi = self._gpu_instance(gpuInstance)
        ci = next((c for c in gi.compute_instances if c.id == int(computeInstanceId)), None)
        if ci is None:
            fail(pynvml.NVML_ERROR_NOT_FOUND)
        return self._ci_handle(gpu, gi, ci)

    @_nvml
    def nvmlComputeInstanceGetInfo_v2(self, computeInstance: Any) -> Any:
        gpu, gi, ci = self._compute_instance(computeInstance)
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.device = self._gpu_handle(gpu)
        info.gpuInstance = self._gi_handle(gpu, gi)
        info.id, info.profileId = ci.id, ci.profile_id
        info.placement.start, info.placement.size = ci.start, ci.size
        return info

    nvmlComputeInstanceGetInfo = _alias("nvmlComputeInstanceGetInfo",
                                        "nvmlComputeInstanceGetInfo_v2")

    # -- MIG devices -----------------------------------------------------------------------

    @_nvml
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        gpu = self._whole_gpu(device, mig_handle_error=pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return MIG_DEVICES_PER_GPU if self._hw.model.mig_capable and gpu.mig_current else 0

    @_nvml
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        gpu = self._mig_gpu(device)
        if not 0 <= int(index) < MIG_DEVICES_PER_GPU:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        devices = list(self._hw.mig_devices(gpu))
        if int(index) >= len(devices):
            fail(pynvml.NVML_ERROR_NOT_FOUND)
        gi, ci = devices[int(index)]
        return self._mig_handle(gpu, gi, ci)

    @_nvml
    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> Any:
        _, gi, _ = self._device(device)
        # pynvml returns the c_uint itself, not its value.
        return ctypes.c_uint(int(gi is not None))

    def _mig_device(self, handle: Any) -> tuple[GpuState, GiState, CiState]:
        gpu, gi, ci = self._device(handle)
        if gi is None or ci is None:
            fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu, gi, ci

    @_nvml
    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        return self._mig_device(device)[1].id

    @_nvml
    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        return self._mig_device(device)[2].id

    @_nvml
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> Any:
        return self._gpu_handle(self._mig_device(migDevice)[0])

    # -- events ----------------------------------------------------------------------------

    @_nvml
    def nvmlEventSetCreate(self) -> Any:
        event_set = EventSet()
        self._hw.event_sets.append(event_set)
        return self._handle("event_set", event_set, event_set=event_set)

    @_nvml
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._whole_gpu(handle, mig_handle_error=pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._hw.supported_events()

    @_nvml
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        gpu = self._whole_gpu(handle, mig_handle_error=pynvml.NVML_ERROR_NOT_SUPPORTED)
        event_set = self._event_set(eventSet)
        if int(eventTypes) & ~self._hw.supported_events():
            fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        event_set.registrations[gpu.index] = (
            event_set.registrations.get(gpu.index, 0) | int(eventTypes))

    @_nvml
    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        event_set = self._event_set(eventSet)
        event = self._hw.wait_event(event_set, max(0, int(timeoutms)) / 1000)
        if event is None:
            fail(pynvml.NVML_ERROR_TIMEOUT)
        data = pynvml.c_nvmlEventData_t()
        data.device = self._gpu_handle(self._hw.gpu(event.gpu_index))
        data.eventType, data.eventData = event.event_type, event.data
        data.gpuInstanceId, data.computeInstanceId = event.gi_id, event.ci_id
        return data

    nvmlEventSetWait = _alias("nvmlEventSetWait", "nvmlEventSetWait_v2")

    @_nvml
    def nvmlEventSetFree(self, eventSet: Any) -> None:
        event_set = self._event_set(eventSet)
        event_set.freed = True
        self._hw.event_sets.remove(event_set)
        self._hw.changed.notify_all()


def _address(handle: Any) -> int | None:
    """The address a handle holds, or None for anything that is not a pointer."""
    if isinstance(handle, ctypes._Pointer | ctypes.c_void_p):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return None


def _bus_id(text: str) -> str:
    """A PCI bus id in NVML's form (``00000000:1B:00.0``) from any common spelling."""
    domain, bus, rest = text.strip().split(":")
    device, function = rest.split(".")
    return f"{int(domain, 16):08X}:{int(bus, 16):02X}:{int(device, 16):02X}.{int(function, 16)}"


def uuid_bytes(text: str) -> bytes:
    """The 16 bytes of a UUID written as text (dashes optional)."""
    return bytes.fromhex(text.replace("-", ""))


def _reserved_mib(total_mib: int) -> int:
    """What nvmlMemory_v2 reports as reserved for the driver (about 0.6 % of the GPU)."""
    return total_mib // 160


T = TypeVar("T")


def _fill(array_ref: Any, count_ref: Any, items: Sequence[T],
          put: Callable[[Any, int, T], None]) -> None:
    """Return ``items`` the way NVML's array calls do: a NULL array asks for the count; the
    count passed in is the capacity; too small -> INSUFFICIENT_SIZE with the count needed."""
    count = _cell(count_ref)
    if array_ref is None:
        count.value = len(items)
        return
    array, length = _buffer(array_ref)
    capacity = int(count.value) if length is None else min(int(count.value), length)
    if len(items) > capacity:
        count.value = len(items)
        fail(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    for i, item in enumerate(items):
        put(array, i, item)
    count.value = len(items)
