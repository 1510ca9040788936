"""``python -m tests.kubeplugin.plugin_main kubelet-plugin FLAGS``: the real
``gpu-agent kubelet-plugin`` command line and process, with an in-memory claim reader in
place of the Kubernetes client (the process tests start it and signal it)."""

from __future__ import annotations

import sys

from prometheus_client import CollectorRegistry

from agent.cli import kubelet_plugin
from agent.cli.main import parser
from agent.kubeplugin.agent_client import AgentClient
from agent.kubeplugin.process import PluginSettings, Wiring
from tests.kubeplugin.conftest import FakeClaims, FakePublisher


async def fake_wire(settings: PluginSettings, agent: AgentClient,
                    registry: CollectorRegistry) -> Wiring:
    claims = FakeClaims()
    return Wiring(claims=claims, api=claims, publisher=FakePublisher())


if __name__ == "__main__":
    sys.exit(kubelet_plugin.run(parser().parse_args(sys.argv[1:]), wire=fake_wire))
