"""The IMEX daemon's files are rendered from values, and a domain's peer list is checked
before anything is stored: each refusal names its field."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.domains.config import (
    MAX_PEERS,
    SOCKET_PATH_MAX,
    imex_files,
    is_host,
    peer_errors,
    render_config,
    render_nodes,
)


def test_the_config_names_every_file_and_the_settings_imex_needs() -> None:
    files = imex_files(Path("/var/lib/gpu-agent/imex"))
    config = render_config(files, address="10.0.0.5", port=50000)
    assert [line for line in config.splitlines() if not line.startswith("#")] == [
        "DAEMONIZE=1",
        "BIND_INTERFACE_IP=10.0.0.5",
        "SERVER_PORT=50000",
        "IMEX_NODE_CONFIG_FILE=/var/lib/gpu-agent/imex/nodes_config.cfg",
        "IMEX_CMD_ENABLED=1",
        "IMEX_CMD_UNIX_DOMAIN_PATH=/var/lib/gpu-agent/imex/imex.sock",
        "LOG_FILE_NAME=/var/lib/gpu-agent/imex/nvidia-imex.log",
        "IMEX_WAIT_FOR_QUORUM=RECOVERY",
    ]


def test_the_node_list_keeps_the_domains_order() -> None:
    assert render_nodes(["10.0.0.7", "10.0.0.5", "node-3"]) == "10.0.0.7\n10.0.0.5\nnode-3\n"


def test_a_state_directory_too_deep_for_a_unix_socket_gets_a_short_one() -> None:
    deep = Path("/" + "d" * 120)
    files = imex_files(deep, short_dir=Path("/tmp"))
    assert files.config == deep / "config.cfg"
    assert files.socket.parent == Path("/tmp") and len(str(files.socket)) <= SOCKET_PATH_MAX
    assert imex_files(deep).socket == files.socket  # the same directory, the same socket
    assert imex_files(Path("/" + "e" * 120)).socket != files.socket


@pytest.mark.parametrize(("value", "host"), [
    ("10.0.0.5", True), ("::1", True), ("fd00::5", True), ("node-3", True),
    ("compute-domain-daemon-0001.example.org", True), ("a." * 120 + "b", True),
    ("", False), ("not a host", False), ("-node", False), ("node_3", False),
    ("999.1.1.1", False), ("a" * 64, False), ("a." * 130 + "b", False),
])
def test_a_peer_is_an_ip_address_or_a_dns_name(value: str, host: bool) -> None:
    assert is_host(value) is host


ME = "10.0.0.5"


@pytest.mark.parametrize(("peers", "errors"), [
    ([ME], []),
    (["10.0.0.4", ME, "node-6"], []),
    ([], [("peers", "1 to 1024 entries, not 0")]),
    (["10.0.0.4"], [("peers", f"does not include this node's IMEX address {ME}")]),
    ([ME, "10.0.0.4", ME], [("peers[2]", "same as peers[0]")]),
    ([ME, "Node-6", "node-6"], [("peers[2]", "same as peers[1]")]),
    ([ME, "bad host"], [("peers[1]", "not an IP address or DNS name")]),
    ([ME, *(f"10.1.{i // 250}.{i % 250}" for i in range(MAX_PEERS))],
     [("peers", "1 to 1024 entries, not 1025")]),
])
def test_a_peer_list_is_refused_naming_each_offending_field(
        peers: list[str], errors: list[tuple[str, str]]) -> None:
    assert [(e["field"], e["reason"]) for e in peer_errors(peers, ME)] == errors
