"""A Pod and its ResourceClaim through the real stack (tests/k8s/stack.py): created in the
API server, allocated as the scheduler does, prepared through kubelet, injected by the CDI
reference library. The claims come from the shipped examples where one fits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.k8s.harness import AllocationAnswer, allocate_in_cluster
from tests.k8s.objects import pod
from tests.k8s.stack import DEVICE_CLASSES, ROOT, Stack, apply_shipped

Json = dict[str, Any]
EXAMPLES = ROOT / "daemonset" / "examples"


def example_claim(example: str, name: str, *, namespace: str = "default") -> Json:
    """A ResourceClaim ``name`` with the device spec of the ResourceClaimTemplate in
    daemonset/examples/``example`` (no resource-claim controller runs to stamp one out)."""
    docs = [d for d in yaml.safe_load_all((EXAMPLES / example).read_text()) if d]
    [template] = [d for d in docs if d["kind"] == "ResourceClaimTemplate"]
    return {"apiVersion": template["apiVersion"], "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": template["spec"]["spec"]}


def claim_with_selector(base: Json, expression: str) -> Json:
    """``base`` with one more CEL selector on its (single) request."""
    [req] = base["spec"]["devices"]["requests"]
    req["exactly"].setdefault("selectors", []).append({"cel": {"expression": expression}})
    return base


def create_pod(stack: Stack, name: str, claim: Json) -> None:
    """The shipped DeviceClasses, ``claim`` and a Pod ``name`` on the stack's node using it."""
    apply_shipped(stack.server, DEVICE_CLASSES)
    namespace = claim["metadata"].get("namespace", "default")
    stack.server.apply([claim, pod(name, {"c": claim["metadata"]["name"]}, namespace=namespace,
                                   node_name=stack.node)])


def allocate(stack: Stack, name: str, *, namespace: str = "default",
             feature_gates: str = "") -> AllocationAnswer:
    """Allocate pod ``name``'s claim (same name) in the server, as the scheduler does, once
    the server's slices are the agent's current ones (a scheduler that met a pool mid-update
    would retry; a refusal asserted here is then a refusal of what the node offers)."""
    stack.wait_current()
    return allocate_in_cluster(stack.server, node=stack.node, claims=[f"{namespace}/{name}"],
                               pod=f"{namespace}/{name}", feature_gates=feature_gates)


def prepare_and_inject(stack: Stack, name: str, *,
                       namespace: str = "default") -> tuple[list[str], Json]:
    """Prepare pod ``name`` through kubelet -> plugin -> agent; the container's CDI IDs and
    what the CDI reference library injected for them from the agent's CDI dir."""
    assert stack.kubelet is not None
    prepared = stack.kubelet.prepare(f"{namespace}/{name}")
    assert prepared["ok"], f"{prepared}\n{stack.plugin.log()}"
    ids = list(prepared["containers"]["main"])
    assert ids, prepared
    injected = stack.kubelet.cdi_inject(ids, [stack.cdi_dir])
    assert injected["ok"] and injected["unresolved"] == [], injected
    assert "inject_error" not in injected and injected["spec_errors"] == {}, injected
    return ids, injected


def unprepare(stack: Stack, name: str, *, namespace: str = "default") -> None:
    assert stack.kubelet is not None
    answer = stack.kubelet.unprepare(f"{namespace}/{name}")
    assert answer["ok"], f"{answer}\n{stack.plugin.log()}"


def device_paths(injected: Json) -> set[str]:
    return {n["path"] for n in injected["device_nodes"]}


def claim_uid(stack: Stack, name: str, namespace: str = "default") -> str:
    status, stored = stack.server.request(
        "GET", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}")
    assert status == 200, stored
    return str(stored["metadata"]["uid"])


def claim_specs(stack: Stack) -> list[Path]:
    """The CDI spec files the agent's claims name (each must exist in its --cdi-dir)."""
    specs = [Path(c["cdi_spec"]) for c in stack.agent_claims() if c["cdi_spec"]]
    assert all(p.parent == stack.cdi_dir and p.is_file() for p in specs), specs
    return specs
