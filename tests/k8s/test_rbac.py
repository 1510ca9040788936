"""The shipped RBAC (daemonset/base/rbac.yaml) and admission policy (admissionpolicy.yaml) on
a real kube-apiserver (RBAC authorizer, ValidatingAdmissionPolicy), with the plugin's own
credential: a ServiceAccount token bound to a Pod on a node, as the DaemonSet's projected
token is. The publisher can do all it needs under them; it cannot write another node's
slices; anything beyond the role is 403.

Each version gets its own API server for this module: the policy refuses every unbound token
of the plugin's account, which other tests' shared servers hand out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from agent.kubeplugin.agent_client import AgentClient
from agent.kubeplugin.kube import KubeClient, KubeError
from agent.kubeplugin.publisher import Backoff, ResourceSlicePublisher
from tests import waiting
from tests.k8s.conftest import StartAgent
from tests.k8s.fixtures import DRA_GATES
from tests.k8s.harness import ROOT, SLICE_RULES, VERSIONS, ApiServer
from tests.k8s.objects import DRIVER
from tests.k8s.published import slices_of
from tests.waiting import wait_for

BASE = ROOT / "daemonset" / "base"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
NAMESPACE = ACCOUNT = "gpu-node-agent"  # the shipped binding's and policy's account
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
Json = dict[str, Any]


def shipped(name: str) -> list[Json]:
    return [doc for doc in yaml.safe_load_all((BASE / name).read_text()) if doc]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], ApiServer]]:
    """``server(version)``: an API server of its own with the shipped namespace, account,
    ClusterRole and binding, and admission policy and binding applied as they are."""
    running: dict[str, ApiServer] = {}

    def server(version: str) -> ApiServer:
        if version not in running:
            started = ApiServer.start(version, tmp_path_factory.mktemp(f"guarded-{version}"),
                                      feature_gates=DRA_GATES[version])
            running[version] = started
            started.apply([*shipped("namespace.yaml"), *shipped("serviceaccount.yaml"),
                           *shipped("rbac.yaml"), *shipped("admissionpolicy.yaml")])
        return running[version]

    yield server
    for started in running.values():
        started.stop()


@dataclass(frozen=True)
class Credential:
    token: str
    kubeconfig: Path


def kubeconfig_for(server: ApiServer, token: str, path: Path) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "plugin",
        "clusters": [{"name": "c", "cluster": {"server": server.url,
                                                "certificate-authority": str(server.ca)}}],
        "users": [{"name": "plugin", "user": {"token": token}}],
        "contexts": [{"name": "plugin", "context": {"cluster": "c", "user": "plugin"}}]}))
    path.chmod(0o600)
    return path


def plugin_credential(server: ApiServer, node: str, directory: Path) -> Credential:
    """The plugin's token as the DaemonSet's pod gets it: bound to a Pod of the account that
    runs on ``node`` (the server records the node in the token)."""
    server.ensure_node(node)
    pod = f"gpu-node-agent-{node}"
    server.apply([{"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": pod, "namespace": NAMESPACE},
                   "spec": {"nodeName": node, "serviceAccountName": ACCOUNT,
                            "automountServiceAccountToken": False,
                            "containers": [{"name": "plugin",
                                            "image": "registry.invalid/none"}]}}])
    token = server.kubectl("create", "token", "-n", NAMESPACE, ACCOUNT, "--duration=1h",
                           "--bound-object-kind", "Pod", "--bound-object-name",
                           pod).stdout.strip()
    return Credential(token, kubeconfig_for(server, token, directory / f"{node}.kubeconfig"))


def whoami(server: ApiServer, token: str) -> Json:
    status, review = server.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                                    {"apiVersion": "authentication.k8s.io/v1",
                                     "kind": "SelfSubjectReview"}, token=token)
    assert status == 201, review
    return dict(review["status"]["userInfo"])


def a_slice(node: str, name: str, *, driver: str = DRIVER) -> Json:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0"}]}}


def refused_by_policy(server: ApiServer, token: str, node: str) -> tuple[int, Any]:
    """Wait until the admission policy is in force (its binding is loaded a moment after it
    is created): a slice for ``node`` written with ``token`` is refused; the answer."""
    def refused() -> tuple[int, Any] | None:
        status, answer = server.request("POST", SLICES, a_slice(node, f"{node}-probe"),
                                        token=token)
        if status != 201:
            return status, answer
        server.request("DELETE", f"{SLICES}/{node}-probe")
        return None
    found: tuple[int, Any] = wait_for(refused, "the admission policy to refuse a write", 30,
                                      every_s=0.2)
    return found


async def until(check: Callable[[], bool], task: asyncio.Task[None],
                within_s: float = 20) -> None:
    def holds() -> bool:
        if task.done():
            task.result()
            raise AssertionError("the publisher stopped")
        return check()
    await waiting.until(holds, "the check", within_s)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_token_names_its_pods_node(version: str, guarded: Callable[[str], ApiServer],
                                       tmp_path: Path) -> None:
    """A token bound to a Pod on a node authenticates as the plugin's account with that node
    in its extra (ServiceAccountTokenPodNodeInfo), which the admission policy reads; an
    unbound token names no node."""
    server = guarded(version)
    node = f"who-v{version}".replace(".", "-")
    user = whoami(server, plugin_credential(server, node, tmp_path).token)
    assert user["username"] == f"system:serviceaccount:{NAMESPACE}:{ACCOUNT}"
    assert user["extra"][NODE_NAME_EXTRA] == [node]
    unbound = server.kubectl("create", "token", "-n", NAMESPACE, ACCOUNT).stdout.strip()
    assert NODE_NAME_EXTRA not in whoami(server, unbound).get("extra", {})


@pytest.mark.parametrize("version", VERSIONS)
def test_shipped_role_lets_the_publisher_do_its_work(
        version: str, guarded: Callable[[str], ApiServer], agent_node: StartAgent,
        tmp_path: Path) -> None:
    """The publisher, with the plugin's bound token under the shipped role and policy, reads
    its Node, lists and watches its slices, creates them, deletes an obsolete one, updates
    one someone changed, and reads a ResourceClaim: no call refused."""
    server = guarded(version)
    node = f"pub-v{version}".replace(".", "-")
    credential = plugin_credential(server, node, tmp_path)
    agent = agent_node("l40s", node_name=node)
    stale = a_slice(node, f"{node}-stale")
    stale["spec"]["pool"]["generation"] = 3
    assert server.request("POST", SLICES, stale)[0] == 201
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": f"claim-{node}"},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                 "deviceClassName": "gpu.nodeagent.dev"}}]}}}
    assert server.request("POST", CLAIMS, claim)[0] == 201

    selector = f"{SLICES}?fieldSelector=spec.nodeName={node}"

    def held() -> list[Json]:
        return sorted(server.request("GET", selector)[1]["items"],
                      key=lambda s: s["metadata"]["name"])

    async def scenario() -> tuple[list[Json], float]:
        kube = await KubeClient.from_environment(credential.kubeconfig)
        client = AgentClient(agent.socket_path, agent.state_dir / "tokens")
        registry = CollectorRegistry()
        publisher = ResourceSlicePublisher(client, kube, node_name=node, driver=DRIVER,
                                   registry=registry, backoff=Backoff(0.01, 0.05))
        task = asyncio.create_task(publisher.run())
        try:
            await until(lambda: publisher.health().in_sync, task)
            first = await asyncio.to_thread(held)
            tampered = first[0]
            tampered["spec"]["devices"] = tampered["spec"]["devices"][:1]
            status, _ = await asyncio.to_thread(server.request, "PUT",
                                                f"{SLICES}/{tampered['metadata']['name']}",
                                                tampered)
            assert status == 200
            await until(lambda: registry.get_sample_value(
                "gpu_agent_plugin_slice_republishes_total", {"cause": "modified"}) == 1, task)
            got = await kube.get_resource_claim("default", f"claim-{node}")
            assert got["metadata"]["name"] == f"claim-{node}"
            forbidden = registry.get_sample_value("gpu_agent_plugin_slice_publisher_errors_total",
                                                  {"kind": "forbidden"})
            return await asyncio.to_thread(held), forbidden or 0.0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()
            await kube.close()

    slices, forbidden = asyncio.run(scenario())
    want = slices_of(agent, SLICE_RULES[version])
    assert [s["metadata"]["name"] for s in slices] == sorted(s["metadata"]["name"]
                                                            for s in want)
    assert {s["spec"]["pool"]["generation"] for s in slices} == {5}  # 3, +1, +1 after tamper
    assert forbidden == 0


@pytest.mark.parametrize("version", VERSIONS)
def test_the_policy_keeps_the_plugin_to_its_own_node(
        version: str, guarded: Callable[[str], ApiServer], tmp_path: Path) -> None:
    """With the plugin's token for node A, a slice is written for A only: creating one for
    B, updating or deleting B's, another driver's slice, and any write with an unbound token
    (no node) are refused by the shipped policy, naming why (403: reason Forbidden); moving
    A's slice to B the server refuses itself (422, invalid)."""
    server = guarded(version)
    mine, theirs = (f"{n}-v{version}".replace(".", "-") for n in ("node-a", "node-b"))
    token = plugin_credential(server, mine, tmp_path).token
    status, answer = refused_by_policy(server, token, theirs)
    assert status == 403 and "may write only ResourceSlices whose spec.nodeName is " \
        f"{mine}" in answer["message"], answer

    own = a_slice(mine, f"{mine}-own")
    status, stored = server.request("POST", SLICES, own, token=token)
    assert status == 201, stored
    status, foreign = server.request("POST", SLICES, a_slice(theirs, f"{theirs}-theirs"))
    assert status == 201, foreign  # the administrator's write: not the plugin's

    moved = {**stored, "spec": {**stored["spec"], "nodeName": theirs}}
    changed = {**foreign, "spec": {**foreign["spec"], "devices": []}}
    policy = "ValidatingAdmissionPolicy 'gpu-node-agent-resourceslices'"
    for what, (method, path, body, code, why) in {
        "update another node's slice": ("PUT", f"{SLICES}/{theirs}-theirs", changed, 403,
                                        policy),
        "delete another node's slice": ("DELETE", f"{SLICES}/{theirs}-theirs", None, 403,
                                        policy),
        "another driver's slice": ("POST", SLICES, a_slice(mine, f"{mine}-other",
                                                           driver="other.example.com"),
                                   403, "only ResourceSlices of driver gpu.nodeagent.dev"),
        # The server's own validation refuses this one before the policy looks.
        "move its slice to another node": ("PUT", f"{SLICES}/{mine}-own", moved, 422,
                                           "field is immutable"),
    }.items():
        status, answer = server.request(method, path, body, token=token)
        assert status == code and why in answer["message"], (what, answer)

    unbound = server.kubectl("create", "token", "-n", NAMESPACE, ACCOUNT).stdout.strip()
    status, answer = server.request("POST", SLICES, a_slice(mine, f"{mine}-unbound"),
                                    token=unbound)
    assert status == 403 and "names no node" in answer["message"], answer
    assert server.request("DELETE", f"{SLICES}/{mine}-own", token=token)[0] == 200


