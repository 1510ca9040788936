"""Every field of dcgm-exporter's default counter list (``tests/data/metrics/
default-counters.csv``: name, type, help, labels) is served by a real agent on a simulated
HGX H200 under load, with values that follow the simulated hardware; a MIG-split GPU is
served as its GPU instances only, each repeating its GPU's readings."""

from __future__ import annotations

import csv
import json
import signal
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.metrics.test_agent_metrics import split_gpu, wait_for
from tests.metrics.textformat import Exposition, Sample, parse

COUNTERS = Path(__file__).resolve().parents[1] / "data" / "metrics" / "default-counters.csv"
MIG_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "GPU_I_PROFILE", "GPU_I_ID",
              "Hostname", "DCGM_FI_DRIVER_VERSION")
SPLIT = 7  # the GPU split into instances; GPUs 0-6 stay whole
BUSY, IDLE, REMAPPED = "0", "3", "2"
BUSY_PID = 300  # 64 % of the SMs, and it decodes video (agent/gpu/sim/telemetry.py)


@dataclass(frozen=True)
class Row:
    field: str
    type: str
    help: str
    labels: tuple[str, ...]


def rows() -> list[Row]:
    with COUNTERS.open() as handle:
        lines = [line for line in handle if not line.startswith("#")]
    return [Row(r["field"], r["type"], r["help"], tuple(r["labels"].split()))
            for r in csv.DictReader(lines)]


METRICS = [r for r in rows() if r.type != "label"]
LABELS = [r for r in rows() if r.type == "label"]


@dataclass(frozen=True)
class Scrape:
    out: Exposition
    split_uuid: str

    def whole(self, field: str) -> dict[str, Sample]:
        """The whole-GPU series of a field, by ``gpu``."""
        return {s.labels["gpu"]: s for s in self.out.named(field) if "GPU_I_ID" not in s.labels}

    def instances(self, field: str) -> list[Sample]:
        return [s for s in self.out.named(field) if "GPU_I_ID" in s.labels]


def _metrics(agent: AgentProcess) -> Exposition:
    url = str(json.loads((agent.state_dir / "listeners.json").read_text())["metrics"][0])
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        return parse(reply.read().decode())


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scrape]:
    """One process on GPU 0, XID 63 (a remapped row) on GPU 2, GPU 7 split 3g+2g+1g with a
    process on its 3g instance; scraped once GPM has two samples of the load."""
    agent = start_agent(tmp_path_factory.mktemp("counters") / "state", preset="hgx-h200",
                        extra=["--metrics-listen", "127.0.0.1:0", "--collect-interval", "0.3",
                               "--node-name", "node-a"])
    try:
        gpus = {g["index"]: g for g in agent.request("GET", "/v1/gpus").body["gpus"]}
        assert agent.request("POST", "/v1/sim/processes", {
            "device": gpus[int(BUSY)]["uuid"], "pid": BUSY_PID}).status == 201
        assert agent.request("POST", "/v1/sim/xid", {"gpu": gpus[int(REMAPPED)]["uuid"],
                                                     "xid": 63}).status == 202
        split_gpu(agent, SPLIT, ["3g.71gb", "2g.35gb", "1g.18gb"])
        devices = agent.request("GET", f"/v1/gpus/{SPLIT}").body["mig_devices"]
        big = next(d for d in devices if d["profile"] == "3g.71gb")
        assert agent.request("POST", "/v1/sim/processes", {"device": big["uuid"],
                                                           "pid": 301}).status == 201

        def ready() -> Exposition | None:
            # Both GPM samples taken after the processes started: the full utilisation of
            # the busy GPU (64 %) and of the 3g instance (pid 301: 71 %).
            out = _metrics(agent)
            engine = {(s.labels["gpu"], s.labels.get("GPU_I_PROFILE")): s.value
                      for s in out.named("DCGM_FI_PROF_GR_ENGINE_ACTIVE")}
            settled = (abs(engine.get((BUSY, None), 0) - 0.64) < 1e-6
                       and abs(engine.get((str(SPLIT), "3g.71gb"), 0) - 0.71) < 1e-6)
            return out if settled else None

        out = wait_for(ready, "GPM values of the busy GPU and the busy instance")
        yield Scrape(out, gpus[SPLIT]["uuid"])
    finally:
        agent.stop(signal.SIGKILL)


@pytest.mark.parametrize("row", METRICS, ids=[r.field for r in METRICS])
def test_each_default_field_is_served_as_dcgm_exporter_lists_it(scrape: Scrape,
                                                               row: Row) -> None:
    """Name, type, help text and label names in order, on every whole GPU of the node."""
    assert scrape.out.types.get(row.field) == row.type
    assert scrape.out.help.get(row.field) == row.help
    whole = scrape.whole(row.field)
    assert set(whole) == {str(i) for i in range(SPLIT)}
    for sample in whole.values():
        assert sample.label_order == row.labels, sample


