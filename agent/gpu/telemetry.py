"""NVML reads for the metrics collector: one GPU and its MIG GPU instances per call.

Values are keyed by the DCGM field names dcgm-exporter serves (``agent/metrics/fields.py``
holds their types and help texts); which NVML call supplies which field follows DCGM's cache
manager (``reference/dcgm-exporter-and-cdi.md`` A3). A field NVML does not offer on a GPU
(``NOT_SUPPORTED``, ``FUNCTION_NOT_FOUND``, ``NO_PERMISSION``) is remembered and not asked
again until the GPU's MIG mode changes, so an unsupported field costs one call and one counted
error, never a series with a sentinel value. Any other error skips that field for this round
only; the session counts every error.

One :class:`GpuTelemetry` per GPU keeps what rates need between rounds (the NVLink byte
counters, the previous GPM sample). The collector never reads one GPU from two threads at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from agent.errors import GpuLost, NvmlError
from agent.gpu.inventory import read_gi_profiles, read_mig_devices
from agent.gpu.session import NvmlSession
from agent.gpu.types import GiProfile, GpuStatic, MigDevice

log = logging.getLogger("agent.gpu.telemetry")

Value = int | float
Values = dict[str, Value]

UNSUPPORTED = frozenset({"NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND",
                         "NVML_ERROR_NO_PERMISSION"})
_MIB = 1 << 20
# scopeId meaning "all links" for the NVLink throughput fields, as DCGM passes it.
_ALL_LINKS = 0xFFFFFFFF
# DCGM discards GPU temperatures above this as bogus readings.
_MAX_TEMP_C = 200

#: DCGM field -> NVML field id constant, read together with one nvmlDeviceGetFieldValues.
FIELD_VALUE_IDS: tuple[tuple[str, str], ...] = (
    ("DCGM_FI_DEV_MEMORY_TEMP", "NVML_FI_DEV_MEMORY_TEMP"),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "NVML_FI_DEV_REMAPPED_UNC"),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "NVML_FI_DEV_REMAPPED_COR"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "NVML_FI_DEV_REMAPPED_FAILURE"),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "NVML_FI_DEV_ECC_SBE_VOL_TOTAL"),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "NVML_FI_DEV_ECC_DBE_VOL_TOTAL"),
    ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "NVML_FI_DEV_ECC_SBE_AGG_TOTAL"),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "NVML_FI_DEV_ECC_DBE_AGG_TOTAL"),
    ("DCGM_FI_DEV_RETIRED_SBE", "NVML_FI_DEV_RETIRED_SBE"),
    ("DCGM_FI_DEV_RETIRED_DBE", "NVML_FI_DEV_RETIRED_DBE"),
    ("DCGM_FI_DEV_RETIRED_PENDING", "NVML_FI_DEV_RETIRED_PENDING"),
    ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
     "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"),
    ("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
     "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"),
    ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"),
    ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
     "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL"),
    # Violation counters: NVML's value (ns), as DCGM passes it on.
    ("DCGM_FI_DEV_POWER_VIOLATION", "NVML_FI_DEV_PERF_POLICY_POWER"),
    ("DCGM_FI_DEV_THERMAL_VIOLATION", "NVML_FI_DEV_PERF_POLICY_THERMAL"),
    ("DCGM_FI_DEV_SYNC_BOOST_VIOLATION", "NVML_FI_DEV_PERF_POLICY_SYNC_BOOST"),
    ("DCGM_FI_DEV_BOARD_LIMIT_VIOLATION", "NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT"),
    ("DCGM_FI_DEV_LOW_UTIL_VIOLATION", "NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION"),
    ("DCGM_FI_DEV_RELIABILITY_VIOLATION", "NVML_FI_DEV_PERF_POLICY_RELIABILITY"),
)
# Raw NVLink byte counters (KiB) behind DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL.
_NVLINK_RX = "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX"
_NVLINK_TX = "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX"
NVLINK_BANDWIDTH = "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"

#: DCGM profiling field -> (NVML GPM metric constant, scale). GPM gives percentages (DCGM
#: divides by 100 for its ratios) and PCIe traffic in MiB/s (DCGM's fields are bytes/s).
GPM_METRICS: tuple[tuple[str, str, float], ...] = (
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "NVML_GPM_METRIC_GRAPHICS_UTIL", 0.01),
    ("DCGM_FI_PROF_SM_ACTIVE", "NVML_GPM_METRIC_SM_UTIL", 0.01),
    ("DCGM_FI_PROF_SM_OCCUPANCY", "NVML_GPM_METRIC_SM_OCCUPANCY", 0.01),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "NVML_GPM_METRIC_ANY_TENSOR_UTIL", 0.01),
    ("DCGM_FI_PROF_DRAM_ACTIVE", "NVML_GPM_METRIC_DRAM_BW_UTIL", 0.01),
    ("DCGM_FI_PROF_PIPE_FP64_ACTIVE", "NVML_GPM_METRIC_FP64_UTIL", 0.01),
    ("DCGM_FI_PROF_PIPE_FP32_ACTIVE", "NVML_GPM_METRIC_FP32_UTIL", 0.01),
    ("DCGM_FI_PROF_PIPE_FP16_ACTIVE", "NVML_GPM_METRIC_FP16_UTIL", 0.01),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", "NVML_GPM_METRIC_PCIE_TX_PER_SEC", float(_MIB)),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", "NVML_GPM_METRIC_PCIE_RX_PER_SEC", float(_MIB)),
)
# The GPM sample key of the whole GPU (MIG GPU instances use their GI id).
_WHOLE_GPU = -1


class _NotSupported(Exception):
    """NVML answered, but says the feature is absent (e.g. GPM ``isSupportedDevice`` 0)."""


@dataclass(frozen=True)
class MigReading:
    """One MIG GPU instance: ``device`` is its first MIG device (compute instance), None for
    a GPU instance without one (no framebuffer reading then, as in dcgm-exporter)."""

    gi_id: int
    profile: str
    values: Mapping[str, Value]
    device: MigDevice | None = None


@dataclass(frozen=True)
class GpuReading:
    """One round of one GPU. ``error`` says why nothing could be read (``lost`` for
    ``GPU_IS_LOST``); a reading with some fields missing has no error."""

    values: Mapping[str, Value] = field(default_factory=dict)
    mig: tuple[MigReading, ...] = ()
    """The GPU instances of a MIG-enabled GPU (empty while it has none)."""
    mig_mode: bool = False
    error: str | None = None
    lost: bool = False


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GpuTelemetry:
    """Reads one GPU (and its MIG GPU instances) per :meth:`read`; see the module docstring."""

    def __init__(self, session: NvmlSession, static: GpuStatic,
                 profiles: tuple[GiProfile, ...] = ()) -> None:
        self._session = session
        self._nvml = session.nvml
        self._static = static
        self._uuid = static.uuid
        self._profiles = profiles
        self._unsupported: set[str] = set()
        self._mig_mode: bool | None = None
        # Field ids of nvmlDeviceGetFieldValues still worth asking for.
        self._field_ids = [(name, int(getattr(self._nvml, const)))
                           for name, const in FIELD_VALUE_IDS if hasattr(self._nvml, const)]
        self._nvlink: tuple[int, float] | None = None
        self._nvlink_supported = True
        self._gpm: dict[int, Any] = {}
        self._gpm_support: bool | None = None
        self._gpm_request: Any = None
        self._memory_v1 = False
        self._gpm_ids = [(name, int(getattr(self._nvml, const)), scale)
                         for name, const, scale in GPM_METRICS if hasattr(self._nvml, const)]
        # GPU instances as last walked -> their MIG device (the first compute instance).
        self._gi_key: tuple[tuple[int, int], ...] | None = None
        self._gi_devices: dict[int, MigDevice] = {}

    # -- one round -------------------------------------------------------------------------

    def read(self) -> GpuReading:
        """Every supported field of the GPU, and of its GPU instances when MIG is on."""
        if self._static.minor < 0:
            return GpuReading(error="GPU is lost (no NVML handle since start-up)", lost=True)
        try:
            handle = self._call("nvmlDeviceGetHandleByUUID", self._uuid)
            mig_mode = self._read_mig_mode(handle)
            values: Values = {}
            for name, reader in self._gpu_readers():
                self._try(name, partial(reader, handle), values)
            migs = self._read_migs(handle) if mig_mode else ()
        except GpuLost as err:
            return GpuReading(error=err.detail, lost=True)
        except NvmlError as err:
            return GpuReading(error=err.detail)
        if migs is None:
            # Not "no instances": serving the whole GPU for a round would swap its series.
            return GpuReading(error="its MIG GPU instances could not be listed this round",
                              mig_mode=True)
        return GpuReading(values=values, mig=migs, mig_mode=mig_mode)

    def close(self) -> None:
        """Free the GPM samples still held (NVML allocates them)."""
        for key in list(self._gpm):
            self._free_gpm(key)

    # -- machinery -------------------------------------------------------------------------

    def _call(self, function: str, *args: Any) -> Any:
        return self._session.call(function, *args, gpu=self._uuid)

    def _try(self, name: str, read: Callable[[], Values], into: Values) -> None:
        """Run one reader into ``into``; remember ``name`` as unsupported if NVML says so."""
        if name in self._unsupported:
            return
        try:
            into.update(read())
        except GpuLost:
            raise
        except NvmlError as err:
            if err.name in UNSUPPORTED:
                self._unsupported.add(name)
                log.debug("field unsupported", extra={"gpu": self._uuid, "reader": name,
                                                      "error": err.name})
        except _NotSupported:
            self._unsupported.add(name)

    def _read_mig_mode(self, handle: Any) -> bool:
        mode = False
        if self._static.mig_capable:
            current, _ = self._call("nvmlDeviceGetMigMode", handle)
            mode = bool(current)
        if mode != self._mig_mode:
            if self._mig_mode is not None:
                # Utilisation and the MIG fields change support with the mode: ask again.
                self._unsupported.clear()
                self.close()
                self._gi_key = None
            self._mig_mode = mode
        return mode

    def _gpu_readers(self) -> list[tuple[str, Callable[[Any], Values]]]:
        return [
            ("sm_clock", self._sm_clock), ("mem_clock", self._mem_clock),
            ("clock_events", self._clock_events), ("gpu_temp", self._gpu_temp),
            ("power", self._power), ("energy", self._energy),
            ("pcie_replay", self._pcie_replay), ("pcie_tx", self._pcie_tx),
            ("pcie_rx", self._pcie_rx), ("utilization", self._utilization),
            ("encoder", self._encoder), ("decoder", self._decoder),
            ("memory", self._memory), ("vgpu_license", self._vgpu_license),
            ("field_values", self._field_values), ("gpm", self._gpm_gpu),
        ]

    # -- whole-GPU readers -----------------------------------------------------------------

    def _sm_clock(self, handle: Any) -> Values:
        return {"DCGM_FI_DEV_SM_CLOCK":
                int(self._call("nvmlDeviceGetClockInfo", handle, self._nvml.NVML_CLOCK_SM))}

    def _mem_clock(self, handle: Any) -> Values:
        return {"DCGM_FI_DEV_MEM_CLOCK":
                int(self._call("nvmlDeviceGetClockInfo", handle, self._nvml.NVML_CLOCK_MEM))}

    def _clock_events(self, handle: Any) -> Values:
        return {"DCGM_FI_DEV_CLOCKS_EVENT_REASONS":
                int(self._call("nvmlDeviceGetCurrentClocksEventReasons", handle))}

    def _gpu_temp(self, handle: Any) -> Values:
        temp = int(self._call("nvmlDeviceGetTemperature", handle,
                              self._nvml.NVML_TEMPERATURE_GPU))
        return {"DCGM_FI_DEV_GPU_TEMP": temp} if temp <= _MAX_TEMP_C else {}

    def _power(self, handle: Any) -> Values:
        return {"DCGM_FI_DEV_POWER_USAGE": int(self._call("nvmlDeviceGetPowerUsage", handle))
                / 1000.0}

    def _energy(self, handle: Any) -> Values:
        return {"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION":
                int(self._call("nvmlDeviceGetTotalEnergyConsumption", handle))}

    def _pcie_replay(self, handle: Any) -> Values:
        return {"DCGM_FI_DEV_PCIE_REPLAY_COUNTER":
                int(self._call("nvmlDeviceGetPcieReplayCounter", handle))}

    def _pcie_tx(self, handle: Any) -> Values:
        return {"DCGM_FI_DEV_PCIE_TX_THROUGHPUT": int(self._call(
            "nvmlDeviceGetPcieThroughput", handle, self._nvml.NVML_PCIE_UTIL_TX_BYTES))}

    def _pcie_rx(self, handle: Any) -> Values:
        return {"DCGM_FI_DEV_PCIE_RX_THROUGHPUT": int(self._call(
            "nvmlDeviceGetPcieThroughput", handle, self._nvml.NVML_PCIE_UTIL_RX_BYTES))}

    def _utilization(self, handle: Any) -> Values:
        rates = self._call("nvmlDeviceGetUtilizationRates", handle)
        return {"DCGM_FI_DEV_GPU_UTIL": int(rates.gpu),
                "DCGM_FI_DEV_MEM_COPY_UTIL": int(rates.memory)}

    def _encoder(self, handle: Any) -> Values:
        util, _period = self._call("nvmlDeviceGetEncoderUtilization", handle)
        return {"DCGM_FI_DEV_ENC_UTIL": int(util)}

    def _decoder(self, handle: Any) -> Values:
        util, _period = self._call("nvmlDeviceGetDecoderUtilization", handle)
        return {"DCGM_FI_DEV_DEC_UTIL": int(util)}

    def _memory(self, handle: Any) -> Values:
        """Framebuffer in MiB from nvmlMemory_v2; on a MIG device handle, the GPU instance's
        memory. Drivers before 510 lack v2: then v1, which has no ``reserved``."""
        if not self._memory_v1:
            try:
                memory = self._call("nvmlDeviceGetMemoryInfo", handle, self._nvml.nvmlMemory_v2)
            except NvmlError as err:
                if err.name not in UNSUPPORTED:
                    raise
                self._memory_v1 = True
            else:
                return {"DCGM_FI_DEV_FB_FREE": int(memory.free) // _MIB,
                        "DCGM_FI_DEV_FB_USED": int(memory.used) // _MIB,
                        "DCGM_FI_DEV_FB_RESERVED": int(memory.reserved) // _MIB}
        memory = self._call("nvmlDeviceGetMemoryInfo", handle)
        return {"DCGM_FI_DEV_FB_FREE": int(memory.free) // _MIB,
                "DCGM_FI_DEV_FB_USED": int(memory.used) // _MIB}

    def _vgpu_license(self, handle: Any) -> Values:
        """The first licensable feature's state; 0 where the board offers no vGPU licensing
        (bare metal), which is what DCGM reports there."""
        features = self._call("nvmlDeviceGetGridLicensableFeatures", handle)
        if not int(features.isGridLicenseSupported) or not int(features.licensableFeaturesCount):
            return {"DCGM_FI_DEV_VGPU_LICENSE_STATUS": 0}
        return {"DCGM_FI_DEV_VGPU_LICENSE_STATUS":
                int(features.gridLicensableFeatures[0].featureState)}

    def _field_values(self, handle: Any) -> Values:
        """One nvmlDeviceGetFieldValues for every field-id row; a field whose own status says
        unsupported is dropped from later rounds."""
        nvml = self._nvml
        ids: list[Any] = [fid for _, fid in self._field_ids]
        nvlink = self._nvlink_supported and hasattr(nvml, _NVLINK_RX)
        if nvlink:
            ids += [(int(getattr(nvml, _NVLINK_RX)), _ALL_LINKS),
                    (int(getattr(nvml, _NVLINK_TX)), _ALL_LINKS)]
        if not ids:
            raise _NotSupported
        found = self._call("nvmlDeviceGetFieldValues", handle, ids)
        values: Values = {}
        keep = []
        for (name, fid), fv in zip(self._field_ids, found, strict=False):
            status = int(fv.nvmlReturn)
            if status == nvml.NVML_SUCCESS:
                # MEMORY_TEMP is read as uiVal whatever valueType says (r545 reports a double
                # type for an integer value).
                values[name] = (int(fv.value.uiVal) if name == "DCGM_FI_DEV_MEMORY_TEMP"
                                else field_value(nvml, fv))
            if status not in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_NO_PERMISSION):
                keep.append((name, fid))
        self._field_ids = keep
        if nvlink:
            rx, tx = found[len(found) - 2], found[len(found) - 1]
            if int(rx.nvmlReturn) == int(tx.nvmlReturn) == nvml.NVML_SUCCESS:
                values.update(self._nvlink_rate(field_value(nvml, rx) + field_value(nvml, tx)))
            elif int(rx.nvmlReturn) == nvml.NVML_ERROR_NOT_SUPPORTED:
                self._nvlink_supported = False
        return values

    def _nvlink_rate(self, total_kib: Value) -> Values:
        """DCGM's NVLINK_BANDWIDTH_TOTAL: the byte counters' growth per second, divided by
        1000 (about MB/s); nothing until there are two readings."""
        now = time.monotonic()
        previous, self._nvlink = self._nvlink, (int(total_kib), now)
        if previous is None or now <= previous[1] or total_kib < previous[0]:
            return {}
        return {NVLINK_BANDWIDTH: (int(total_kib) - previous[0]) / (now - previous[1]) / 1000}

    # -- GPM (Hopper and later) ------------------------------------------------------------

    def _gpm_supported(self, handle: Any) -> bool:
        """Whether the GPU has GPM (Hopper and later), asked once. Kept apart from the
        whole-GPU sample, which may be refused in MIG mode while per-instance samples work."""
        if self._gpm_support is None:
            try:
                support = self._call("nvmlGpmQueryDeviceSupport", handle)
            except GpuLost:
                raise
            except NvmlError as err:
                if err.name in UNSUPPORTED:
                    self._gpm_support = False
                return False
            self._gpm_support = bool(int(support.isSupportedDevice))
        return self._gpm_support

    def _gpm_gpu(self, handle: Any) -> Values:
        if not self._gpm_supported(handle):
            return {}
        return self._gpm_round(_WHOLE_GPU, lambda s: self._call("nvmlGpmSampleGet", handle, s))

    def _gpm_mig(self, handle: Any, gi_id: int) -> Values:
        return self._gpm_round(gi_id, lambda s: self._call("nvmlGpmMigSampleGet", handle,
                                                             gi_id, s))

    def _gpm_round(self, key: int, take: Callable[[Any], Any]) -> Values:
        """Take a sample; with the previous one, the metrics over the interval between them.
        The first round of a device has no values (never a made-up one)."""
        sample = self._call("nvmlGpmSampleAlloc")
        try:
            take(sample)
        except BaseException:
            self._call("nvmlGpmSampleFree", sample)
            raise
        previous, self._gpm[key] = self._gpm.get(key), sample
        if previous is None:
            return {}
        try:
            return self._gpm_metrics(previous, sample)
        finally:
            self._call("nvmlGpmSampleFree", previous)

    def _gpm_metrics(self, first: Any, second: Any) -> Values:
        nvml = self._nvml
        request = self._gpm_request
        if request is None:
            # Built once: the struct holds room for every GPM metric NVML has (~23 KB), and
            # only the two samples change between calls (NVML overwrites the results).
            request = self._gpm_request = nvml.c_nvmlGpmMetricsGet_t()
            request.version = nvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = len(self._gpm_ids)
            entries = request.metrics
            for i, (_, metric, _) in enumerate(self._gpm_ids):
                entries[i].metricId = metric
        request.sample1, request.sample2 = first, second
        result = self._call("nvmlGpmMetricsGet", request)
        values: Values = {}
        entries = result.metrics
        for i, (name, _, scale) in enumerate(self._gpm_ids):
            metric = entries[i]
            if int(metric.nvmlReturn) == nvml.NVML_SUCCESS:
                values[name] = float(metric.value) * scale
        return values

    def _free_gpm(self, key: int) -> None:
        sample = self._gpm.pop(key, None)
        if sample is not None:
            # A failure is counted by the session; there is nothing else to do with it.
            with contextlib.suppress(NvmlError):
                self._call("nvmlGpmSampleFree", sample)

    # -- MIG GPU instances -----------------------------------------------------------------

    def _gpu_instances(self, handle: Any) -> tuple[tuple[int, int], ...]:
        """(GI id, profile id) of every GPU instance: one count call per profile, no errors
        for the empty ones (unlike walking MIG device indices)."""
        if not self._profiles:
            self._profiles = read_gi_profiles(self._session, handle, self._static)
        found = []
        for profile in self._profiles:
            capacity = max(profile.max_instances, 1)
            array = (self._nvml.c_nvmlGpuInstance_t * capacity)()
            count = ctypes.c_uint(capacity)
            self._call("nvmlDeviceGetGpuInstances", handle, profile.id, array,
                       ctypes.byref(count))
            for gi in array[: count.value]:
                found.append((int(self._call("nvmlGpuInstanceGetInfo", gi).id), profile.id))
        return tuple(sorted(found))

    def _read_migs(self, handle: Any) -> tuple[MigReading, ...] | None:
        """Each GPU instance's readings; None when they could not be listed."""
        try:
            key = self._gpu_instances(handle)
            # Walked again when the instances change, and while one has no compute instance
            # yet (it may get one without the instances changing).
            if key != self._gi_key or any(gi not in self._gi_devices for gi, _ in key):
                devices = read_mig_devices(self._session, handle, self._uuid, self._profiles)
                self._gi_devices = {}
                for device in devices:
                    self._gi_devices.setdefault(device.gi_id, device)
            if key != self._gi_key:
                # A GPU instance re-created under the same id has new counters: after any
                # change no instance compares a sample with one from before it.
                for gone in set(self._gpm) - {_WHOLE_GPU}:
                    self._free_gpm(gone)
                self._gi_key = key
        except GpuLost:
            raise
        except NvmlError:
            self._gi_key = None  # walk again next round
            return None
        names = {p.id: p.name for p in self._profiles}
        readings = []
        for gi_id, profile_id in key:
            values: Values = {}
            first = self._gi_devices.get(gi_id)
            if first is not None:
                try:
                    mig = self._call("nvmlDeviceGetHandleByUUID", first.uuid)
                except GpuLost:
                    raise
                except NvmlError:
                    self._gi_key = None  # changed under us: walk again next round
                    continue
                # Framebuffer through the MIG device handle (the GPU instance's memory).
                self._try("mig_memory", partial(self._memory, mig), values)
            if self._gpm_supported(handle):
                self._try("mig_gpm", partial(self._gpm_mig, handle, gi_id), values)
            readings.append(MigReading(
                gi_id=gi_id, profile=names.get(profile_id, f"profile-{profile_id}"),
                values=values, device=first))
        return tuple(readings)


_VALUE_MEMBERS = {"NVML_VALUE_TYPE_UNSIGNED_INT": "uiVal",
                  "NVML_VALUE_TYPE_UNSIGNED_LONG": "ulVal",
                  "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": "ullVal",
                  "NVML_VALUE_TYPE_SIGNED_LONG_LONG": "sllVal",
                  "NVML_VALUE_TYPE_SIGNED_INT": "siVal",
                  "NVML_VALUE_TYPE_UNSIGNED_SHORT": "usVal"}


def field_value(nvml: Any, fv: Any) -> Value:
    """The member of an nvmlFieldValue_t union that its ``valueType`` names."""
    kind = int(fv.valueType)
    if kind == int(nvml.NVML_VALUE_TYPE_DOUBLE):
        return float(fv.value.dVal)
    for constant, member in _VALUE_MEMBERS.items():
        if kind == int(getattr(nvml, constant)):
            return int(getattr(fv.value, member))
    return int(fv.value.ullVal)