def a_slot(node: str, *, pool: str | None = None) -> Json:
    """A compute-domain slot's slice as the plugin writes it for ``node`` (``pool``
    defaults to it), without its owner reference."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-compute-domain"},
            "spec": {"driver": DRIVER, "pool": {"name": f"{pool or node}/compute-domain",
                                                "generation": 1, "resourceSliceCount": 1},
                     "nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [
                         {"key": f"{DRIVER}/fabric-clique", "operator": "In",
                          "values": ["c.1"]}]}]},
                     "devices": [{"name": "slot", "attributes": {
                         "type": {"string": "compute-domain-slot"},
                         "fabricClique": {"string": "c.1"}}}]}}


@pytest.mark.parametrize("version", VERSIONS)
def test_the_plugin_changes_only_its_own_nodes_domain_keys(
        version: str, guarded: Callable[[str], ApiServer], tmp_path: Path) -> None:
    """With the plugin's token for node A: A's fabric-clique and compute-domain labels and
    compute-domain-member annotation may be set and removed; the same label on node B, any
    other label or annotation of A and a change of A's spec (cordon) are refused by the
    shipped Node policy, naming why. A's compute-domain slot is written (pool
    A/compute-domain, owned by A); one in B's pool, or owned by B, is refused."""
    server = guarded(version)
    mine, theirs = (f"{n}-v{version}".replace(".", "-") for n in ("domain-a", "domain-b"))
    credential = plugin_credential(server, mine, tmp_path)
    server.ensure_node(theirs)

    def as_plugin(*args: str) -> Any:
        return server.kubectl(*args, kubeconfig=credential.kubeconfig, check=False)

    def policy_in_force() -> bool:
        # The policy is enforced a moment after its binding is created: a label that got
        # through before then is taken off again.
        probe = as_plugin("label", "node", mine, "team=probe")
        if probe.returncode == 0:
            server.kubectl("label", "node", mine, "team-")
        return "denied request" in probe.stderr

    wait_for(policy_in_force, "the Node admission policy to be in force", 30, every_s=0.2)
    server.kubectl("label", "node", mine, "rack=r1", "--overwrite")  # the administrator's
    clique, domain = f"{DRIVER}/fabric-clique", f"{DRIVER}/compute-domain"
    member = f"{DRIVER}/compute-domain-member"
    for args in [("label", "node", mine, f"{clique}=c.1"),
                 ("label", "node", mine, f"{domain}=uid-1"),
                 ("annotate", "node", mine, f"{member}=ready"),
                 ("label", "node", mine, f"{clique}=c.2", "--overwrite"),
                 ("label", "node", mine, f"{domain}-"),
                 ("annotate", "node", mine, f"{member}-")]:
        allowed = as_plugin(*args)
        assert allowed.returncode == 0, (args, allowed.stderr)
    for args, why in [
            (("label", "node", theirs, f"{clique}=c.1"), "may write only its own Node"),
            (("label", "node", mine, "team=x"), "may change only the Node labels"),
            (("label", "node", mine, "rack-"), "only the Node labels"),
            (("annotate", "node", mine, "a=b"), "may change only the Node annotations"),
            (("cordon", mine), "may not change a Node's spec")]:
        refused = as_plugin(*args)
        # (kubectl cordon exits 0 on a refused patch: the message and the Node tell.)
        assert "denied request" in refused.stderr and why in refused.stderr, \
            (args, refused.stderr)
    status, node = server.request("GET", f"/api/v1/nodes/{mine}")
    assert status == 200
    assert node["metadata"]["labels"][clique] == "c.2" and domain not in node["metadata"][
        "labels"] and "team" not in node["metadata"]["labels"]
    assert node["metadata"]["labels"]["rack"] == "r1"
    assert member not in (node["metadata"].get("annotations") or {})
    assert not node["spec"].get("unschedulable")
    assert "gpu.nodeagent.dev/fabric-clique" not in (
        server.request("GET", f"/api/v1/nodes/{theirs}")[1]["metadata"].get("labels") or {})

    uids = {n: server.request("GET", f"/api/v1/nodes/{n}")[1]["metadata"]["uid"]
            for n in (mine, theirs)}

    def owned(body: Json, owner: str) -> Json:
        body["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node",
                                                "name": owner, "uid": uids[owner],
                                                "controller": True}]
        return body

    status, stored = server.request("POST", SLICES, owned(a_slot(mine), mine),
                                    token=credential.token)
    assert status == 201, stored
    for what, body in {"a slot of another node's pool": owned(a_slot(mine, pool=theirs), mine),
                       "a slot owned by another node": owned(a_slot(mine), theirs),
                       "a slot owned by nothing": a_slot(mine)}.items():
        body["metadata"]["name"] += "-x"
        status, answer = server.request("POST", SLICES, body, token=credential.token)
        assert status == 403 and "compute-domain slot" in answer["message"], (what, answer)
    assert server.request("DELETE", f"{SLICES}/{mine}-compute-domain",
                          token=credential.token)[0] == 200


