"""What ``nvidia-imex-ctl`` prints is parsed without running it, and a daemon is told from
any other process by its command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.gpu.imex import ImexDomainView, ImexNode, parse_domain, parse_state, runs_config


@pytest.mark.parametrize(("output", "state"), [
    ("READY\n", "READY"), ("\n  WAITING_FOR_PEERS \n", "WAITING_FOR_PEERS"), ("", None),
    ("UNAVAILABLE\nnvidia-imex-ctl: cannot reach\n", "UNAVAILABLE"),
])
def test_the_state_is_the_first_line_q_prints(output: str, state: str | None) -> None:
    assert parse_state(output) == state


def test_the_domain_view_is_read_from_n_j() -> None:
    text = json.dumps({"status": "DEGRADED", "nodes": [
        {"index": 0, "host": "10.0.0.4", "status": "READY", "version": "sim",
         "connections": {"10.0.0.5": "C"}},
        {"index": 1, "host": "10.0.0.5", "status": "UNAVAILABLE", "version": None,
         "connections": {}}]})
    assert parse_domain(text) == ImexDomainView(status="DEGRADED", nodes=(
        ImexNode(0, "10.0.0.4", "READY"), ImexNode(1, "10.0.0.5", "UNAVAILABLE")))


@pytest.mark.parametrize("text", [
    "", "Domain State: UP", "[]", '{"status": "UP"}', '{"nodes": [1]}',
    '{"nodes": [{"index": "0"}]}', '{"nodes": [{"index": true}]}',
])
def test_anything_else_is_no_view(text: str) -> None:
    assert parse_domain(text) is None


CONFIG = Path("/var/lib/gpu-agent/imex/config.cfg")


@pytest.mark.parametrize(("argv", "ours"), [
    (["/usr/bin/nvidia-imex", "-c", str(CONFIG)], True),
    (["python3", "-m", "agent.gpu.sim.imex", "-c", str(CONFIG)], True),
    (["/usr/bin/nvidia-imex", "-c", "/etc/nvidia-imex/config.cfg"], False),
    (["/usr/bin/nvidia-imex", str(CONFIG)], False),
    ([], False), (None, False),
])
def test_a_daemon_is_ours_when_it_runs_our_config(argv: list[str] | None, ours: bool) -> None:
    assert runs_config(argv, CONFIG) is ours
