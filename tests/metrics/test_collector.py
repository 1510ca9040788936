"""The collector over a simulated DGX H100: dcgm-exporter's labels, MIG series, failures
that stay local, scrapes that never touch NVML, staleness in /readyz, claim attribution."""

from __future__ import annotations

import gzip
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from agent.api.app import build_app
from agent.api.auth import TokenStore
from agent.api.context import AgentContext
from agent.claims.attribution import claim_attribution, share_attribution
from agent.claims.checkpoint import ClaimRecord, PreparedDevice, ShareRecord
from agent.gpu import mig
from agent.gpu.backend import Backend
from agent.gpu.sim.hardware import XID_FALLEN_OFF_THE_BUS
from agent.gpu.types import Placement
from agent.gpu.xid import XidEvent
from agent.metrics.collector import Collector
from agent.settings import resolve
from agent.wiring import build_node
from tests.metrics.conftest import ONE_G_10GB, Sim
from tests.metrics.textformat import Exposition, parse
from tests.waiting import until

GPU_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname",
              "DCGM_FI_DRIVER_VERSION")
MIG_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "GPU_I_PROFILE", "GPU_I_ID",
              "Hostname", "DCGM_FI_DRIVER_VERSION")


def sample(sim: Sim, name: str, **labels: str) -> float | None:
    """One sample of the agent's registry, as a scrape reads it."""
    return sim.metrics.registry.get_sample_value(name, labels)


def exposition(collector: Collector) -> Exposition:
    return parse(collector.snapshot.block.text.decode())


async def test_every_gpu_has_dcgm_exporters_labels(sim: Sim) -> None:
    """Label names and order are dcgm-exporter's; values come from NVML."""
    collector = sim.collector()
    collector.collect()
    samples = exposition(collector).named("DCGM_FI_DEV_GPU_UTIL")
    assert len(samples) == 8
    for gpu, sample in zip(sim.inventory.gpus, samples, strict=True):
        assert sample.label_order == GPU_LABELS
        assert sample.labels == {
            "gpu": str(gpu.index), "UUID": gpu.uuid, "pci_bus_id": gpu.static.pci_bus_id,
            "device": f"nvidia{gpu.index}", "modelName": "NVIDIA H100 80GB HBM3",
            "Hostname": "node-a", "DCGM_FI_DRIVER_VERSION": sim.inventory.driver.driver_version}


async def test_newer_releases_spell_the_host_label_in_lower_case(sim: Sim) -> None:
    collector = sim.collector(hostname_label="hostname")
    collector.collect()
    sample = exposition(collector).named("DCGM_FI_DEV_GPU_TEMP")[0]
    assert sample.labels["hostname"] == "node-a" and "Hostname" not in sample.labels
    with pytest.raises(ValueError, match="hostname label"):
        sim.collector(hostname_label="host")


async def test_mig_series_carry_gpu_instance_labels_and_the_parent_uuid(sim: Sim) -> None:
    """7x 1g.10gb on GPU 0: served as its instances only (dcgm-exporter's default mode), with
    GPU_I_PROFILE/GPU_I_ID and the parent's UUID, per-GI framebuffer, the parent's
    temperature, power and XID repeated on each; no utilisation under MIG."""
    await sim.split(0)
    collector = sim.collector()
    collector.collect()
    out = exposition(collector)
    parent = sim.inventory.gpus[0]
    assert not [s for s in out.samples if s.labels.get("gpu") == "0"
                and "GPU_I_ID" not in s.labels]
    mig = out.named("DCGM_FI_DEV_FB_USED")[:7]
    assert [s.labels["gpu"] for s in mig] == ["0"] * 7
    assert {s.labels["GPU_I_PROFILE"] for s in mig} == {"1g.10gb"}
    assert sorted(s.labels["GPU_I_ID"] for s in mig) == sorted(
        str(d.gi_id) for d in parent.mig_devices)
    assert all(s.label_order == MIG_LABELS and s.labels["UUID"] == parent.uuid for s in mig)
    assert all(s.value == 13 for s in mig)
    for field in ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_XID_ERRORS",
                  "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"):
        repeated = [s for s in out.named(field) if s.labels["gpu"] == "0"]
        assert len(repeated) == 7 and len({s.value for s in repeated}) == 1, field
    util = {s.labels["gpu"] for s in out.named("DCGM_FI_DEV_GPU_UTIL")}
    assert util == {str(i) for i in range(1, 8)}