# Calls the publisher and the claim reader never make: the role grants none of them.
BEYOND = [
    ("GET", f"{SLICES}/{{node}}-x", None),  # no get: the publisher lists and watches
    ("PATCH", f"{SLICES}/{{node}}-x", {}),
    ("DELETE", f"{SLICES}?fieldSelector=spec.nodeName={{node}}", None),  # deletecollection
    ("PUT", "/api/v1/nodes/{node}", {}),  # patch only (a merge patch of its labels)
    ("DELETE", "/api/v1/nodes/{node}", None),
    ("PATCH", "/api/v1/nodes/{node}/status", {}),
    ("GET", "/api/v1/namespaces/gpu-node-agent/secrets", None),
    ("GET", "/api/v1/pods", None),
    ("DELETE", f"{CLAIMS}/x", None),  # claims: get, list (the explainer) only
    ("PUT", f"{CLAIMS}/x/status", {}),
    ("PATCH", "/api/v1/namespaces/default/events/x", {}),  # events: create only
    # Leases: the explainer's own, in the agent's namespace only.
    ("POST", "/apis/coordination.k8s.io/v1/namespaces/default/leases", {}),
    ("PUT", "/apis/coordination.k8s.io/v1/namespaces/gpu-node-agent/leases/other", {}),
    ("GET", "/apis/coordination.k8s.io/v1/namespaces/gpu-node-agent/leases", None),
    ("POST", "/apis/resource.k8s.io/v1/deviceclasses", {}),
]


