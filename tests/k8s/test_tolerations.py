"""The toleration examples of docs/kubernetes.md ("Tolerating taints") do what the page says,
with the scheduler's allocator of 1.37 (offline, on a slice written here): tolerating
``gpu.nodeagent.dev/xid`` with ``Exists`` places a claim on a GPU with a NoSchedule XID
taint; the ``effect: "None"`` toleration, like no toleration at all, places it on a GPU
whose only taint is informational and never on one with a blocking taint."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s.device_taints import XID_KEY
from tests.k8s.harness import NEWEST, allocate
from tests.k8s.objects import DRIVER, RESOURCE, claim, classes, request

Json = dict[str, Any]
DOC = Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md"
NODE = "tolerations"
STAMP = "2026-12-02T16:40:01Z"


def documented_tolerations() -> list[list[Json]]:
    """The ``tolerations`` of each YAML block of the page's "Tolerating taints" section."""
    text = DOC.read_text()
    section = text.split("### Tolerating taints", 1)[1].split("\n### ", 1)[0]
    found = []
    for block in re.findall(r"```yaml\n(.*?)```", section, re.S):
        parsed = yaml.safe_load(textwrap.dedent(block))
        if "tolerations" not in parsed:
            [req] = parsed["spec"]["devices"]["requests"]
            parsed = req["exactly"]
        found.append(parsed["tolerations"])
    assert len(found) == 2, found
    return found


def tainted_slice(effect: str, xid: str) -> Json:
    return {"apiVersion": RESOURCE, "kind": "ResourceSlice", "metadata": {"name": NODE},
            "spec": {"driver": DRIVER, "nodeName": NODE,
                     "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0", "attributes": {"type": {"string": "gpu"}},
                                  "taints": [{"key": XID_KEY, "value": xid, "effect": effect,
                                              "timeAdded": STAMP}]}]}}


def placed(effect: str, xid: str, tolerations: list[Json] | None) -> bool:
    req = request()
    if tolerations is not None:
        req["exactly"]["tolerations"] = tolerations
    return allocate(NEWEST, node=NODE, slices=[tainted_slice(effect, xid)], classes=classes(),
                    claims=[claim("c", req)]).allocated


@pytest.mark.parametrize(("example", "effect", "xid", "expected"), [
    (0, "NoSchedule", "48", True),  # any XID tolerated
    (0, "None", "31", True),
    (1, "NoSchedule", "48", False),  # informational only
    (1, "None", "31", True),
    (None, "NoSchedule", "48", False),  # no toleration: the same as informational only
    (None, "None", "31", True),
])
def test_the_documented_tolerations_place_as_the_page_says(example: int | None, effect: str,
                                                           xid: str, expected: bool) -> None:
    tolerations = None if example is None else documented_tolerations()[example]
    assert placed(effect, xid, tolerations) is expected
