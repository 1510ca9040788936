"""The IMEX daemon's files are rendered from values (seat names in the node list, their
addresses in the daemon's hosts file), and a domain's seats are checked before anything is
stored: each refusal names its field."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from agent.domains.config import (
    MAX_PEERS,
    SOCKET_PATH_MAX,
    address_key,
    imex_files,
    peer_errors,
    render_config,
    render_hosts,
    render_nodes,
    seat_names,
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


def test_each_seat_has_a_name_of_its_domain_the_same_on_every_member() -> None:
    names = seat_names("job-1", 3)
    digest = hashlib.sha256(b"job-1").hexdigest()[:12]
    assert names == (f"imex-{digest}-0000", f"imex-{digest}-0001", f"imex-{digest}-0002")
    assert seat_names("job-1", 3) == names and seat_names("job-1", 2) == names[:2]
    assert set(seat_names("job-2", 3)).isdisjoint(names)
    assert seat_names("job-1", MAX_PEERS)[-1].endswith("-1023")
    assert render_nodes(names) == "".join(f"{n}\n" for n in names)


def test_the_hosts_file_maps_each_held_seat_and_leaves_empty_seats_out() -> None:
    names = ["imex-a-0000", "imex-a-0001", "imex-a-0002"]
    assert render_hosts(names, ["10.0.0.7", None, "fd00::5"]).splitlines() == [
        "127.0.0.1 localhost", "::1 localhost ip6-localhost",
        "10.0.0.7 imex-a-0000", "fd00::5 imex-a-0002"]


def test_a_state_directory_too_deep_for_a_unix_socket_gets_a_short_one() -> None:
    deep = Path("/" + "d" * 120)
    files = imex_files(deep, short_dir=Path("/tmp"))
    assert files.config == deep / "config.cfg"
    assert files.socket.parent == Path("/tmp") and len(str(files.socket)) <= SOCKET_PATH_MAX
    assert imex_files(deep).socket == files.socket  # the same directory, the same socket
    assert imex_files(Path("/" + "e" * 120)).socket != files.socket


@pytest.mark.parametrize(("value", "key"), [
    ("10.0.0.5", "10.0.0.5"), ("::1", "::1"), ("fd00:0::05", "fd00::5"),
    ("node-3", None), ("", None), ("999.1.1.1", None), ("10.0.0.5 ", None),
])
def test_an_address_has_one_spelling(value: str, key: str | None) -> None:
    assert address_key(value) == key


ME = "10.0.0.5"


NOT_IP = "not an IP address (the agent maps each seat's IMEX name to it)"


@pytest.mark.parametrize(("peers", "errors"), [
    ([ME], []),
    (["10.0.0.4", ME, None], []),
    ([None, None, ME, None], []),
    ([], [("peers", "1 to 1024 entries, not 0")]),
    ([None], [("peers", f"does not include this node's IMEX address {ME}")]),
    (["10.0.0.4"], [("peers", f"does not include this node's IMEX address {ME}")]),
    ([ME, "10.0.0.4", ME], [("peers[2]", "same as peers[0]")]),
    ([ME, "fd00::5", "fd00:0::05"], [("peers[2]", "same as peers[1]")]),
    ([ME, "node-6"], [("peers[1]", NOT_IP)]),
    ([ME, "bad host", None], [("peers[1]", NOT_IP)]),
    ([ME, *(f"10.1.{i // 250}.{i % 250}" for i in range(MAX_PEERS))],
     [("peers", "1 to 1024 entries, not 1025")]),
])
def test_a_seat_list_is_refused_naming_each_offending_field(
        peers: list[str | None], errors: list[tuple[str, str]]) -> None:
    assert [(e["field"], e["reason"]) for e in peer_errors(peers, ME)] == errors
