"""The DCGM field table: the metric families the agent serves under dcgm-exporter's names.

Names, Prometheus types, help texts and units are dcgm-exporter's (``etc/default-counters.csv``
and its commented-out rows; ``reference/dcgm-exporter-and-cdi.md`` A1), so dashboards and
alerts written against dcgm-exporter work unchanged. The table order is the order of the
families in ``/metrics``. Which NVML call supplies each field is in ``agent/gpu/telemetry.py``.

dcgm-exporter counters have no ``_total`` suffix (``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION``);
they are rendered by :mod:`agent.metrics.exposition`, not by prometheus-client, which would
append one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    GAUGE = "gauge"
    COUNTER = "counter"


class Scope(StrEnum):
    """Where a field is read: on the whole GPU, or per MIG GPU instance.

    A GPU with GPU instances is served as its instances only (dcgm-exporter's default
    mode); each instance series repeats the whole-GPU readings (DCGM takes them from the
    parent GPU) next to its own MIG-scoped ones."""

    #: Read on the whole GPU; repeated on each GPU instance of a MIG GPU.
    GPU = "gpu"
    #: Read per GPU instance (memory, GPM profiling); the whole GPU's never repeats.
    MIG = "mig"


@dataclass(frozen=True)
class Field:
    name: str
    kind: Kind
    help: str
    scope: Scope = Scope.GPU
    #: In dcgm-exporter's default counter list (enabled rows), as opposed to a commonly
    #: enabled extra.
    default: bool = True


G, C = Kind.GAUGE, Kind.COUNTER

FIELDS: tuple[Field, ...] = (
    # Clocks
    Field("DCGM_FI_DEV_SM_CLOCK", G, "SM clock frequency (in MHz)."),
    Field("DCGM_FI_DEV_MEM_CLOCK", G, "Memory clock frequency (in MHz)."),
    Field("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", G,
          "Current clock event reasons (bitmask of DCGM_CLOCKS_EVENT_REASON_*).", default=False),
    # Temperature
    Field("DCGM_FI_DEV_MEMORY_TEMP", G, "Memory temperature (in C)."),
    Field("DCGM_FI_DEV_GPU_TEMP", G, "GPU temperature (in C)."),
    # Power
    Field("DCGM_FI_DEV_POWER_USAGE", G, "Power draw (in W)."),
    Field("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", C,
          "Total energy consumption since boot (in mJ)."),
    # PCIe
    Field("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", C, "Total number of PCIe retries."),
    # dcgm-exporter's type and help; the value is NVML's throughput sample (KB/s over 20 ms),
    # as DCGM serves it.
    Field("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", C,
          "Total number of bytes transmitted through PCIe TX (in KB) via NVML.", default=False),
    Field("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", C,
          "Total number of bytes received through PCIe RX (in KB) via NVML.", default=False),
    # Utilization (NVML has none for MIG devices; use the DCGM_FI_PROF_* ratios there)
    Field("DCGM_FI_DEV_GPU_UTIL", G, "GPU utilization (in %)."),
    Field("DCGM_FI_DEV_MEM_COPY_UTIL", G, "Memory utilization (in %)."),
    Field("DCGM_FI_DEV_ENC_UTIL", G, "Encoder utilization (in %)."),
    Field("DCGM_FI_DEV_DEC_UTIL", G, "Decoder utilization (in %)."),
    # Errors and violations
    Field("DCGM_FI_DEV_XID_ERRORS", G, "Value of the last XID error encountered."),
    Field("DCGM_FI_DEV_POWER_VIOLATION", C,
          "Throttling duration due to power constraints (in us).", default=False),
    Field("DCGM_FI_DEV_THERMAL_VIOLATION", C,
          "Throttling duration due to thermal constraints (in us).", default=False),
    Field("DCGM_FI_DEV_SYNC_BOOST_VIOLATION", C,
          "Throttling duration due to sync-boost constraints (in us).", default=False),
    Field("DCGM_FI_DEV_BOARD_LIMIT_VIOLATION", C,
          "Throttling duration due to board limit constraints (in us).", default=False),
    Field("DCGM_FI_DEV_LOW_UTIL_VIOLATION", C,
          "Throttling duration due to low utilization (in us).", default=False),
    Field("DCGM_FI_DEV_RELIABILITY_VIOLATION", C,
          "Throttling duration due to reliability constraints (in us).", default=False),
    # Memory usage
    Field("DCGM_FI_DEV_FB_FREE", G, "Framebuffer memory free (in MiB).", Scope.MIG),
    Field("DCGM_FI_DEV_FB_USED", G, "Framebuffer memory used (in MiB).", Scope.MIG),
    Field("DCGM_FI_DEV_FB_RESERVED", G, "Framebuffer memory reserved (in MiB).", Scope.MIG),
    # ECC
    Field("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", C,
          "Total number of single-bit volatile ECC errors.", default=False),
    Field("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", C,
          "Total number of double-bit volatile ECC errors.", default=False),
    Field("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", C,
          "Total number of single-bit persistent ECC errors.", default=False),
    Field("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", C,
          "Total number of double-bit persistent ECC errors.", default=False),
    # Retired pages
    Field("DCGM_FI_DEV_RETIRED_SBE", C,
          "Total number of retired pages due to single-bit errors.", default=False),
    Field("DCGM_FI_DEV_RETIRED_DBE", C,
          "Total number of retired pages due to double-bit errors.", default=False),
    Field("DCGM_FI_DEV_RETIRED_PENDING", C,
          "Total number of pages pending retirement.", default=False),
    # NVLink
    Field("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", C,
          "Total number of NVLink flow-control CRC errors.", default=False),
    Field("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", C,
          "Total number of NVLink data CRC errors.", default=False),
    Field("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", C,
          "Total number of NVLink retries.", default=False),
    Field("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", C,
          "Total number of NVLink recovery errors.", default=False),
    # Declared a counter by dcgm-exporter although DCGM stores a rate (about MB/s); kept so.
    Field("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", C,
          "Total number of NVLink bandwidth counters for all lanes."),
    # vGPU license status
    Field("DCGM_FI_DEV_VGPU_LICENSE_STATUS", G, "vGPU License status"),
    # Remapped rows
    Field("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", C,
          "Number of remapped rows for uncorrectable errors"),
    Field("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", C,
          "Number of remapped rows for correctable errors"),
    Field("DCGM_FI_DEV_ROW_REMAP_FAILURE", G, "Whether remapping of rows has failed"),
    # Profiling, from NVML GPM (Hopper and later; per MIG GPU instance too)
    Field("DCGM_FI_PROF_GR_ENGINE_ACTIVE", G, "Ratio of time the graphics engine is active.",
          Scope.MIG),
    Field("DCGM_FI_PROF_SM_ACTIVE", G,
          "The ratio of cycles an SM has at least 1 warp assigned.", Scope.MIG, default=False),
    Field("DCGM_FI_PROF_SM_OCCUPANCY", G,
          "The ratio of number of warps resident on an SM.", Scope.MIG, default=False),
    Field("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", G,
          "Ratio of cycles the tensor (HMMA) pipe is active.", Scope.MIG),
    Field("DCGM_FI_PROF_DRAM_ACTIVE", G,
          "Ratio of cycles the device memory interface is active sending or receiving data.",
          Scope.MIG),
    Field("DCGM_FI_PROF_PIPE_FP64_ACTIVE", G, "Ratio of cycles the fp64 pipes are active.",
          Scope.MIG, default=False),
    Field("DCGM_FI_PROF_PIPE_FP32_ACTIVE", G, "Ratio of cycles the fp32 pipes are active.",
          Scope.MIG, default=False),
    Field("DCGM_FI_PROF_PIPE_FP16_ACTIVE", G, "Ratio of cycles the fp16 pipes are active.",
          Scope.MIG, default=False),
    Field("DCGM_FI_PROF_PCIE_TX_BYTES", G,
          "The rate of data transmitted over the PCIe bus - including both protocol headers and "
          "data payloads - in bytes per second.", Scope.MIG),
    Field("DCGM_FI_PROF_PCIE_RX_BYTES", G,
          "The rate of data received over the PCIe bus - including both protocol headers and "
          "data payloads - in bytes per second.", Scope.MIG),
)

BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}

#: The label-typed row of the default list: the driver version, on every series.
DRIVER_VERSION_LABEL = "DCGM_FI_DRIVER_VERSION"
XID_FIELD = "DCGM_FI_DEV_XID_ERRORS"

#: Fields read per MIG GPU instance: on an instance series, never the whole GPU's value.
MIG_FIELDS: frozenset[str] = frozenset(f.name for f in FIELDS if f.scope is Scope.MIG)
