"""``python -m tests.kubeplugin.plugin_main kubelet-plugin FLAGS``: the real
``gpu-agent kubelet-plugin`` command line and process, with an in-memory claim reader in
place of the Kubernetes client (the process tests start it and signal it); with
``PLUGIN_MAIN_CLAIMS=kubeconfig``, the real Kubernetes wiring from ``--kubeconfig`` (claims
read from that server) with only the publisher left out, for tests whose API server is a
hostile stand-in that serves no ResourceSlices."""

from __future__ import annotations

import dataclasses
import os
import sys

from prometheus_client import CollectorRegistry

from agent.cli import kubelet_plugin
from agent.cli.main import parser
from agent.kubeplugin.agent_client import AgentClient
from agent.kubeplugin.process import PluginSettings, Wiring, wire_kubernetes
from tests.kubeplugin.conftest import FakeClaims, FakePublisher


async def fake_wire(settings: PluginSettings, agent: AgentClient,
                    registry: CollectorRegistry) -> Wiring:
    claims = FakeClaims()
    return Wiring(claims=claims, api=claims, publisher=FakePublisher())


async def kubeconfig_wire(settings: PluginSettings, agent: AgentClient,
                          registry: CollectorRegistry) -> Wiring:
    wiring = await wire_kubernetes(settings, agent, registry)
    return dataclasses.replace(wiring, publisher=FakePublisher())


if __name__ == "__main__":
    wire = kubeconfig_wire if os.environ.get("PLUGIN_MAIN_CLAIMS") == "kubeconfig" else fake_wire
    sys.exit(kubelet_plugin.run(parser().parse_args(sys.argv[1:]), wire=wire))
