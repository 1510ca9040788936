"""ResourceClaim device status (issue 23, KEP-4817) through the real stack: after kubelet's
prepare, the real plugin has written the claim's ``status.devices`` entry for each device
(a ``Ready`` and a ``Healthy`` condition, ``data`` that finds the device) with server-side
apply under its own field manager and the shipped RBAC and admission policy; a GPU fault
the agent sees moves the ``Healthy`` condition and a reset moves it back; unprepare removes
the entries. A 1.34 server with ``DRAResourceClaimDeviceStatus`` off keeps none of it:
prepares work, and ``/readyz`` (still ready) and a metric say status is not written."""

from __future__ import annotations

from typing import Any

from tests.k8s.fixtures import DRA_GATES, StartApiServer
from tests.k8s.harness import OLDEST, ApiServer
from tests.k8s.objects import DRIVER, claim, devices_of, pod, request
from tests.k8s.published import gpu_uuid, set_mig
from tests.k8s.stack import DEVICE_CLASSES, Stack, StartStack, apply_shipped, wait_for
from tests.k8s.test_shares import MPS_CONFIG
from tests.k8s.workload import (
    allocate,
    claim_with_selector,
    create_pod,
    example_claim,
    prepare_and_inject,
    unprepare,
)

Json = dict[str, Any]
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"


def stored_claim(stack: Stack, name: str) -> Json:
    status, stored = stack.server.request("GET", f"{CLAIMS}/{name}")
    assert status == 200, stored
    return dict(stored)


def entries(stack: Stack, name: str) -> list[Json]:
    """This driver's ``status.devices`` entries of claim ``name``, as the server holds them."""
    return [d for d in (stored_claim(stack, name).get("status") or {}).get("devices") or []
            if d["driver"] == DRIVER]


def conditions(entry: Json) -> dict[str, Json]:
    return {c["type"]: c for c in entry.get("conditions") or []}


def wait_entries(stack: Stack, name: str, until: Any, what: str) -> list[Json]:
    """Claim ``name``'s entries once ``until(entries)`` holds."""
    def probe() -> tuple[list[Json]] | None:
        found = entries(stack, name)
        return (found,) if until(found) else None  # a tuple: an empty list is an answer
    result: tuple[list[Json]] = wait_for(f"claim {name}'s device status: {what}", probe, 30,
                                         log=stack.plugin.log)
    return result[0]


def ready_and_healthy(found: list[Json]) -> bool:
    return bool(found) and all(conditions(e).get("Ready", {}).get("status") == "True" and
                               conditions(e).get("Healthy", {}).get("status") == "True"
                               for e in found)


def test_prepared_claims_show_their_devices_and_unprepare_drops_them(
        kube_apiserver: ApiServer, stack: StartStack) -> None:
    """A full GPU and a 1g.10gb MIG claim prepared through kubelet each get one entry (the
    allocation's driver, pool and device) with Ready and Healthy True and data naming the
    device: the GPU's UUID and CDI devices; the MIG device's UUID, parent GPU, profile,
    instance IDs and placement as the agent has them. The entries are the plugin's field
    manager's on the status subresource; unprepare removes them."""
    running = stack(kube_apiserver, "dgx-h100", node="status-e2e")
    set_mig(running.agent, 3, ["1g.10gb"] * 7)
    running.wait_slices(lambda s: sum(n.startswith("gpu-3-mig-1g10gb")
                                      for n in devices_of(s)) == 7)
    create_pod(running, "st-full", example_claim("full-gpu.yaml", "st-full"))
    create_pod(running, "st-mig", example_claim("mig-1g10gb.yaml", "st-mig"))
    devices = {}
    ids = {}
    for name in ("st-full", "st-mig"):
        answer = allocate(running, name)
        assert answer.allocated, answer.reason
        [devices[name]] = answer.devices()
        ids[name], _ = prepare_and_inject(running, name)

    [full] = wait_entries(running, "st-full", ready_and_healthy, "Ready and Healthy")
    gpu = devices["st-full"]
    assert (full["pool"], full["device"], "shareID" in full) == (running.node, gpu, False)
    assert conditions(full)["Ready"]["reason"] == "Prepared"
    assert conditions(full)["Healthy"]["reason"] == "NoTaints"
    assert full["data"] == {"uuid": gpu_uuid(running.agent, int(gpu.split("-")[1])),
                            "cdiDevices": ids["st-full"]}

    [mig] = wait_entries(running, "st-mig", ready_and_healthy, "Ready and Healthy")
    reply = running.agent.request("GET", "/v1/gpus/3")
    [instance] = [m for m in reply.body["mig_devices"] if m["uuid"] == mig["data"]["uuid"]]
    assert mig["device"] == devices["st-mig"]
    assert mig["data"] == {
        "uuid": instance["uuid"], "parentUUID": reply.body["uuid"], "cdiDevices": ids["st-mig"],
        "mig": {"profile": "1g.10gb", "gpuInstance": instance["gi_id"],
                "computeInstance": instance["ci_id"], "placement": instance["placement"]}}
    managers = {(f["manager"], f.get("subresource")) for f in
                stored_claim(running, "st-mig")["metadata"]["managedFields"]}
    assert (DRIVER, "status") in managers, managers

    for name in ("st-full", "st-mig"):
        unprepare(running, name)
        wait_entries(running, name, lambda found: found == [], "removed")
        assert stored_claim(running, name)["status"]["allocation"]  # only ours went
    assert running.plugin.metric("gpu_agent_plugin_claim_status_writes_total",
                                 result="written") >= 2
    assert running.plugin.metric("gpu_agent_plugin_claim_status_writes_total",
                                 result="removed") == 2
    assert running.plugin.metric("gpu_agent_plugin_claim_status_unsupported") == 0