@pytest.mark.parametrize("row", LABELS, ids=[r.field for r in LABELS])
def test_label_rows_label_every_series(scrape: Scrape, row: Row) -> None:
    """A ``label`` row adds a label to every DCGM series (the driver version), no metric."""
    dcgm = [s for s in scrape.out.samples if s.name.startswith("DCGM_")]
    assert dcgm and all(s.labels.get(row.field) for s in dcgm)
    assert row.field not in scrape.out.names()


# (field, test on the busy GPU's value, test on the idle GPU's value)
FOLLOWS_LOAD = [
    ("DCGM_FI_DEV_GPU_UTIL", lambda v: v == 64, lambda v: v == 0),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", lambda v: 0 < v < 64, lambda v: v == 0),
    ("DCGM_FI_DEV_POWER_USAGE", lambda v: v > 400, lambda v: 0 < v < 100),
    ("DCGM_FI_DEV_GPU_TEMP", lambda v: v > 50, lambda v: 0 < v < 40),
    ("DCGM_FI_DEV_MEMORY_TEMP", lambda v: v > 55, lambda v: 0 < v < 40),
    ("DCGM_FI_DEV_SM_CLOCK", lambda v: v == 1980, lambda v: v == 345),
    ("DCGM_FI_DEV_DEC_UTIL", lambda v: v > 0, lambda v: v == 0),
    ("DCGM_FI_DEV_ENC_UTIL", lambda v: v == 0, lambda v: v == 0),  # H200: no NVENC
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", lambda v: 0.6 < v < 0.7, lambda v: v == 0),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", lambda v: 0 < v < 0.64, lambda v: v == 0),
    ("DCGM_FI_PROF_DRAM_ACTIVE", lambda v: 0 < v < 0.64, lambda v: v == 0),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", lambda v: v > 2**20, lambda v: v == 0),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", lambda v: v > 2**20, lambda v: v == 0),
    ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", lambda v: v > 1000, lambda v: v == 0),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", lambda v: v == 0, lambda v: v == 0),
    ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", lambda v: v == 0, lambda v: v == 0),  # bare metal
]


@pytest.mark.parametrize(("field", "busy", "idle"), FOLLOWS_LOAD,
                         ids=[f for f, _, _ in FOLLOWS_LOAD])
def test_values_follow_the_simulated_load(scrape: Scrape, field: str,
                                          busy: Callable[[float], bool],
                                          idle: Callable[[float], bool]) -> None:
    """The busy GPU reads as busy and the idle one as idle, in DCGM's units."""
    whole = scrape.whole(field)
    assert busy(whole[BUSY].value), whole[BUSY]
    assert idle(whole[IDLE].value), whole[IDLE]


def test_row_remapping_counts_what_the_driver_reported(scrape: Scrape) -> None:
    """XID 63 recorded one remapped row for an uncorrectable error on that GPU only."""
    unc = scrape.whole("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS")
    assert {gpu: s.value for gpu, s in unc.items() if s.value} == {REMAPPED: 1}
    assert {s.value for s in scrape.whole("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS").values()} \
        == {0}
    assert {s.value for s in scrape.whole("DCGM_FI_DEV_ROW_REMAP_FAILURE").values()} == {0}


def test_a_split_gpu_is_served_as_its_instances_only(scrape: Scrape) -> None:
    """GPU 7: no whole-GPU series in any family; each instance series has the GPU-instance
    labels and the parent's UUID, repeats the parent's power and temperature, carries its
    own framebuffer and GPM, and has no utilisation (NVML has none in MIG mode)."""
    split = str(SPLIT)
    assert not [s for s in scrape.out.samples
                if s.name.startswith("DCGM_") and s.labels.get("gpu") == split
                and "GPU_I_ID" not in s.labels]
    power = scrape.instances("DCGM_FI_DEV_POWER_USAGE")
    assert sorted(s.labels["GPU_I_PROFILE"] for s in power) == ["1g.18gb", "2g.35gb", "3g.71gb"]
    assert all(s.label_order == MIG_LABELS and s.labels["UUID"] == scrape.split_uuid
               for s in power)
    for field in ("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP",
                  "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_XID_ERRORS"):
        assert len(scrape.instances(field)) == 3
        assert len({s.value for s in scrape.instances(field)}) == 1, field
    engine = {s.labels["GPU_I_PROFILE"]: s.value
              for s in scrape.instances("DCGM_FI_PROF_GR_ENGINE_ACTIVE")}
    assert engine["3g.71gb"] > 0 and engine["2g.35gb"] == engine["1g.18gb"] == 0
    used = {s.labels["GPU_I_PROFILE"]: s.value for s in scrape.instances("DCGM_FI_DEV_FB_USED")}
    assert used["3g.71gb"] > used["2g.35gb"]
    for field in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_DEC_UTIL"):
        assert not scrape.instances(field), field
