"""The CEL of the manifests, judged by Kubernetes's own code (tests/deploy/celcheck: the
scheduler's device-selector compiler and the admission plugin's policy compiler, as go.mod
pins them): the DeviceClasses and the worked examples against the slices the agent renders,
and the ResourceSlice and Node admission policies against the requests they must allow and
deny."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import gobuild
from tests.dra.conftest import Env, MakeEnv, make_env

from .manifests import by_name, render
from .tools import ROOT

__all__ = ["make_env"]  # the renderer's fixture: a simulated node and its ResourceSliceService

CELCHECK = Path(__file__).resolve().parent / "celcheck"
DRIVER = "gpu.nodeagent.dev"
ACCOUNT = "system:serviceaccount:gpu-node-agent:gpu-node-agent"
NODE_KEY = "authentication.kubernetes.io/node-name"
EXAMPLES = ROOT / "daemonset" / "examples"
#: The layouts of the oldest and the newest Kubernetes the renderer knows.
VERSION = (1, 35)


@pytest.fixture(scope="session")
def celcheck() -> Any:
    """``check(input) -> output`` through the Go program, built once per session (minutes
    cold: Kubernetes's apiserver packages)."""
    binary = gobuild.build(CELCHECK, gobuild.BUILD / "celcheck" / "celcheck", timeout_s=1800)

    def check(given: dict[str, Any]) -> dict[str, Any]:
        done = subprocess.run([str(binary)], input=json.dumps(given), capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        out: dict[str, Any] = json.loads(done.stdout)
        return out

    return check


def _classes() -> dict[str, str]:
    return {d["metadata"]["name"]: d["spec"]["selectors"][0]["cel"]["expression"]
            for d in render("daemonset") if d["kind"] == "DeviceClass"}


def _devices(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"driver": s["spec"]["driver"], "device": d}
            for s in slices for d in s["spec"].get("devices") or []]


def _attr(device: dict[str, Any], name: str) -> Any:
    value = device["device"].get("attributes", {}).get(name)
    return None if value is None else next(iter(value.values()))


def _h100_geometry(env: Env) -> None:
    """GPU 0: 3g@0 + 2g@4 + 1g@6; GPU 1: MIG on, no instance; the rest whole."""
    env.make_mig(0, [(9, 0), (14, 4), (19, 6)])
    env.make_mig(1, [])


def _example_requests() -> dict[str, tuple[str, str | None]]:
    """Each example request, by its template's or claim's name: (its DeviceClass, its own
    selector or None)."""
    out = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] in ("ResourceClaimTemplate", "ResourceClaim"):
                template = doc["kind"] == "ResourceClaimTemplate"
                spec = doc["spec"]["spec"] if template else doc["spec"]
                for request in spec["devices"]["requests"]:
                    exactly = request["exactly"]
                    selectors = [s["cel"]["expression"] for s in exactly.get("selectors", [])]
                    assert len(selectors) <= 1
                    out[doc["metadata"]["name"]] = (exactly["deviceClassName"],
                                                    selectors[0] if selectors else None)
    return out


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic-mig"])
async def test_each_device_is_in_exactly_its_class(make_env: MakeEnv, celcheck: Any,
                                                   dynamic: bool) -> None:
    """Every device the agent publishes matches exactly one DeviceClass, without an
    evaluation error: whole GPUs gpu, existing MIG instances mig, placements the agent would
    create dynamic-mig (there only with --dynamic-mig)."""
    env = await make_env("dgx-h100", dynamic_mig=dynamic, setup=_h100_geometry)
    devices = _devices(await env.resource_slices.of_version(VERSION))
    classes = _classes()
    out = celcheck({"selectors": [{"name": n, "expression": e} for n, e in classes.items()],
                    "devices": devices})["selectors"]
    expected: dict[str, set[str]] = {name: set() for name in classes}
    for d in devices:
        kind = _attr(d, "type")
        cls = "gpu" if kind == "gpu" else "mig" if _attr(d, "uuid") else "dynamic-mig"
        expected[f"{cls}.{DRIVER.split('.', 1)[1]}"].add(d["device"]["name"])
    for name in classes:
        assert "error" not in out[name], out[name]
        assert not out[name].get("eval_errors"), out[name]["eval_errors"]
        assert set(out[name]["matches"]) == expected[name], name
    suffix = DRIVER.split(".", 1)[1]
    assert expected[f"gpu.{suffix}"] and expected[f"mig.{suffix}"]
    assert bool(expected[f"dynamic-mig.{suffix}"]) is dynamic  # static: nothing to create


