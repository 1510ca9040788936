"""The explainer of unplaceable compute domains (agent/kubeplugin/domain_explainer.py): one
Warning Event per claim and reason, on the claim, naming the largest clique; nothing for a
claim that fits, is allocated or is no domain; a new reason is said again, a claim gone is
forgotten, and a new term says everything once more."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent.kubeplugin.domain_explainer import REASON, DomainExplainer
from agent.kubeplugin.kube import KubeUnavailable
from agent.kubeplugin.process import PluginSettings, PluginStartError
from tests.kubeplugin.publishing import eventually
from tests.kubeplugin.test_domain_fit import DRIVER, claim, request, slot


@dataclass
class FakeApi:
    slices: list[dict[str, Any]] = field(default_factory=list)
    claims: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    down: bool = False
    lists: int = 0

    async def list_driver_slices(self, driver: str) -> list[dict[str, Any]]:
        self.lists += 1
        if self.down:
            raise KubeUnavailable("no answer")
        assert driver == DRIVER
        return self.slices

    async def list_resource_claims(self) -> list[dict[str, Any]]:
        return self.claims

    async def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.events.append((namespace, body))
        return body


def named(body: dict[str, Any], name: str, uid: str) -> dict[str, Any]:
    body["metadata"] = {"name": name, "namespace": "team", "uid": uid}
    return body


def explainer(api: FakeApi) -> DomainExplainer:
    return DomainExplainer(api, driver=DRIVER, node_name="nvl72-a-00",
                           registry=CollectorRegistry(), interval_s=0.01)


def rack(first: int, second: int) -> list[dict[str, Any]]:
    return [slot(f"a-{i}", "A.1") for i in range(first)] + \
        [slot(f"b-{i}", "B.1") for i in range(second)]


def test_only_an_unfit_domain_claim_gets_an_event_naming_the_largest_clique() -> None:
    api = FakeApi(slices=rack(18, 2), claims=[
        named(claim(request(20)), "too-big", "u1"),
        named(claim(request(16)), "fits", "u2"),
        named(claim(request(20), allocated=True), "placed", "u3"),
        named(claim(request(4, cls="gpu.nodeagent.dev")), "gpus", "u4")])
    asyncio.run(explainer(api).round())
    [(namespace, event)] = api.events
    assert namespace == "team"
    assert event["type"] == "Warning" and event["reason"] == REASON
    assert event["involvedObject"] == {"apiVersion": "resource.k8s.io/v1",
                                       "kind": "ResourceClaim", "namespace": "team",
                                       "name": "too-big", "uid": "u1"}
    assert "20 nodes in one NVLink clique" in event["message"]
    assert "the largest clique, A.1, has 18 nodes" in event["message"]
    assert event["reportingInstance"] == "nvl72-a-00"


def test_a_reason_is_said_once_again_only_when_it_changes() -> None:
    api = FakeApi(slices=rack(18, 2), claims=[named(claim(request(20)), "too-big", "u1")])
    explaining = explainer(api)

    async def rounds() -> None:
        await explaining.round()
        await explaining.round()
        assert len(api.events) == 1
        api.slices = rack(17, 2)  # a node's slot withdrawn: a new reason
        await explaining.round()
        assert len(api.events) == 2 and "has 17 nodes" in api.events[1][1]["message"]
        api.slices = rack(20, 2)  # it fits now: nothing to say, and it is forgotten
        await explaining.round()
        api.slices = rack(17, 2)
        await explaining.round()
        assert len(api.events) == 3

    asyncio.run(rounds())


def test_a_new_term_says_each_reason_once_more_and_an_unreachable_server_is_retried() -> None:
    api = FakeApi(slices=rack(2, 1), claims=[named(claim(request(3)), "too-big", "u1")])
    explaining = explainer(api)

    async def term(until: int) -> None:
        task = asyncio.create_task(explaining.run())
        await eventually(lambda: len(api.events) >= until, task=task)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(term(1))
    api.down = True

    async def failing_then_back() -> None:
        task = asyncio.create_task(explaining.run())
        # Failed rounds are logged and retried, not fatal: the task outlives a few of them.
        await eventually(lambda: api.lists >= 3, task=task)
        api.down = False
        await eventually(lambda: len(api.events) >= 2, task=task)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(failing_then_back())
    assert [e["involvedObject"]["uid"] for _, e in api.events] == ["u1", "u1"]


@pytest.mark.parametrize(("changes", "says"), [
    pytest.param({"lease_namespace": "Not_A_Namespace"}, "--lease-namespace", id="namespace"),
    pytest.param({"lease_namespace": "x" * 64}, "--lease-namespace", id="namespace too long"),
    pytest.param({"lease_duration_s": 1.0}, "--lease-duration", id="lease too short"),
    pytest.param({"explain_interval_s": 0.0}, "--domain-explain-interval", id="interval 0"),
])
def test_bad_explainer_settings_are_refused_naming_the_flag(
        tmp_path: Path, changes: dict[str, Any], says: str) -> None:
    settings = PluginSettings(agent_socket=tmp_path / "agent.sock",
                              token_file=tmp_path / "token", node_name="node-a", **changes)
    with pytest.raises(PluginStartError, match=says):
        settings.check()


def test_good_explainer_settings_pass_the_explainer_checks(tmp_path: Path) -> None:
    settings = PluginSettings(agent_socket=tmp_path / "agent.sock",
                              token_file=tmp_path / "token", node_name="node-a",
                              lease_namespace="gpu-node-agent", lease_duration_s=8,
                              explain_interval_s=1)
    try:
        settings.check()
        refused = ""
    except PluginStartError as err:  # the token file is missing here: not what is checked
        refused = str(err)
    assert not any(flag in refused for flag in ("--lease", "--domain-explain")), refused
