"""The shipped DeviceClasses (daemonset/base/deviceclasses.yaml) and the worked examples of
docs/kubernetes.md (daemonset/examples/) as an SRE applies them: accepted by a real
kube-apiserver, and each example's claim allocated by the scheduler's allocator from the
slices a real agent publishes for the node the example targets (and refused where the
example says it must be)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.agent_process import AgentProcess
from tests.k8s.conftest import StartAgent
from tests.k8s.fixtures import DRA_GATES, StartApiServer
from tests.k8s.harness import ROOT, SLICE_RULES, VERSIONS, ApiServer, allocate
from tests.k8s.objects import DRIVER, RESOURCE, devices_of
from tests.k8s.published import set_mig, slices_of

CLASSES = ROOT / "daemonset" / "base" / "deviceclasses.yaml"
EXAMPLES = ROOT / "daemonset" / "examples"
NODE = "deploy-node"
NAMESPACE = "deploy-examples"
Json = dict[str, Any]


def documents(path: Path) -> list[Json]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


#: An example's claim object: a template each pod gets a claim of, or one claim its pods share.
CLAIM_KINDS = {"ResourceClaimTemplate": ("resourceclaimtemplates", "resourceClaimTemplateName"),
               "ResourceClaim": ("resourceclaims", "resourceClaimName")}


def claim_object(example: str) -> Json:
    """The example's ResourceClaimTemplate or ResourceClaim (there is one of them)."""
    [made] = [d for d in documents(EXAMPLES / example) if d["kind"] in CLAIM_KINDS]
    return made


def claim_spec(made: Json) -> Json:
    """The ResourceClaim spec of a template or a claim."""
    return made["spec"]["spec"] if made["kind"] == "ResourceClaimTemplate" else made["spec"]


def ensure_namespace(server: ApiServer, namespace: str) -> None:
    if server.kubectl("get", "namespace", namespace, check=False).returncode != 0:
        server.kubectl("create", "namespace", namespace)


def claim_of(server: ApiServer, example: str) -> Json:
    """The ResourceClaim the example's pod gets: its template or its claim as the server
    stored it after `kubectl apply` (with the API's defaults, such as allocationMode
    ExactCount)."""
    ensure_namespace(server, NAMESPACE)
    server.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLES / example))
    made = claim_object(example)
    name = made["metadata"]["name"]
    resource, _ = CLAIM_KINDS[made["kind"]]
    status, stored = server.request(
        "GET", f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/{resource}/{name}")
    assert status == 200, stored
    return {"apiVersion": RESOURCE, "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": str(uuid.uuid4())},
            "spec": claim_spec({**made, "spec": stored["spec"]})}


def attribute(device: Json, name: str) -> Any:
    value = device.get("attributes", {}).get(name)
    return None if value is None else next(iter(value.values()))


@pytest.mark.parametrize("version", VERSIONS)
def test_shipped_classes_and_examples_are_accepted(version: str,
                                                   kube_apiservers: StartApiServer) -> None:
    """`kubectl apply` of the DeviceClasses and of every example succeeds on the real
    server (its validation compiles each CEL selector), and each example's pods name the
    claim template or the claim that came with it, as the server stored them."""
    server = kube_apiservers(version)
    namespace = NAMESPACE
    ensure_namespace(server, namespace)
    server.kubectl("apply", "-f", str(CLASSES))
    applied = {path.name: server.kubectl("apply", "-n", namespace, "-f", str(path)).stdout
               for path in sorted(EXAMPLES.glob("*.yaml"))}
    assert set(applied) == {"compute-domain.yaml", "dynamic-mig.yaml", "full-gpu.yaml",
                            "memory-share.yaml", "mig-1g10gb.yaml", "mps-shared.yaml",
                            "tensor-parallel-4gpu.yaml", "time-slicing.yaml"}
    classes = {d["metadata"]["name"] for d in documents(CLASSES)}
    status, listing = server.request("GET", "/apis/resource.k8s.io/v1/deviceclasses")
    assert status == 200 and classes <= {c["metadata"]["name"] for c in listing["items"]}
    for name in sorted(applied):
        if name == DOMAIN_EXAMPLE:
            continue  # a Job's pods sharing a claim: test_the_domain_example_is_accepted
        made = claim_object(name)
        _, key = CLAIM_KINDS[made["kind"]]
        pods = [d for d in documents(EXAMPLES / name) if d["kind"] == "Pod"]
        assert pods
        for pod in pods:
            status, stored = server.request(
                "GET", f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}")
            assert status == 200, stored
            assert [c.get(key) for c in stored["spec"]["resourceClaims"]] == [
                made["metadata"]["name"]]
        for request in claim_spec(made)["devices"]["requests"]:
            assert request["exactly"]["deviceClassName"] in classes