#: (preset, dynamic MIG, example template) -> the devices its request may get.
EXAMPLE_CASES = [
    ("dgx-h100", False, "h100-80gb", {f"gpu-{i}" for i in range(2, 8)}),
    ("dgx-a100", False, "h100-80gb", set()),  # an A100 is neither an H100 nor 80 GB
    ("dgx-h100", False, "mig-1g10gb", {"gpu-0-mig-1g10gb-19-6"}),
    ("dgx-h100", True, "mig-1g10gb", {"gpu-0-mig-1g10gb-19-6"}),
    ("dgx-h100", False, "dynamic-mig-3g40gb", set()),
    ("dgx-h100", True, "dynamic-mig-3g40gb", {"gpu-1-mig-3g40gb-9-0", "gpu-1-mig-3g40gb-9-4"}
     | {f"gpu-{i}-mig-3g40gb-9-{s}" for i in range(2, 8) for s in (0, 4)}),
    # The sharing examples ask share.nodeagent.dev: only GPUs published as shareable (agent
    # --gpu-shares; tests/k8s/test_deploy.py and test_scheduler.py place them there), never
    # a GPU that is not.
    ("l40s", False, "mps-shared-gpu", set()),
    ("l40s", False, "gpu-10gi-share", set()),
    ("l40s", False, "time-sliced-gpu", set()),
    ("dgx-h100", False, "mps-shared-gpu", set()),
]


@pytest.mark.parametrize("case", EXAMPLE_CASES, ids=lambda c: f"{c[2]}-on-{c[0]}-{c[1]}")
async def test_example_claims_select_what_the_docs_say(
        make_env: MakeEnv, celcheck: Any, case: tuple[str, bool, str, set[str]]) -> None:
    """A worked example's request (its class's selector, then its own, as the scheduler
    applies them) selects exactly the devices docs/kubernetes.md promises, and no device
    makes it fail with an evaluation error."""
    preset, dynamic, template, wanted = case
    setup = _h100_geometry if preset == "dgx-h100" else None
    env = await make_env(preset, dynamic_mig=dynamic, setup=setup)
    devices = _devices(await env.resource_slices.of_version(VERSION))
    cls, own = _example_requests()[template]
    expression = f"({_classes()[cls]}) && ({own})" if own else _classes()[cls]
    out = celcheck({"selectors": [{"name": template, "expression": expression}],
                    "devices": devices})["selectors"][template]
    assert "error" not in out and not out.get("eval_errors"), out
    assert set(out["matches"]) == wanted


@pytest.mark.parametrize(("preset", "largest_island"), [("dgx-h100", 8),
                                                        ("a100-pcie-bridged", 2)])
async def test_nvlink_islands_for_the_tensor_parallel_example(
        make_env: MakeEnv, preset: str, largest_island: int) -> None:
    """The 4-GPU example's matchAttribute can hold only inside one NVLink island: every whole
    GPU carries nvlinkIsland, eight share one on a DGX H100, and no four on the bridged
    A100 pairs (the pod stays pending there)."""
    (_, own) = _example_requests()["four-nvlinked-gpus"]
    assert own is None
    env = await make_env(preset)
    gpus = [d for d in _devices(await env.resource_slices.of_version(VERSION))
            if _attr(d, "type") == "gpu"]
    islands: dict[str, int] = {}
    for d in gpus:
        island = _attr(d, "nvlinkIsland")
        assert island is not None, d["device"]["name"]
        islands[island] = islands.get(island, 0) + 1
    assert max(islands.values()) == largest_island


def _slice(node: str | None, driver: str = DRIVER) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": driver, "pool": {"name": node or "all", "generation": 1,
                                                        "resourceSliceCount": 1}}
    spec.update({"nodeName": node} if node else {"allNodes": True})
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{driver}-0"}, "spec": spec}


def _slot(pool_node: str, owner: str | None) -> dict[str, Any]:
    """A compute-domain slot's slice: pool ``<pool_node>/compute-domain``, a nodeSelector,
    owned by Node ``owner`` (None: by nothing)."""
    metadata: dict[str, Any] = {"name": f"{pool_node}-compute-domain"}
    if owner is not None:
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": owner,
                                        "uid": f"{owner}-uid", "controller": True}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": metadata,
            "spec": {"driver": DRIVER, "pool": {"name": f"{pool_node}/compute-domain",
                                                "generation": 1, "resourceSliceCount": 1},
                     "nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [
                         {"key": f"{DRIVER}/fabric-clique", "operator": "In",
                          "values": ["c.1"]}]}]},
                     "devices": []}}


