"""The publisher's pure handling of device taints: the agent's pool cut to what a server keeps
of taints, the step down after a refused write, and the probe's answer read."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest

from agent.kubeplugin.resource_slice_plan import (
    TAINT_FIELD,
    TaintSupport,
    dropped_fields,
    dropped_taints,
    for_taint_support,
    probe_answer,
    taint_probe,
    taint_refusal,
)

NODE, DRIVER = "node-a", "gpu.nodeagent.dev"
Json = dict[str, Any]
KEPT, BLOCKING_ONLY, NONE, UNKNOWN = (TaintSupport.KEPT, TaintSupport.BLOCKING_ONLY,
                                      TaintSupport.NONE, TaintSupport.UNKNOWN)

XID48 = {"key": f"{DRIVER}/xid", "value": "48", "effect": "NoSchedule",
         "timeAdded": "2026-12-02T16:40:01Z"}
XID31 = {"key": f"{DRIVER}/xid", "value": "31", "effect": "None",
         "timeAdded": "2026-12-02T16:40:01Z"}
LOST = {"key": f"{DRIVER}/gpu-lost", "effect": "NoExecute", "timeAdded": "2026-12-02T16:40:01Z"}
UNMONITORED = {"key": f"{DRIVER}/unmonitored", "effect": "None",
               "timeAdded": "2026-12-02T16:40:01Z"}
FUTURE = {"key": f"{DRIVER}/xid", "value": "48", "effect": "PreferNoSchedule"}


def device(name: str, *taints: Json) -> Json:
    out: Json = {"name": name, "attributes": {"type": {"string": "gpu"}}}
    if taints:
        out["taints"] = [dict(t) for t in taints]
    return out


def pool(*slices: list[Json]) -> list[Json]:
    return [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
             "metadata": {"name": f"{NODE}-{i}"},
             "spec": {"driver": DRIVER, "nodeName": NODE,
                      "pool": {"name": NODE, "generation": 3, "resourceSliceCount": len(slices)},
                      "devices": devices}}
            for i, devices in enumerate(slices)]


def devices_of(items: Any) -> list[list[Json]]:
    return [item["spec"]["devices"] for item in items]


@dataclass(frozen=True)
class Case:
    support: TaintSupport
    agent: list[Json]
    published: list[list[Json]]
    withdrawn: tuple[str, ...] = ()
    stripped: int = 0


MIG_POOL = pool([device("gpu-0", XID48), device("gpu-0-mig-1g10gb-0", XID48),
                 device("gpu-1")])
MIXED = pool([device("gpu-0", XID48, UNMONITORED), device("gpu-1", XID31),
              device("gpu-2")], [device("gpu-3", LOST)])

CASES = {
    "taints kept: the pool as the agent rendered it":
        Case(KEPT, MIXED, devices_of(MIXED)),
    "no taints kept: a blocking taint withdraws its device, informational ones go":
        Case(NONE, MIXED, [[device("gpu-1"), device("gpu-2")], []],
             withdrawn=("gpu-0", "gpu-3"), stripped=1),
    "not known yet: as if no taints were kept (fail closed)":
        Case(UNKNOWN, MIXED, [[device("gpu-1"), device("gpu-2")], []],
             withdrawn=("gpu-0", "gpu-3"), stripped=1),
    "effect None refused: informational taints go, blocking ones stay":
        Case(BLOCKING_ONLY, MIXED, [[device("gpu-0", XID48), device("gpu-1"), device("gpu-2")],
                                    [device("gpu-3", LOST)]], stripped=2),
    "a GPU's MIG devices carry its taint and go with it":
        Case(NONE, MIG_POOL, [[device("gpu-1")]], withdrawn=("gpu-0", "gpu-0-mig-1g10gb-0")),
    "an effect this code does not know counts as blocking":
        Case(NONE, pool([device("gpu-0", FUTURE)]), [[]], withdrawn=("gpu-0",)),
    "an untainted pool is left alone whatever the server":
        Case(NONE, pool([device("gpu-0"), device("gpu-1")]),
             [[device("gpu-0"), device("gpu-1")]]),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_pool_for_taint_support(case: Case) -> None:
    """Each server gets the devices and taints its name says; every slice stays, and what is
    left out is named (withdrawn devices with their taints, how many taints were dropped)."""
    agent = copy.deepcopy(case.agent)
    result = for_taint_support(agent, case.support)
    assert devices_of(result.items) == case.published
    assert [item["metadata"] for item in result.items] == [i["metadata"] for i in case.agent]
    assert tuple(name for name, _ in result.withdrawn) == case.withdrawn
    assert result.stripped == case.stripped
    assert agent == case.agent  # the agent's pool (also the health view's) is left as it is


def test_withdrawn_devices_name_their_taints() -> None:
    """A withdrawn device is reported with all its taints, as ``key=value:effect``."""
    result = for_taint_support(MIXED, NONE)
    assert dict(result.withdrawn) == {
        "gpu-0": f"{DRIVER}/xid=48:NoSchedule, {DRIVER}/unmonitored:None",
        "gpu-3": f"{DRIVER}/gpu-lost:NoExecute"}


def test_no_blocking_taint_reaches_a_server_that_keeps_none() -> None:
    """Whatever the agent's pool, below KEPT no device carries a blocking taint, and where
    none is kept no device carries any."""
    for support in (UNKNOWN, NONE, BLOCKING_ONLY):
        published = [d for s in devices_of(for_taint_support(MIXED + MIG_POOL, support).items)
                     for d in s]
        effects = {t["effect"] for d in published for t in d.get("taints", [])}
        assert effects <= ({"NoSchedule", "NoExecute"} if support is BLOCKING_ONLY else set())


# What a 1.34 server with DRADeviceTaints answers for effect None (422), and for 5 taints.
REFUSED_NONE = ('422 Invalid: ResourceSlice.resource.k8s.io "node-a-0" is invalid: '
                'spec.devices[1].taints[0].effect: Unsupported value: "None": supported '
                'values: "NoExecute", "NoSchedule"')
TOO_MANY = ('422 Invalid: ResourceSlice.resource.k8s.io "node-a-0" is invalid: '
            'spec.devices[0].taints: Too many: 5: must have at most 4 items')
OTHER = ('422 Invalid: ResourceSlice.resource.k8s.io "node-a-0" is invalid: '
         'spec.devices[0].attributes: Too many: 33: must have at most 32 items')

REFUSALS = {
    "effect None refused: informational taints go first":
        (KEPT, MIXED, REFUSED_NONE, BLOCKING_ONLY),
    "refused again without them: every taint goes":
        (BLOCKING_ONLY, for_taint_support(MIXED, BLOCKING_ONLY).items, TOO_MANY, NONE),
    "refused with blocking taints only: every taint goes":
        (KEPT, MIG_POOL, TOO_MANY, NONE),
    "a refusal about another field is not the taints' doing":
        (KEPT, MIXED, OTHER, None),
    "a slice name with the word in it does not make it the taints' doing":
        (KEPT, MIXED, OTHER.replace("node-a-0", "taints-0"), None),
    "a refusal naming taints of a pool without any is not the taints' doing":
        (KEPT, pool([device("gpu-0")]), TOO_MANY, None),
}


@pytest.mark.parametrize(("support", "bodies", "message", "lower"), list(REFUSALS.values()),
                         ids=list(REFUSALS))
def test_taint_refusal_steps_down(support: TaintSupport, bodies: Any, message: str,
                                  lower: TaintSupport | None) -> None:
    """A write refused for its taints lowers the support one step (informational taints
    first), so the publisher writes again without them; any other refusal is not a taint
    matter (retried as before)."""
    assert taint_refusal(support, list(bodies), message) is lower


def test_the_probe_is_a_slice_of_this_nodes_pool_with_one_blocking_taint() -> None:
    """The probe is what the admission policy lets the plugin write (its node, its driver),
    named by the server (nothing of that name can be in the way), with one NoSchedule taint
    (valid on every version that keeps taints)."""
    probe = taint_probe(node_name=NODE, driver=DRIVER)
    assert (probe["spec"]["nodeName"], probe["spec"]["driver"],
            probe["spec"]["pool"]["name"]) == (NODE, DRIVER, NODE)
    assert "name" not in probe["metadata"] and probe["metadata"]["generateName"]
    [only] = probe["spec"]["devices"]
    assert [t["effect"] for t in only["taints"]] == ["NoSchedule"]


def test_probe_answer_reads_whether_taints_were_kept() -> None:
    """The answer with the taint (a server default added, such as timeAdded) means kept;
    without it, not kept."""
    probe = taint_probe(node_name=NODE, driver=DRIVER)
    kept = copy.deepcopy(probe)
    kept["metadata"].update(name=f"{NODE}-taint-probe-x7k2q", uid="u")
    kept["spec"]["devices"][0]["taints"][0]["timeAdded"] = "2026-12-02T16:40:01Z"
    dropped = copy.deepcopy(kept)
    del dropped["spec"]["devices"][0]["taints"]
    assert probe_answer(probe, kept) is KEPT
    assert probe_answer(probe, dropped) is NONE
    assert dropped_fields(probe, dropped) == (TAINT_FIELD,)


@pytest.mark.parametrize(("dropped", "taints"), [
    ((TAINT_FIELD, "spec.sharedCounters"), (TAINT_FIELD,)),
    (("spec.devices[].taints[]", "spec.devices[].taints[].value"),
     ("spec.devices[].taints[]", "spec.devices[].taints[].value")),
    (("spec.devices[].taintsx", "spec.devices[].consumesCounters"), ()),
])
def test_dropped_taints_are_the_taint_fields(dropped: tuple[str, ...],
                                             taints: tuple[str, ...]) -> None:
    """The taint fields among dropped ones are the taints, some of them, or their fields."""
    assert dropped_taints(dropped) == taints