DOMAIN_EXAMPLE = "compute-domain.yaml"


@pytest.mark.parametrize("version", VERSIONS)
def test_the_domain_example_is_accepted(version: str, kube_apiservers: StartApiServer) -> None:
    """The compute-domain example as the server stores it: the shared claim asks for four
    slots of the compute-domain class on one fabricClique, the template for four GPUs, and
    the Job's pods name both (placement: tests/k8s/test_compute_domains.py)."""
    server = kube_apiservers(version)
    ensure_namespace(server, NAMESPACE)
    server.kubectl("apply", "-f", str(CLASSES))
    server.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLES / DOMAIN_EXAMPLE))
    status, claim = server.request(
        "GET", f"/apis/{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims/training-domain")
    assert status == 200, claim
    (request,) = claim["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "compute-domain.gpu.nodeagent.dev"
    assert request["exactly"]["count"] == 4
    assert claim["spec"]["devices"]["constraints"] == [
        {"requests": ["nodes"], "matchAttribute": "gpu.nodeagent.dev/fabricClique"}]
    job = json.loads(server.kubectl("get", "job", "-n", NAMESPACE,
                                    "tensor-parallel-across-nodes", "-o", "json").stdout)
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == 4
    assert job["spec"]["template"]["spec"]["resourceClaims"] == [
        {"name": "domain", "resourceClaimName": "training-domain"},
        {"name": "gpus", "resourceClaimTemplateName": "four-gb200-gpus"}]


Check = Callable[[list[Json], AgentProcess], None]


@dataclass(frozen=True)
class Example:
    """One example's claim on one kind of node: the devices it must get (``expect`` checks
    the allocated devices), or None where the allocator must refuse it; ``consumed``: the
    memory each allocated device must be a share of (None: each is whole, no share)."""

    file: str
    preset: str
    expect: Check | None
    dynamic_mig: bool = False
    gpu_shares: bool = False
    geometry: tuple[tuple[int, tuple[str, ...]], ...] = ()
    consumed: str | None = None

    @property
    def id(self) -> str:
        return "-".join([self.file.removesuffix(".yaml"), self.preset,
                         *(["dynamic"] if self.dynamic_mig else []),
                         *(["shares"] if self.gpu_shares else []),
                         *(["mig"] if self.geometry else []),
                         "fits" if self.expect else "refused"])


def whole_h100(devices: list[Json], agent: AgentProcess) -> None:
    """The first whole GPU: an H100 of 80 GB."""
    assert [d["name"] for d in devices] == ["gpu-0"]
    assert attribute(devices[0], "productName").startswith("NVIDIA H100")


def existing_1g10gb(devices: list[Json], agent: AgentProcess) -> None:
    """One MIG device that exists (it has a UUID), of profile 1g.10gb, on GPU 0."""
    (device,) = devices
    assert attribute(device, "profile") == "1g.10gb" and attribute(device, "uuid")
    assert device["name"].startswith("gpu-0-mig-1g10gb")


def placement_3g40gb(devices: list[Json], agent: AgentProcess) -> None:
    """A 3g.40gb placement to be created at prepare (no UUID yet) on the first GPU."""
    (device,) = devices
    assert attribute(device, "profile") == "3g.40gb" and attribute(device, "uuid") is None
    assert attribute(device, "parentUUID") == agent.request("GET", "/v1/gpus/0").body["uuid"]


def one_island(devices: list[Json], agent: AgentProcess) -> None:
    """Four whole GPUs sharing one nvlinkIsland value."""
    assert [d["name"] for d in devices] == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    assert len({attribute(d, "nvlinkIsland") for d in devices}) == 1


def whole_l40s(devices: list[Json], agent: AgentProcess) -> None:
    """The first GPU of the node, an L40S (whole, or a share of it where ``consumed`` says)."""
    assert [d["name"] for d in devices] == ["gpu-0"]
    assert attribute(devices[0], "productName").startswith("NVIDIA L40S")


CASES = [
    Example("full-gpu.yaml", "dgx-h100", whole_h100),
    Example("full-gpu.yaml", "a100-pcie-bridged", None),  # not an H100
    Example("full-gpu.yaml", "l40s", None),
    Example("full-gpu.yaml", "hgx-h200", None),  # 141 GB, but an H200
    Example("mig-1g10gb.yaml", "dgx-h100", existing_1g10gb,
            geometry=((0, ("3g.40gb", "1g.10gb")),)),
    Example("mig-1g10gb.yaml", "dgx-h100", None),  # no MIG geometry set
    Example("mig-1g10gb.yaml", "dgx-h100", None, dynamic_mig=True),  # placements only
    Example("dynamic-mig.yaml", "dgx-h100", placement_3g40gb, dynamic_mig=True),
    Example("dynamic-mig.yaml", "dgx-h100", None),  # no --dynamic-mig: no placements
    Example("tensor-parallel-4gpu.yaml", "dgx-h100", one_island),
    Example("tensor-parallel-4gpu.yaml", "a100-pcie-bridged", None),  # pairs only
    # The sharing examples ask class share.nodeagent.dev: GPUs published as shareable only.
    # A claim naming no memory takes all of a shareable GPU (its request policy's default).
    Example("mps-shared.yaml", "l40s", whole_l40s, gpu_shares=True, consumed="44Gi"),
    Example("mps-shared.yaml", "l40s", None),  # no --gpu-shares: nothing shareable
    Example("mps-shared.yaml", "a100-pcie-bridged", None),
    Example("time-slicing.yaml", "l40s", whole_l40s, gpu_shares=True, consumed="44Gi"),
    Example("time-slicing.yaml", "a100-pcie-bridged", None),
    Example("memory-share.yaml", "l40s", whole_l40s, gpu_shares=True, consumed="10Gi"),
    # Without --gpu-shares a capacity request of a device that allows one allocation would be
    # a minimum (the whole GPU, not a share of it): the share class matches no such device.
    Example("memory-share.yaml", "l40s", None),
    Example("memory-share.yaml", "a100-pcie-bridged", None),
    Example("memory-share.yaml", "dgx-h100", None),
]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_example_claims_are_allocated_where_they_fit(version: str, case: Example,
                                                     kube_apiservers: StartApiServer,
                                                     agent_node: StartAgent) -> None:
    """Each example's claim, with the shipped DeviceClasses, is allocated by the scheduler's
    allocator on the node kind it targets, with the devices the docs promise; on a node
    that cannot satisfy it, nothing is allocated; a share only where the example asks for one
    of a node with --gpu-shares. The claim is the template or the claim as the real server
    stored it."""
    agent = agent_node(case.preset, node_name=NODE, dynamic_mig=case.dynamic_mig,
                       extra=("--gpu-shares",) if case.gpu_shares else ())
    for gpu, profiles in case.geometry:
        set_mig(agent, gpu, list(profiles))
    slices = slices_of(agent, SLICE_RULES[version])
    answer = allocate(version, node=NODE, slices=slices, classes=documents(CLASSES),
                      claims=[claim_of(kube_apiservers(version), case.file)],
                      feature_gates=DRA_GATES[version])
    if case.expect is None:
        assert not answer.allocated, answer.results
        return
    assert answer.allocated, answer.reason
    results = answer.results[0]["allocation"]["devices"]["results"]
    assert {(r["driver"], r["pool"]) for r in results} == {(DRIVER, NODE)}
    offered = devices_of(slices)
    case.expect([offered[name] for name in answer.devices()], agent)
    for result in results:
        shared = (result.get("consumedCapacity"), "shareID" in result)
        assert shared == (({"memory": case.consumed}, True) if case.consumed else (None, False))


@pytest.mark.parametrize(("least", "fits"), [("80G", True), ("79Gi", True), ("80Gi", False),
                                             ("90G", False)])
def test_full_gpu_example_selects_on_memory(least: str, fits: bool,
                                            kube_apiservers: StartApiServer,
                                            agent_node: StartAgent) -> None:
    """The full-GPU example's memory clause is live: an H100 80GB HBM3 (81,559 MiB) has at
    least 80G and 79Gi, not 80Gi or 90G."""
    version = VERSIONS[-1]
    agent = agent_node("dgx-h100", node_name=NODE)
    claim = claim_of(kube_apiservers(version), "full-gpu.yaml")
    (selector,) = claim["spec"]["devices"]["requests"][0]["exactly"]["selectors"]
    assert 'quantity("80G")' in selector["cel"]["expression"]
    selector["cel"]["expression"] = selector["cel"]["expression"].replace(
        'quantity("80G")', f'quantity("{least}")')
    answer = allocate(version, node=NODE, slices=slices_of(agent, SLICE_RULES[version]),
                      classes=documents(CLASSES), claims=[claim],
                      feature_gates=DRA_GATES[version])
    assert answer.allocated is fits, answer.reason


@pytest.mark.parametrize(("version", "kept"), [("1.34", False), ("1.37", True)])
def test_extended_resource_name_is_kept_only_where_the_feature_is(
        version: str, kept: bool, kube_apiservers: StartApiServer) -> None:
    """The shipped GPU class with ``extendedResourceName: nvidia.com/gpu`` (what the Helm
    chart's ``deviceClasses.gpu.extendedResourceName`` sets): a 1.37 server keeps it
    (DRAExtendedResource, GA); a 1.34 server, where the gate is alpha and off, accepts the
    class and drops the field silently, so a legacy pod there stays pending on a resource no
    node has (docs/kubernetes.md, "Pods that ask for nvidia.com/gpu")."""
    server = kube_apiservers(version)
    [gpu] = [d for d in documents(CLASSES) if d["metadata"]["name"] == "gpu.nodeagent.dev"]
    assert "extendedResourceName" not in gpu["spec"]  # absent as shipped
    # Under a name of its own: the shared server may hold the shipped class already.
    legacy = {**gpu, "metadata": {"name": "extended-probe.nodeagent.dev"},
              "spec": {**gpu["spec"], "extendedResourceName": "nvidia.com/gpu"}}
    stored = json.loads(server.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                                       stdin=json.dumps(legacy)).stdout)
    assert stored["spec"].get("extendedResourceName") == ("nvidia.com/gpu" if kept else None)
    assert stored["spec"]["selectors"] == gpu["spec"]["selectors"]