ON_N1 = {NODE_KEY: ["n1"]}
#: name -> (operation, user, user extra, object, old object, allowed)
POLICY_CASES: dict[str, tuple[str, str, dict[str, list[str]], Any, Any, bool]] = {
    "create own node": ("CREATE", ACCOUNT, ON_N1, _slice("n1"), None, True),
    "update own node": ("UPDATE", ACCOUNT, ON_N1, _slice("n1"), _slice("n1"), True),
    "delete own node": ("DELETE", ACCOUNT, ON_N1, None, _slice("n1"), True),
    "create another node": ("CREATE", ACCOUNT, ON_N1, _slice("n2"), None, False),
    "delete another node": ("DELETE", ACCOUNT, ON_N1, None, _slice("n2"), False),
    "move a slice here": ("UPDATE", ACCOUNT, ON_N1, _slice("n1"), _slice("n2"), False),
    "move a slice away": ("UPDATE", ACCOUNT, ON_N1, _slice("n2"), _slice("n1"), False),
    "a cluster-wide slice": ("CREATE", ACCOUNT, ON_N1, _slice(None), None, False),
    "another driver": ("CREATE", ACCOUNT, ON_N1, _slice("n1", "other.example.com"), None, False),
    "no node in the token": ("CREATE", ACCOUNT, {}, _slice("n1"), None, False),
    "another user is not judged": ("CREATE", "system:node:n2", {}, _slice("n2"), None, True),
    "create own slot": ("CREATE", ACCOUNT, ON_N1, _slot("n1", "n1"), None, True),
    "update own slot": ("UPDATE", ACCOUNT, ON_N1, _slot("n1", "n1"), _slot("n1", "n1"), True),
    "delete own slot": ("DELETE", ACCOUNT, ON_N1, None, _slot("n1", "n1"), True),
    "another node's slot": ("CREATE", ACCOUNT, ON_N1, _slot("n2", "n2"), None, False),
    "a slot owned by another node": ("CREATE", ACCOUNT, ON_N1, _slot("n1", "n2"), None, False),
    "a slot owned by nothing": ("CREATE", ACCOUNT, ON_N1, _slot("n1", None), None, False),
    "delete another node's slot": ("DELETE", ACCOUNT, ON_N1, None, _slot("n2", "n2"), False),
}


def test_the_policy_lets_a_plugin_write_only_its_own_nodes_slices(celcheck: Any) -> None:
    """The admission policy, compiled as the API server compiles it, admits the plugin's
    writes of its own node's slices of its driver and denies every other write by it;
    other users' writes are not its business."""
    policy = copy.deepcopy(by_name(render("daemonset"), "ValidatingAdmissionPolicy",
                                   "gpu-node-agent-resourceslices"))
    requests = [{"name": name, "operation": op, "user": user, "extra": extra, "object": new,
                 "oldObject": old} for name, (op, user, extra, new, old, _) in POLICY_CASES.items()]
    out = celcheck({"policy": policy, "requests": requests})["requests"]
    for name, (*_, allowed) in POLICY_CASES.items():
        assert out[name]["allowed"] is allowed, (name, out[name])
        assert out[name]["matched"] is (name != "another user is not judged"), name
        if not allowed:
            assert not any("compil" in m or "error" in m.lower() for m in out[name]["messages"]), \
                out[name]["messages"]  # denied by a rule, not by a broken expression
    assert any("n1" in m for m in out["create another node"]["messages"])


def _node(name: str, *, labels: dict[str, str] | None = None,
          annotations: dict[str, str] | None = None,
          unschedulable: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": {"kubernetes.io/hostname": name,
                                                         **(labels or {})}}
    if annotations:
        metadata["annotations"] = annotations
    spec: dict[str, Any] = {"podCIDR": "10.0.0.0/24"}
    if unschedulable:
        spec["unschedulable"] = True
    return {"apiVersion": "v1", "kind": "Node", "metadata": metadata, "spec": spec}