@pytest.mark.parametrize("version", VERSIONS)
def test_anything_beyond_the_role_is_forbidden(version: str,
                                               guarded: Callable[[str], ApiServer],
                                               tmp_path: Path) -> None:
    """Every call outside the shipped role is refused with 403, with the plugin's token."""
    server = guarded(version)
    node = f"beyond-v{version}".replace(".", "-")
    token = plugin_credential(server, node, tmp_path).token
    answers = {f"{method} {path.format(node=node)}":
               server.request(method, path.format(node=node), body, token=token)[0]
               for method, path, body in BEYOND}
    assert answers == dict.fromkeys(answers, 403)



def allocated_claim(server: ApiServer, name: str, node: str,
                    results: list[Json]) -> Json:
    """A ResourceClaim ``name`` allocated (as the scheduler writes it) to ``results`` on
    ``node``; the claim as stored."""
    status, claim = server.request("POST", CLAIMS, {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": r["request"], "exactly": {
            "deviceClassName": "gpu.nodeagent.dev"}} for r in results]}}})
    assert status == 201, claim
    claim["status"] = {"allocation": {
        "devices": {"results": results},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
    status, claim = server.request("PUT", f"{CLAIMS}/{name}/status", claim)
    assert status == 200, claim
    return dict(claim)


def device_status(claim: Json, *entries: Json) -> Json:
    """A server-side apply body of ``claim``'s status with ``entries``."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": claim["metadata"]["name"], "namespace": "default",
                         "uid": claim["metadata"]["uid"]},
            "status": {"devices": list(entries)}}


def status_entry(pool: str, device: str = "gpu-0", driver: str = DRIVER) -> Json:
    return {"driver": driver, "pool": pool, "device": device, "conditions": [
        {"type": "Ready", "status": "True", "reason": "Prepared", "message": "",
         "lastTransitionTime": "2026-12-02T16:40:01Z"}], "data": {"uuid": "GPU-x"}}


@pytest.mark.parametrize("version", VERSIONS)
def test_the_plugin_writes_device_status_of_its_own_nodes_claims_only(
        version: str, guarded: Callable[[str], ApiServer], tmp_path: Path) -> None:
    """With the plugin's bound token for node A and the shipped role and policies, a
    server-side apply of device status entries of its driver and pool into a claim allocated
    on A is stored and an apply without them removes them; an entry in a claim allocated on
    node B, another driver's entry, and a change of the claim's consumers are refused (1.34:
    the admission policy, 403 naming why; 1.37: first the server's own per-driver and
    binding checks, 422 naming the synthetic resourceclaims/driver or /binding permission)."""
    server = guarded(version)
    mine, theirs = (f"{n}-v{version}".replace(".", "-") for n in ("status-a", "status-b"))
    credential = plugin_credential(server, mine, tmp_path)
    server.ensure_node(theirs)
    own = allocated_claim(server, f"claim-{mine}", mine, [
        {"request": "gpu", "driver": DRIVER, "pool": mine, "device": "gpu-0"},
        {"request": "nic", "driver": "other.example.com", "pool": mine, "device": "nic-0"}])
    other = allocated_claim(server, f"claim-{theirs}", theirs, [
        {"request": "gpu", "driver": DRIVER, "pool": theirs, "device": "gpu-0"}])
    policy = "ValidatingAdmissionPolicy 'gpu-node-agent-resourceclaim-status'"

    async def scenario() -> dict[str, Any]:
        kube = await KubeClient.from_environment(credential.kubeconfig)
        seen: dict[str, Any] = {}

        async def apply(what: str, name: str, body: Json) -> None:
            try:
                seen[what] = await kube.apply_claim_status("default", name, body,
                                                           field_manager=DRIVER)
            except KubeError as err:
                seen[what] = err
        try:
            # The policy's binding is loaded a moment after it is created: wait until the
            # plugin is refused another node's claim, then try the rest. Each try changes
            # the entry: a try stored before the policy was loaded would make the same one
            # again a no-op that no policy refuses.
            tries = iter(range(1_000_000))

            async def refused() -> bool:
                entry = status_entry(theirs)
                entry["conditions"][0]["message"] = f"try {next(tries)}"
                await apply("another node's claim", other["metadata"]["name"],
                            device_status(other, entry))
                return isinstance(seen["another node's claim"], KubeError)
            await waiting.until(refused, "the policy refusing another node's claim",
                                timeout_s=30, every_s=0.2)
            name = own["metadata"]["name"]
            await apply("its own", name, device_status(own, status_entry(mine)))
            await apply("removed", name, device_status(own))
            await apply("another driver's entry", name, device_status(
                own, status_entry(mine, "nic-0", "other.example.com")))
            body = device_status(own)
            body["status"]["reservedFor"] = [{"resource": "pods", "name": "p",
                                              "uid": "00000000-0000-0000-0000-000000000001"}]
            await apply("its consumers", name, body)
        finally:
            await kube.close()
        return seen

    seen = asyncio.run(scenario())
    assert [(d["pool"], d["device"]) for d in seen["its own"]["status"]["devices"]] == [
        (mine, "gpu-0")], seen["its own"]
    assert seen["its own"]["status"]["devices"][0]["data"] == {"uuid": "GPU-x"}
    assert not seen["removed"]["status"].get("devices"), seen["removed"]
    refusals = {"another node's claim": "resourceclaims/driver",
                "another driver's entry": "resourceclaims/driver",
                "its consumers": "resourceclaims/binding"}
    for what, synthetic in refusals.items():
        err = seen[what]
        assert isinstance(err, KubeError), (what, err)
        if version == "1.34":
            assert err.status == 403 and policy in str(err), (what, err)
        else:
            assert err.status == 422 and synthetic in str(err), (what, err)
    if version == "1.34":
        assert f"pool {mine}" in str(seen["another node's claim"])
        assert "may change only status.devices" in str(seen["its consumers"])