async def test_a_mig_gpu_without_instances_stays_a_whole_gpu(sim: Sim) -> None:
    """MIG mode on, no GPU instance yet: the GPU keeps its whole-GPU series, as
    dcgm-exporter monitors a GPU without instances as a GPU."""
    await sim.split(5, ())
    collector = sim.collector()
    collector.collect()
    out = exposition(collector)
    power = [s for s in out.named("DCGM_FI_DEV_POWER_USAGE") if s.labels["gpu"] == "5"]
    assert len(power) == 1 and power[0].label_order == GPU_LABELS
    assert not [s for s in out.samples if "GPU_I_ID" in s.labels]


async def test_a_gpu_instance_without_compute_instance_has_no_framebuffer(sim: Sim) -> None:
    """A GPU instance with no compute instance still has its series (the parent's power,
    its own GPM) but no framebuffer, which is read through a MIG device, as dcgm-exporter."""
    uuid = sim.node.gpu_uuids()[6]

    def bare_instance() -> None:
        handle = sim.session.call("nvmlDeviceGetHandleByUUID", uuid)
        mig.set_mig_mode(sim.session, handle, uuid, True)
        mig.create_gpu_instance(sim.session, handle, uuid, ONE_G_10GB, Placement(0, 1))

    await sim.session.read(bare_instance)
    await sim.inventory.refresh()
    collector = sim.collector()
    collector.collect()
    out = exposition(collector)
    power = [s for s in out.named("DCGM_FI_DEV_POWER_USAGE") if s.labels["gpu"] == "6"]
    assert [s.labels.get("GPU_I_PROFILE") for s in power] == ["1g.10gb"]
    assert not [s for s in out.named("DCGM_FI_DEV_FB_USED") if s.labels["gpu"] == "6"]


async def test_one_gpu_failing_stops_neither_its_other_fields_nor_other_gpus(sim: Sim) -> None:
    """A field's error loses that field on that GPU; a GPU without a handle loses its series
    (not its XID series); every error is counted; the round still succeeds."""
    uuids = sim.node.gpu_uuids()
    sim.node.add_fault("nvmlDeviceGetPowerUsage", "NVML_ERROR_UNKNOWN", gpu=uuids[3], times=100)
    sim.node.add_fault("nvmlDeviceGetHandleByUUID", "NVML_ERROR_UNKNOWN", gpu=uuids[4],
                       times=100)
    collector = sim.collector()
    collector.collect()
    out = exposition(collector)
    power = {s.labels["gpu"] for s in out.named("DCGM_FI_DEV_POWER_USAGE")}
    assert power == {"0", "1", "2", "5", "6", "7"}
    temps = {s.labels["gpu"] for s in out.named("DCGM_FI_DEV_GPU_TEMP")}
    assert temps == {"0", "1", "2", "3", "5", "6", "7"}
    assert len(out.named("DCGM_FI_DEV_XID_ERRORS")) == 8
    errors = "gpu_agent_nvml_errors_total"
    assert sample(sim, errors, function="nvmlDeviceGetPowerUsage", code="NVML_ERROR_UNKNOWN") == 1
    assert sample(sim, errors, function="nvmlDeviceGetHandleByUUID",
                  code="NVML_ERROR_UNKNOWN") == 1
    assert collector.snapshot.readings[uuids[4]].error is not None
    assert (sample(sim, "gpu_agent_last_collection_timestamp_seconds") or 0) > 0
    # The transient field error is asked again next round (only NOT_SUPPORTED is remembered).
    sim.node.clear_faults()
    collector.collect()
    assert len(exposition(collector).named("DCGM_FI_DEV_POWER_USAGE")) == 8


async def test_a_hung_gpu_delays_neither_the_round_nor_a_later_one(sim: Sim) -> None:
    """Reads that outlive the interval are abandoned; the GPU is skipped while its read is
    still in NVML, and read again once it returned."""
    collector = sim.collector(interval_s=0.2)
    sim.node.set_latency({"nvmlDeviceGetTemperature": 3.0})
    collector.collect()
    # The round is over while its reads are still in NVML: it did not wait for them.
    assert len(collector.reads_in_nvml()) == 8
    assert all("did not return" in (r.error or "") for r in collector.snapshot.readings.values())
    collector.collect()
    assert all("has not returned" in (r.error or "")
               for r in collector.snapshot.readings.values())
    sim.node.set_latency({})
    await until(lambda: collector.reads_in_nvml() == [], "the hung reads to return")
    collector.collect()
    assert len(exposition(collector).named("DCGM_FI_DEV_GPU_TEMP")) == 8
    collector.stop()


