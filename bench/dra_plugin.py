"""``python -m bench.dra_plugin kubelet-plugin FLAGS``: the real ``gpu-agent kubelet-plugin``
process (command line, gRPC servers, agent client, logging) for the DRA benchmark, with the
Kubernetes side chosen by ``BENCH_DRA_READER``:

- ``file:PATH``: ResourceClaims answered from memory, loaded from a JSON list in ``PATH``
  (read again when a claim is asked for that it does not hold): no API server GET.
- ``kube``: the plugin's own Kubernetes client (``agent.kubeplugin.kube.KubeClient`` from
  ``--kubeconfig``) reads each claim from the API server; no publisher.
- ``full`` (or unset): ``agent.kubeplugin.process.wire_kubernetes``, the production wiring
  (claim reader and ResourceSlice publisher).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from agent.cli import kubelet_plugin
from agent.cli.main import parser
from agent.kubeplugin.agent_client import AgentClient
from agent.kubeplugin.kube import KubeClient
from agent.kubeplugin.process import PluginSettings, Wiring, wire_kubernetes

READER_ENV = "BENCH_DRA_READER"


class FileClaims:
    """ResourceClaims from a JSON file, kept in memory: the plugin's claim reader without the
    API server round trip."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}

    def _load(self) -> None:
        items = json.loads(self.path.read_text())
        self.objects = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in items}

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """The stored claim (the plugin only reads it, so it is not copied)."""
        if (namespace, name) not in self.objects:
            self._load()
        try:
            return self.objects[(namespace, name)]
        except KeyError:
            raise LookupError(f"resourceclaims {namespace}/{name} not found") from None

    async def server_version(self) -> tuple[int, int]:
        return (1, 37)


async def bench_wire(settings: PluginSettings, agent: AgentClient,
                     registry: CollectorRegistry) -> Wiring:
    """The Kubernetes side named by ``BENCH_DRA_READER``."""
    reader = os.environ.get(READER_ENV, "full")
    if reader.startswith("file:"):
        claims = FileClaims(Path(reader.removeprefix("file:")))
        return Wiring(claims=claims, api=claims)
    if reader == "kube":
        kube = await KubeClient.from_environment(settings.kubeconfig)
        return Wiring(claims=kube, api=kube, close=kube.close)
    return await wire_kubernetes(settings, agent, registry)


if __name__ == "__main__":
    sys.exit(kubelet_plugin.run(parser().parse_args(sys.argv[1:]), wire=bench_wire))
