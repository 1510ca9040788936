"""The API server's ResourceSlice rules per Kubernetes version (1.34 to 1.37): what each
version refuses that the one before or after accepts, and that every preset's slices pass the
strict schema and the rules of every version."""

from __future__ import annotations

from typing import Any

import pytest

from agent.dra.resource_slices import KUBERNETES_VERSIONS
from agent.dra.rules import RULES, check, rules_for

V134, V135, V136, V137 = (1, 34), (1, 35), (1, 36), (1, 37)
POOL2 = {"name": "n", "generation": 1, "resourceSliceCount": 2}


def _slice(spec: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {"driver": "gpu.nodeagent.dev", "nodeName": "n",
                            "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": "n-00000"}, "spec": {**base, **spec}}


def _device(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "attributes": {"uuid": {"string": "x"}}, **extra}


COUNTERS = [{"name": "cs", "counters": {"c": {"value": "1000"}}}]
CONSUMES = [{"counterSet": "cs", "counters": {"c": {"value": "1"}}}]
TAINT = {"key": "gpu.nodeagent.dev/unhealthy", "effect": "NoSchedule"}


def _consuming(count: int) -> dict[str, Any]:
    return {"sharedCounters": COUNTERS,
            "devices": [_device(f"d{i}", consumesCounters=CONSUMES) for i in range(count)]}


def _lists(values: int, devices: int = 1) -> dict[str, Any]:
    return {"devices": [_device(f"d{i}", attributes={
        "uuid": {"string": "x"}, "links": {"ints": list(range(values))}})
        for i in range(devices)]}


def _partitioned(attributes: dict[str, Any], type_attribute: str = "partitionType",
                 ) -> list[dict[str, Any]]:
    return [_slice({"pool": POOL2, "sharedCounters": COUNTERS}),
            _slice({"pool": POOL2, "partitionTypeAttribute":
                    f"gpu.nodeagent.dev/{type_attribute}",
                    "devices": [_device("a", consumesCounters=CONSUMES,
                                        attributes=attributes)]})]


# (what, slices, {version: a needle of the problem, or None for "accepted"})
CASES: list[tuple[str, list[dict[str, Any]], dict[tuple[int, int], str | None]]] = [
    ("100 devices consuming counters in one slice (with the counters)",
     [_slice(_consuming(100))],
     {V134: None, V135: "only one of sharedCounters or devices"}),
    ("65 devices consuming counters of another slice",
     [_slice({"pool": POOL2, "sharedCounters": COUNTERS}),
      _slice({"pool": POOL2, "devices": [_device(f"d{i}", consumesCounters=CONSUMES)
                                         for i in range(65)]})],
     {V134: "not defined in the slice", V135: "at most 64", V136: "at most 64",
      V137: "at most 64"}),
    ("5 taints on a device", [_slice({"devices": [_device("a", taints=[TAINT] * 5)]})],
     {V134: "5 taints (at most 4)", V135: None, V137: None}),
    ("17 taints on a device", [_slice({"devices": [_device("a", taints=[TAINT] * 17)]})],
     {V135: "17 taints (at most 16)", V137: "17 taints (at most 16)"}),
    ("a taint with effect None", [_slice({"devices": [_device("a", taints=[
        {**TAINT, "effect": "None"}])]})], {V134: "effect 'None'", V135: None}),
    ("a taint without a valid key", [_slice({"devices": [_device("a", taints=[
        {"key": "-bad", "effect": "NoSchedule"}])]})], {V135: "bad key", V137: "bad key"}),
    ("65 devices with taints", [_slice({"devices": [_device(f"d{i}", taints=[TAINT])
                                                    for i in range(65)]})],
     {V134: None, V135: "at most 64", V137: "at most 64"}),
    ("a list attribute", [_slice(_lists(3))],
     {V134: "need Kubernetes 1.36", V135: "need Kubernetes 1.36", V136: None, V137: None}),
    ("an empty list attribute", [_slice(_lists(0))], {V136: "non-empty list"}),
    ("48 attribute values on a device", [_slice(_lists(47))], {V136: None, V137: None}),
    ("49 attribute values on a device", [_slice(_lists(48))],
     {V136: "49 attribute values (at most 48)", V137: "49 attribute values"}),
    ("65 devices with list attributes", [_slice(_lists(1, 65))],
     {V136: "at most 64", V137: "at most 64"}),
    ("a list item that is no semver", [_slice({"devices": [_device("a", attributes={
        "v": {"versions": ["1.0.0", "9.0"]}})]})], {V136: "versions[1]: '9.0' is not a semver"}),
    ("partitionTypeAttribute on a string attribute (bare)",
     _partitioned({"partitionType": {"string": "mig"}}),
     {V136: "partitionTypeAttribute needs Kubernetes 1.37", V137: None}),
    ("partitionTypeAttribute on a string attribute (qualified)",
     _partitioned({"gpu.nodeagent.dev/partitionType": {"string": "mig"}}), {V137: None}),
    ("partitionTypeAttribute naming a missing attribute", _partitioned({}),
     {V137: "must carry the partition type attribute"}),
    ("partitionTypeAttribute naming an int", _partitioned({"partitionType": {"int": 1}}),
     {V137: "must be a string"}),
    ("partitionTypeAttribute without consuming devices",
     [_slice({"partitionTypeAttribute": "gpu.nodeagent.dev/t", "devices": [_device("a")]})],
     {V137: "devices that consume counters"}),
    ("skipping NodePrepareResources alone",
     [_slice({"skipNodeOperations": ["NodePrepareResources"], "devices": []})],
     {V136: "skipNodeOperations needs Kubernetes 1.37",
      V137: "cannot be skipped unless NodeUnprepareResources"}),
    ("skipping both node operations",
     [_slice({"skipNodeOperations": ["NodePrepareResources", "NodeUnprepareResources"],
              "devices": []})], {V137: None}),
    ("9 counter sets in one slice", [_slice({"sharedCounters": [
        {"name": f"s{i}", "counters": {"c": {"value": "1"}}} for i in range(9)]})],
     {V134: None, V135: "9 counter sets", V136: "9 counter sets", V137: "9 counter sets"}),
]


@pytest.mark.parametrize(("what", "slices", "verdicts"), CASES, ids=[c[0] for c in CASES])
def test_rules_per_version(what: str, slices: list[dict[str, Any]],
                           verdicts: dict[tuple[int, int], str | None]) -> None:
    """Each version accepts what its API server accepts and names what it refuses."""
    for version, needle in verdicts.items():
        problems = check(slices, version)
        if needle is None:
            assert problems == [], (what, version)
        else:
            assert any(needle in p for p in problems), (what, version, problems)


def test_every_published_version_has_rules_and_newer_servers_keep_the_newest() -> None:
    """The versions the API offers are the versions with rules; a newer server gets 1.37's
    rules, an older one 1.34's."""
    assert tuple(r.version for r in RULES) == KUBERNETES_VERSIONS
    assert rules_for((1, 40)).version == (1, 37)
    assert rules_for((1, 36)).version == (1, 36)
    assert rules_for((1, 20)).version == (1, 34)