async def test_claims_add_attribution_labels(sim: Sim) -> None:
    """A prepared claim labels its devices' series with namespace, pod, container (when
    given) and the claim uid; MIG series by GPU instance."""
    await sim.split(1, (0, 1))
    gpu0, gpu1 = sim.inventory.gpus[0], sim.inventory.gpus[1]
    gi = gpu1.mig_devices[1].gi_id
    records = [
        _claim("uid-a", {"namespace": "ml", "pod": "trainer-0", "container": "main"},
               PreparedDevice(request="r", kind="gpu", gpu=gpu0.uuid, uuid=gpu0.uuid,
                              device_name="gpu-0", cdi_device="x")),
        _claim("uid-b", {"namespace": "ml", "pod": "infer-1"},
               PreparedDevice(request="r", kind="mig", gpu=gpu1.uuid, gi_id=gi, ci_id=0,
                              device_name="gpu-1-mig", cdi_device="y")),
        _claim("uid-c", {"pod": "pending"}, PreparedDevice(
            request="r", kind="gpu", gpu=sim.inventory.gpus[2].uuid, device_name="gpu-2",
            cdi_device="z"), state="prepare_started"),
    ]
    collector = sim.collector(attribution=lambda: claim_attribution(records))
    collector.collect()
    out = exposition(collector)
    by_gpu = {s.labels["gpu"]: s.labels for s in out.named("DCGM_FI_DEV_GPU_TEMP")
              if "GPU_I_ID" not in s.labels}
    assert {k: by_gpu["0"].get(k) for k in ("namespace", "pod", "container", "claim_uid")} == {
        "namespace": "ml", "pod": "trainer-0", "container": "main", "claim_uid": "uid-a"}
    assert "pod" not in by_gpu["2"]  # not prepared yet
    mig = {s.labels["GPU_I_ID"]: s.labels for s in out.named("DCGM_FI_DEV_FB_USED")
           if s.labels.get("GPU_I_ID")}
    assert mig[str(gi)]["pod"] == "infer-1" and "container" not in mig[str(gi)]
    assert "pod" not in mig[str(gpu1.mig_devices[0].gi_id)]


async def test_each_share_of_a_gpu_has_its_own_series_and_framebuffer(sim: Sim) -> None:
    """Two counted shares of GPU 0: a series of the GPU per share, labelled with its claim
    (and the PodResources container of that claim only), framebuffer used its clients' and
    free the rest of its share; the share whose use is unknown has no framebuffer series,
    neither has the driver's reservation; no claim stands for the whole GPU."""
    gpu0 = sim.inventory.gpus[0]

    def share(uid: str, name: str) -> ClaimRecord:
        return _claim(uid, {"namespace": "ml", "name": name, "pod": f"pod-{uid}"},
                      PreparedDevice(request="r", kind="gpu", gpu=gpu0.uuid, uuid=gpu0.uuid,
                                     device_name="gpu-0", cdi_device="x",
                                     share=ShareRecord(memory_mib=10240)))

    records = [share("a", "claim-a"), share("b", "claim-b")]
    holders = {(gpu0.uuid, None): [
        {"pod": "kubelet-a", "container": "main", "namespace": "ml",
         "dra_claim_name": "claim-a", "dra_claim_namespace": "ml"},
        {"pod": "someone-else", "container": "main", "namespace": "ml",
         "dra_claim_name": "claim-x", "dra_claim_namespace": "ml"}]}
    assert claim_attribution(records) == {}
    collector = sim.collector(attribution=lambda: claim_attribution(records),
                              holders=lambda: holders,
                              shares=lambda: share_attribution(records, {("a", gpu0.uuid): 3000}))
    collector.collect()
    out = exposition(collector)

    def of_gpu0(name: str) -> dict[tuple[str, str], float]:
        return {(s.labels["claim_uid"], s.labels["pod"]): s.value for s in out.named(name)
                if s.labels["gpu"] == "0"}

    assert of_gpu0("DCGM_FI_DEV_FB_USED") == {("a", "kubelet-a"): 3000}
    assert of_gpu0("DCGM_FI_DEV_FB_FREE") == {("a", "kubelet-a"): 10240 - 3000}
    assert of_gpu0("DCGM_FI_DEV_FB_RESERVED") == {}
    assert set(of_gpu0("DCGM_FI_DEV_GPU_TEMP")) == {("a", "kubelet-a"), ("b", "pod-b")}
    assert set(of_gpu0("DCGM_FI_DEV_XID_ERRORS")) == {("a", "kubelet-a"), ("b", "pod-b")}
    collector.stop()


def _claim(uid: str, metadata: dict[str, str], device: PreparedDevice,
           state: str = "prepare_completed") -> ClaimRecord:
    return ClaimRecord(uid=uid, state=state, devices=[device], request_digest="d",  # type: ignore[arg-type]
                       metadata=metadata, created_at=1.0, updated_at=1.0)