def test_an_mps_share_shows_its_share_and_pipe_directory(kube_apiservers: StartApiServer,
                                                        stack: StartStack) -> None:
    """A 10Gi share of an L40S under an MPS GpuConfig: its entry is keyed by the
    allocation's shareID and its data has the share's memory and ID, the MPS pipe
    directory of the claim's daemon and the limits in force."""
    server = kube_apiservers("1.37")
    running = stack(server, "l40s", node="status-mps", agent_extra=["--gpu-shares"])
    assert running.kubelet is not None
    apply_shipped(running.server, DEVICE_CLASSES)
    uuid = gpu_uuid(running.agent, 0)
    wanted = request(selectors=(f'device.attributes["{DRIVER}"].uuid == "{uuid}"',))
    wanted["exactly"]["capacity"] = {"requests": {"memory": "10Gi"}}
    shared = claim("st-mps", wanted)
    del shared["metadata"]["uid"]
    shared["spec"]["devices"]["config"] = [
        {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": MPS_CONFIG}}]
    running.server.apply([shared, pod("st-mps", {"c": "st-mps"}, node_name=running.node)])
    answer = allocate(running, "st-mps")
    assert answer.allocated, answer.reason
    [result] = answer.results[0]["allocation"]["devices"]["results"]
    prepared = running.kubelet.prepare("default/st-mps")
    assert prepared["ok"], f"{prepared}\n{running.plugin.log()}"

    [entry] = wait_entries(running, "st-mps", ready_and_healthy, "Ready and Healthy")
    [record] = running.agent_claims()
    assert entry["shareID"] == result["shareID"]
    assert entry["data"]["share"] == {"memory": "10240Mi", "shareID": result["shareID"]}
    assert entry["data"]["sharing"] == {"strategy": "MPS"}
    assert entry["data"]["mps"] == {"pipeDirectory": record["mps"]["pipe_directory"],
                                    "activeThreadPercentage": 50,
                                    "pinnedDeviceMemoryLimit": "10240Mi"}
    unprepare(running, "st-mps")
    wait_entries(running, "st-mps", lambda found: found == [], "removed")


def test_a_gpu_fault_moves_the_health_condition_and_a_reset_moves_it_back(
        kube_apiserver: ApiServer, stack: StartStack) -> None:
    """XID 48 on the prepared claim's GPU: the claim's Healthy condition leaves True (with
    the agent's taints, False naming the XID; on an agent that withdraws the GPU instead,
    Unknown), its Ready condition stays True and its transition time moves; a reset of the
    GPU makes it True again. Only the health condition's time moves."""
    running = stack(kube_apiserver, "dgx-h100", node="status-health",
                    agent_extra=["--collect-interval", "0.2"])
    uuid = gpu_uuid(running.agent, 2)
    create_pod(running, "st-sick", claim_with_selector(
        example_claim("full-gpu.yaml", "st-sick"),
        f'device.attributes["{DRIVER}"].uuid == "{uuid}"'))
    assert allocate(running, "st-sick").devices() == ["gpu-2"]
    prepare_and_inject(running, "st-sick")
    [before] = wait_entries(running, "st-sick", ready_and_healthy, "Ready and Healthy")

    assert running.agent.request("POST", "/v1/sim/xid", {"gpu": uuid, "xid": 48}).status == 202

    def unhealthy(found: list[Json]) -> bool:
        return len(found) == 1 and conditions(found[0])["Healthy"]["status"] != "True"
    [sick] = wait_entries(running, "st-sick", unhealthy, "Healthy not True")
    health = conditions(sick)["Healthy"]
    if health["status"] == "False":
        assert health["reason"] == "Tainted" and "xid=48" in health["message"], health
    else:
        assert (health["status"], health["reason"]) == ("Unknown", "HealthUnknown"), health
    assert conditions(sick)["Ready"] == conditions(before)["Ready"]
    assert sick["data"] == before["data"]

    assert running.agent.request("POST", "/v1/sim/reset", {"gpu": uuid}).status == 204
    [well] = wait_entries(running, "st-sick", ready_and_healthy, "Healthy again")
    assert conditions(well)["Healthy"]["reason"] == "NoTaints"
    unprepare(running, "st-sick")
    wait_entries(running, "st-sick", lambda found: found == [], "removed")


def test_a_server_without_device_status_fails_soft(kube_apiservers: StartApiServer,
                                                   stack: StartStack) -> None:
    """On 1.34 with DRAResourceClaimDeviceStatus off the server drops status.devices: the
    claim is prepared and unprepared as ever, the plugin stays ready and its /readyz says
    that device status is not written, and the metric says so."""
    gates = DRA_GATES[OLDEST] + ",DRAResourceClaimDeviceStatus=false"
    server = kube_apiservers(OLDEST, feature_gates=gates)
    running = stack(server, "dgx-h100", node="status-off", kubelet_gates=gates)
    create_pod(running, "st-off", example_claim("full-gpu.yaml", "st-off"))
    assert allocate(running, "st-off", feature_gates=gates).allocated
    prepare_and_inject(running, "st-off")

    def said() -> bool:
        return running.plugin.metric("gpu_agent_plugin_claim_status_unsupported") == 1
    wait_for("the plugin to see status.devices dropped", said, 30, log=running.plugin.log)
    status, ready = running.plugin.readyz()
    assert status == 200 and ready["status"] == "ready", ready
    assert "status.devices" in ready["warnings"]["claim_status"], ready
    assert "claim_status" not in ready["checks"]  # reported, not a check that can fail
    assert running.plugin.metric("gpu_agent_plugin_ready") == 1
    assert entries(running, "st-off") == []
    unprepare(running, "st-off")
    assert running.agent_claims() == []


def test_a_restarted_plugin_keeps_following_its_claims(kube_apiserver: ApiServer,
                                                       stack: StartStack) -> None:
    """A plugin restarted after a prepare takes the claims the agent holds back: an XID on
    the claim's GPU then still moves its Healthy condition, and the Ready condition keeps
    the time it was first written."""
    running = stack(kube_apiserver, "dgx-h100", node="status-restart",
                    agent_extra=["--collect-interval", "0.2"])
    uuid = gpu_uuid(running.agent, 5)
    create_pod(running, "st-kept", claim_with_selector(
        example_claim("full-gpu.yaml", "st-kept"),
        f'device.attributes["{DRIVER}"].uuid == "{uuid}"'))
    assert allocate(running, "st-kept").devices() == ["gpu-5"]
    prepare_and_inject(running, "st-kept")
    [before] = wait_entries(running, "st-kept", ready_and_healthy, "Ready and Healthy")

    running.restart_plugin()
    running.plugin.wait_ready()
    assert running.agent.request("POST", "/v1/sim/xid", {"gpu": uuid, "xid": 48}).status == 202
    [sick] = wait_entries(running, "st-kept", lambda found: len(found) == 1 and conditions(
        found[0])["Healthy"]["status"] != "True", "Healthy not True after the restart")
    assert conditions(sick)["Ready"] == conditions(before)["Ready"]
    unprepare(running, "st-kept")
    wait_entries(running, "st-kept", lambda found: found == [], "removed")