DOC = ROOT / "docs" / "kubernetes.md"


def documented_attribute_examples() -> list[tuple[str, str]]:
    """(attribute, example value) pairs of docs/kubernetes.md's attribute table, for the rows
    on whole GPUs ("all", "GPUs"): the row's attribute names paired in order with its
    backticked examples; a name without its own domain gets the row's first one's, and a
    pattern (``GPU-…``) is no value."""
    section = DOC.read_text().split("## Attributes and capacity to select on", 1)[1]
    pairs = []
    for line in section.split("\n\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        if not cells[3].startswith(("all", "GPUs")):
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        domain = names[0].rsplit("/", 1)[0] + "/" if "/" in names[0] else ""
        names = [n if "/" in n else domain + n for n in names]
        for name, value in zip(names, re.findall(r"`([^`]+)`", cells[2]), strict=False):
            if "…" not in value and "<" not in value:
                pairs.append((name, value))
    return pairs


def test_the_documented_attribute_examples_are_what_a_dgx_h100_publishes(
        agent_node: StartAgent) -> None:
    """Each example value in docs/kubernetes.md's attribute table is what a real agent on a
    simulated DGX H100 publishes for its first GPU (with ``--gpu-shares`` for ``shareable``),
    so a selector copied from the table matches: nvlinkBandwidth 450 GB/s per direction, not
    NVLink 4's 900 GB/s total."""
    examples = documented_attribute_examples()
    assert ("nvlinkBandwidth", "450") in examples and ("shareable", "true") in examples
    agent = agent_node("dgx-h100", node_name=NODE, extra=("--gpu-shares",))
    gpu0 = devices_of(slices_of(agent, SLICE_RULES[VERSIONS[-1]]))["gpu-0"]
    published = {name: next(iter(v.values())) for name, v in gpu0["attributes"].items()}
    for name, value in examples:
        shown = str(published.get(name)).lower() if isinstance(published.get(name), bool) \
            else str(published.get(name))
        assert shown == value, f"docs/kubernetes.md shows {name} = {value}; published: {shown}"