async def test_an_xid_shows_at_once_and_marks_the_gpu(sim: Sim) -> None:
    """The XID callback wakes the timer thread: the last XID is served well before the next
    tick, the GPU is unhealthy in the gauge, and a later lost GPU is not read again."""
    collector = sim.collector(interval_s=30.0)
    await collector.start()
    try:
        uuid = sim.node.gpu_uuids()[6]
        sim.node.inject_xid(uuid, XID_FALLEN_OFF_THE_BUS)
        collector.on_xid(XidEvent(gpu_uuid=uuid, xid=XID_FALLEN_OFF_THE_BUS))
        def shown() -> dict[str, Any] | None:
            xids = {s.labels["gpu"]: s for s in exposition(collector).named(
                "DCGM_FI_DEV_XID_ERRORS")}
            return xids if xids["6"].value == 79 else None
        xids = await until(shown, "XID 79 on GPU 6 in the snapshot", 3)
        assert xids["6"].labels["err_msg"] == "GPU has fallen off the bus"
        assert xids["6"].labels["err_code"] == "79" and xids["5"].value == 0
        assert sample(sim, "gpu_agent_gpu_healthy", gpu="6", UUID=uuid) == 0
        assert sample(sim, "gpu_agent_gpu_healthy", gpu="5", UUID=sim.node.gpu_uuids()[5]) == 1
        assert sample(sim, "gpu_agent_xid_errors_total", xid="79") == 1
        assert not any(s.labels["gpu"] == "6" for s in exposition(collector).named(
            "DCGM_FI_DEV_GPU_TEMP"))
        sim.session.mark_lost(uuid, "seen lost")
        before = sim.calls().get("nvmlDeviceGetHandleByUUID", 0)
        collector.collect()
        calls = sim.calls().get("nvmlDeviceGetHandleByUUID", 0) - before
        assert calls == 7  # every GPU but the lost one
    finally:
        collector.stop()


# -- through the HTTP API ----------------------------------------------------------------


@pytest.fixture
async def api(sim: Sim, aiohttp_client: Callable[..., Any]) -> Callable[..., Any]:
    async def make(collector: Collector) -> TestClient[Any, Any]:
        settings = resolve({"simulate": "dgx-h100", "state_dir": str(sim.node.state_dir)},
                           env={})
        backend = Backend(nvml=sim.node.nvml, name="simulated:dgx-h100", sim=sim.node,
                          sys_root=sim.node.sys_root)
        # The node as the wiring builds it, serving this test's NVML session and collector.
        node = replace(build_node(settings, backend), session=sim.session,
                       inventory=sim.inventory, events=sim.events, metrics=sim.metrics,
                       health=sim.health, collector=collector)
        node.readiness.set(None)
        ctx = AgentContext(node=node, tokens=TokenStore.empty())
        client: TestClient[Any, Any] = await aiohttp_client(build_app(ctx))
        return client
    return make


async def test_a_scrape_never_calls_nvml(sim: Sim, api: Callable[..., Any]) -> None:
    """Scrapes (plain and gzip) and readiness probes leave the NVML call counters as they
    were: they serve the snapshot."""
    await sim.split(2)
    collector = sim.collector()
    collector.collect()
    client = await api(collector)
    before = sim.calls()
    for _ in range(10):
        plain = await client.get("/metrics")
        zipped = await client.get("/metrics", headers={"Accept-Encoding": "gzip"},
                                  auto_decompress=False)
        assert (await client.get("/readyz")).status == 200
    assert sim.calls() == before
    assert plain.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert zipped.headers["Content-Encoding"] == "gzip"
    text = await plain.text()
    assert gzip.decompress(await zipped.read()).decode().split("gpu_agent_http")[0] == \
        text.split("gpu_agent_http")[0]
    out = parse(text)
    assert len([s for s in out.named("DCGM_FI_DEV_FB_USED") if "GPU_I_ID" in s.labels]) == 7
    assert out.named("gpu_agent_collection_interval_seconds")[0].value == 5


async def test_readyz_turns_unready_when_collections_stop_succeeding(
        sim: Sim, api: Callable[..., Any]) -> None:
    """No successful round for three intervals -> 503 with the reason; back when NVML is."""
    collector = sim.collector(interval_s=0.1)
    await collector.start()
    try:
        client = await api(collector)
        assert (await client.get("/readyz")).status == 200
        sim.node.add_fault("nvmlDeviceGetHandleByUUID", "NVML_ERROR_UNKNOWN", times=10**6)
        reply = await _wait_status(client, 503)
        assert "no successful metrics collection" in (await reply.json())["reason"]
        sim.node.clear_faults()
        await _wait_status(client, 200)
    finally:
        collector.stop()


async def _wait_status(client: TestClient[Any, Any], status: int) -> Any:
    async def answered() -> Any:
        reply = await client.get("/readyz")
        return reply if reply.status == status else None
    return await until(answered, f"/readyz to answer {status}", 5, every_s=0.05)
