"""The plugin's readiness as a metric (issue 23): ``gpu_agent_plugin_ready`` and
``gpu_agent_plugin_ready_check{check}`` on the health listener's ``/metrics`` say what
``/readyz`` says, from a scrape alone, against a real agent process."""

from __future__ import annotations

import signal

import aiohttp

from agent.kubeplugin.proto import registration_pb2
from tests.kubeplugin.conftest import Agent, Kubelet
from tests.metrics.textformat import parse


async def ready_series(kubelet: Kubelet) -> dict[str, float]:
    """The readiness series of one scrape (nothing asks /readyz here)."""
    async with aiohttp.ClientSession() as session, \
            session.get(f"{kubelet.health_url}/metrics") as response:
        out = parse(await response.text())
    found = {s.labels["check"]: s.value for s in out.named("gpu_agent_plugin_ready_check")}
    (ready,) = out.named("gpu_agent_plugin_ready")
    found["ready"] = ready.value
    return found


async def test_a_scrape_shows_whether_the_plugin_is_ready_and_which_check_fails(
        kubelet: Kubelet, agent: Agent) -> None:
    """Before kubelet registered the plugin: not ready, the registration check failing;
    registered: ready, every check passing; the agent killed: not ready, the agent check
    failing and the others still passing."""
    assert await ready_series(kubelet) == {"ready": 0, "registered": 0, "agent": 1,
                                           "api_server": 1, "slices": 1}
    await kubelet.registration.NotifyRegistrationStatus(
        registration_pb2.RegistrationStatus(plugin_registered=True), timeout=5)
    assert await ready_series(kubelet) == {"ready": 1, "registered": 1, "agent": 1,
                                           "api_server": 1, "slices": 1}
    agent.process.stop(signal.SIGKILL)
    assert await ready_series(kubelet) == {"ready": 0, "registered": 1, "agent": 0,
                                           "api_server": 1, "slices": 1}
