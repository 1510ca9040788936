"""Fixtures for tests against real Kubernetes components (tests/k8s/fixtures.py), plus real
agent processes whose slices they consume."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.k8s.fixtures import (
    device_taint_eviction,
    kube_apiserver,
    kube_apiservers,
    kubelet_harness,
)
from tests.k8s.stack import stack

__all__ = ["device_taint_eviction", "kube_apiserver", "kube_apiservers", "kubelet_harness",
           "stack"]

StartAgent = Callable[..., AgentProcess]


@pytest.fixture
def agent_node(tmp_path: Path) -> Iterator[StartAgent]:
    """``start(preset, node_name=..., dynamic_mig=False)``: a real simulated agent process
    publishing slices for ``node_name``, stopped at the end of the test."""
    running: list[AgentProcess] = []

    def start(preset: str, *, node_name: str, dynamic_mig: bool = False,
              extra: tuple[str, ...] = ()) -> AgentProcess:
        agent = start_agent(tmp_path / f"agent-{len(running)}", preset=preset,
                            extra=["--node-name", node_name,
                                   *(["--dynamic-mig"] if dynamic_mig else []), *extra])
        running.append(agent)
        return agent

    yield start
    for agent in running:
        agent.stop(signal.SIGKILL)

