"""The DCGM field table is dcgm-exporter's: names, types and help texts of its default
counters (reference A1), and every value the NVML layer produces has a family."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import agent.gpu.telemetry
from agent.metrics.exposition import DeviceSeries, render
from agent.metrics.fields import BY_NAME, FIELDS, MIG_FIELDS, Kind, Scope

# dcgm-exporter's enabled rows (etc/default-counters.csv), as the reference lists them.
DEFAULT_ROWS = [
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter",
     "Total energy consumption since boot (in mJ)."),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %)."),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB)."),
    ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter",
     "Total number of NVLink bandwidth counters for all lanes."),
    ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge", "vGPU License status"),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
     "Number of remapped rows for uncorrectable errors"),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter",
     "Number of remapped rows for correctable errors"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed"),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active."),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge",
     "Ratio of cycles the tensor (HMMA) pipe is active."),
    ("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
     "Ratio of cycles the device memory interface is active sending or receiving data."),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge",
     "The rate of data transmitted over the PCIe bus - including both protocol headers and "
     "data payloads - in bytes per second."),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge",
     "The rate of data received over the PCIe bus - including both protocol headers and data "
     "payloads - in bytes per second."),
]


@pytest.mark.parametrize(("name", "kind", "help_text"), DEFAULT_ROWS)
def test_default_rows_have_dcgm_exporters_type_and_help(name: str, kind: str,
                                                        help_text: str) -> None:
    """Each default row is served under its exact name, type and help text."""
    field = BY_NAME[name]
    assert (field.kind.value, field.help, field.default) == (kind, help_text, True)


def test_only_the_default_rows_are_marked_default() -> None:
    """Extras (ECC, NVLink errors, violations, ...) are not passed off as defaults."""
    assert {f.name for f in FIELDS if f.default} == {row[0] for row in DEFAULT_ROWS}


def test_names_are_unique_dcgm_names() -> None:
    names = [f.name for f in FIELDS]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"DCGM_FI_(DEV|PROF)_[A-Z0-9_]+", n) for n in names)


def test_counters_keep_their_names_without_total() -> None:
    """dcgm-exporter's counters have no _total suffix; the renderer adds none."""
    counters = [f for f in FIELDS if f.kind is Kind.COUNTER]
    text = render([DeviceSeries('gpu="0"', {f.name: 1 for f in counters})]).decode()
    for field in counters:
        assert f"# TYPE {field.name} counter\n{field.name}{{gpu=\"0\"}} 1\n" in text
    assert "_total{" not in text.replace("_COUNT_TOTAL{", "")


def test_every_field_the_nvml_layer_reads_has_a_family() -> None:
    """Any DCGM name agent/gpu/telemetry.py can produce is in the table (no unknown family)."""
    source = Path(agent.gpu.telemetry.__file__).read_text()
    produced = set(re.findall(r'"(DCGM_FI_[A-Z0-9_]+)"', source))
    assert produced
    assert produced <= set(BY_NAME)


def test_mig_scoped_fields_are_memory_and_profiling() -> None:
    """Per GPU instance: framebuffer and GPM ratios, read on the instance; every other field
    is the whole GPU's, repeated on its instances (what dcgm-exporter shows there)."""
    mig = {f.name for f in FIELDS if f.scope is Scope.MIG}
    assert {"DCGM_FI_DEV_FB_USED", "DCGM_FI_PROF_GR_ENGINE_ACTIVE"} <= mig
    assert all(n.startswith(("DCGM_FI_DEV_FB_", "DCGM_FI_PROF_")) for n in mig)
    assert mig == MIG_FIELDS
    assert {f.scope for f in FIELDS if f.name not in mig} == {Scope.GPU}


def test_the_counter_list_in_tests_data_is_the_field_tables_defaults() -> None:
    """tests/data/metrics/default-counters.csv (the scrape test's list) and this table agree."""
    path = Path(__file__).resolve().parents[1] / "data" / "metrics" / "default-counters.csv"
    rows = [line.split(",")[0] for line in path.read_text().splitlines()
            if line and not line.startswith(("#", "field,"))]
    assert {r for r in rows if r != "DCGM_FI_DRIVER_VERSION"} == {r[0] for r in DEFAULT_ROWS}