CLIQUE_LABEL = f"{DRIVER}/fabric-clique"
DOMAIN_LABEL = f"{DRIVER}/compute-domain"
MEMBER = f"{DRIVER}/compute-domain-member"
STATE = "nvidia.com/mig.config.state"
#: name -> (node object, old node object, allowed in the base, allowed with mig-manager)
NODE_CASES: dict[str, tuple[Any, Any, bool, bool]] = {
    "own clique label set": (_node("n1", labels={CLIQUE_LABEL: "c.1"}), _node("n1"), True, True),
    "own clique label removed": (_node("n1"), _node("n1", labels={CLIQUE_LABEL: "c.1"}),
                                 True, True),
    "own domain label": (_node("n1", labels={DOMAIN_LABEL: "uid-1"}), _node("n1"), True, True),
    "own member annotation": (_node("n1", annotations={MEMBER: "{}"}), _node("n1"), True, True),
    "another node's clique label": (_node("n2", labels={CLIQUE_LABEL: "c.1"}), _node("n2"),
                                    False, False),
    "another label": (_node("n1", labels={"team": "x"}), _node("n1"), False, False),
    "another label removed": (_node("n1"), _node("n1", labels={"team": "x"}), False, False),
    "another annotation": (_node("n1", annotations={"a": "b"}), _node("n1"), False, False),
    "a spec change (cordon)": (_node("n1", unschedulable=True), _node("n1"), False, False),
    "the mig state label": (_node("n1", labels={STATE: "success"}), _node("n1"), False, True),
}


@pytest.mark.parametrize(("tree", "column"), [("daemonset", 2),
                                             ("daemonset/overlays/mig-manager", 3)])
def test_the_node_policy_lets_a_plugin_change_only_its_own_nodes_domain_keys(
        celcheck: Any, tree: str, column: int) -> None:
    """The Node admission policy admits the plugin's change of its own Node's compute-domain
    label, membership label and annotation (and, with mig-manager, its state label), and
    denies another Node, any other label or annotation, and a spec change."""
    policy = copy.deepcopy(by_name(render(tree), "ValidatingAdmissionPolicy",
                                   "gpu-node-agent-node-metadata"))
    requests = [{"name": name, "operation": "UPDATE", "user": ACCOUNT, "extra": ON_N1,
                 "object": new, "oldObject": old}
                for name, (new, old, *_) in NODE_CASES.items()]
    out = celcheck({"policy": policy, "requests": requests})["requests"]
    for name, case in NODE_CASES.items():
        assert out[name]["matched"], name
        assert out[name]["allowed"] is case[column], (name, out[name])
        if not case[column]:
            assert not any("compil" in m or "error" in m.lower()
                           for m in out[name]["messages"]), out[name]["messages"]
    assert any("its own Node" in m for m in out["another node's clique label"]["messages"])
    assert any("spec" in m for m in out["a spec change (cordon)"]["messages"])


async def test_a_slot_is_only_in_the_compute_domain_class(make_env: MakeEnv,
                                                          celcheck: Any) -> None:
    """On a GB200 tray every GPU is in gpu.nodeagent.dev only and the compute-domain slot in
    compute-domain.gpu.nodeagent.dev only: no other class selects a slot."""
    env = await make_env("gb200-nvl72")
    devices = _devices(await env.resource_slices.of_version(VERSION))
    classes = _classes()
    out = celcheck({"selectors": [{"name": n, "expression": e} for n, e in classes.items()],
                    "devices": devices})["selectors"]
    for name in classes:
        assert "error" not in out[name] and not out[name].get("eval_errors"), out[name]
    assert set(out[f"compute-domain.{DRIVER}"]["matches"]) == {"slot"}
    assert set(out[DRIVER]["matches"]) == {f"gpu-{i}" for i in range(4)}
    assert all(out[n]["matches"] in ([], None) for n in classes
               if n not in (DRIVER, f"compute-domain.{DRIVER}")), out


def test_a_broken_expression_is_reported_not_passed(celcheck: Any) -> None:
    """The judge itself: a selector that does not compile is an error, and a misspelled
    attribute an evaluation error on each device, never a silent non-match."""
    devices = [{"driver": DRIVER, "device": {"name": "gpu-0", "attributes": {
        "type": {"string": "gpu"}}}}]
    out = celcheck({"selectors": [
        {"name": "syntax", "expression": "device.driver =="},
        {"name": "typo", "expression": f'device.attributes["{DRIVER}"].typ == "gpu"'}],
        "devices": devices})["selectors"]
    assert "Syntax error" in out["syntax"]["error"]
    assert "no such key" in out["typo"]["eval_errors"]["gpu-0"]
