"""The simulated ``nvidia-imex`` and ``nvidia-imex-ctl`` are real processes behaving as
NVIDIA's IMEX guide documents them: a config file and a node list read at start, peers on
their own 127.0.0.x address and one port, readiness by the configured quorum, lost peers
reported, clean exit on SIGTERM; and a node in an NVLink domain has IMEX channel nodes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent.gpu.sim import devfs, procfs
from agent.gpu.sim.imex_config import ConfigError, parse_config, parse_nodes
from agent.gpu.sim.node import SimulatedNode
from tests.waiting import wait_for

from .conftest import NodeFactory


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Domain:
    """Simulated nodes 127.0.0.1..N sharing one node list and one port, each daemon with its
    own config, log and command socket, started from the simulated node's tools."""

    def __init__(self, tools: Path, root: Path, size: int, **settings: str) -> None:
        self.tools, self.root = tools, root
        self.port = free_port()
        self.addresses = [f"127.0.0.{i + 1}" for i in range(size)]
        self.nodes_file = root / "nodes_config.cfg"
        self.nodes_file.write_text("".join(f"{a}\n" for a in self.addresses))
        self.settings = settings
        self.daemons: dict[int, subprocess.Popen[str]] = {}
        self.started: list[subprocess.Popen[str]] = []

    def config(self, i: int, **extra: str) -> Path:
        path = self.root / f"config-{i}.cfg"
        values = {"DAEMONIZE": "0", "BIND_INTERFACE_IP": self.addresses[i],
                  "SERVER_PORT": str(self.port), "IMEX_NODE_CONFIG_FILE": str(self.nodes_file),
                  "LOG_FILE_NAME": str(self.log(i)), "IMEX_CMD_ENABLED": "1",
                  "IMEX_CMD_UNIX_DOMAIN_PATH": str(self.root / f"cmd-{i}.sock"),
                  **self.settings, **extra}
        path.write_text("# simulated IMEX node\n" + "".join(f"{k}={v}\n"
                                                           for k, v in values.items()))
        return path

    def log(self, i: int) -> Path:
        return self.root / f"imex-{i}.log"

    def start(self, i: int, **extra: str) -> subprocess.Popen[str]:
        daemon = subprocess.Popen([str(self.tools / "nvidia-imex"), "-c",
                                   str(self.config(i, **extra))],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.daemons[i] = daemon
        self.started.append(daemon)
        return daemon

    def ctl(self, i: int, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.tools / "nvidia-imex-ctl"), "-c",
                               str(self.root / f"config-{i}.cfg"), *args],
                              capture_output=True, text=True, timeout=30, check=False)

    def readiness(self, i: int) -> str:
        return self.ctl(i, "-q").stdout.strip()

    def domain(self, i: int) -> dict[str, Any]:
        done = self.ctl(i, "-N", "-j")
        return json.loads(done.stdout) if done.returncode == 0 else {}

    def status(self, i: int) -> str | None:
        return self.domain(i).get("status")

    def links(self, i: int) -> dict[str, str]:
        """Node ``i``'s own links (its row of the connectivity table)."""
        rows = self.domain(i).get("nodes", [])
        return rows[i]["connections"] if rows else {}

    def close(self) -> None:
        for daemon in self.started:
            if daemon.poll() is None:
                daemon.kill()
            daemon.communicate(timeout=30)


@pytest.fixture
def gb200(make_node: NodeFactory) -> SimulatedNode:
    return make_node("gb200-nvl72")


@pytest.fixture
def domain(gb200: SimulatedNode, tmp_path: Path) -> Iterator[Domain]:
    made = Domain(gb200.tools_dir, tmp_path, 3)
    yield made
    made.close()


# -- the files -------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "field", "value"), [
    ("", "server_port", 50000),
    ("", "wait_for_quorum", "RECOVERY"),
    ("", "daemonize", True),
    ("", "node_config_file", Path("/etc/nvidia-imex/nodes_config.cfg")),
    ("SERVER_PORT=50100\n", "server_port", 50100),
    ("IMEX_WAIT_FOR_QUORUM=FULL  # every node\n", "wait_for_quorum", "FULL"),
    ("DAEMONIZE=0\n", "daemonize", False),
    ("BIND_INTERFACE_IP=127.0.0.2\n", "bind_interface_ip", "127.0.0.2"),
    ("IMEX_NODE_CONFIG_FILE=/tmp/n.cfg\n", "node_config_file", Path("/tmp/n.cfg")),
    ("IMEX_NODE_DISCONNECTED_GRACE_TIME=30\n", "node_disconnected_grace_time_s", 30),
    ("LOG_FILE_NAME=/tmp/imex.log\n", "log_file_name", Path("/tmp/imex.log")),
    ("IMEX_CMD_ENABLED=1\nIMEX_CMD_PORT=50006\n", "cmd_port", 50006),
    ("IMEX_SERVER_KEY=/etc/key.pem\n", "server_port", 50000),
])
def test_config_keys_and_defaults(tmp_path: Path, text: str, field: str, value: object) -> None:
    """Each key NVIDIA documents sets its field; an unset key keeps NVIDIA's default; keys the
    simulator does not model (SSL) are accepted and ignored."""
    path = tmp_path / "config.cfg"
    path.write_text(text)
    assert getattr(parse_config(path), field) == value


@pytest.mark.parametrize(("text", "error"), [
    ("SERVER_PORT=fifty\n", ":1: SERVER_PORT=fifty: must be a TCP port from 0 to 65535"),
    ("# c\nSERVER_PORT=70000\n", ":2: SERVER_PORT=70000: must be a TCP port"),
    ("DAEMONIZE=yes\n", ":1: DAEMONIZE=yes: must be 0 or 1"),
    ("IMEX_WAIT_FOR_QUORUM=SOME\n", ":1: IMEX_WAIT_FOR_QUORUM=SOME: must be one of NONE"),
    ("BIND_INTERFACE_IP=node-1\n", ":1: BIND_INTERFACE_IP=node-1: must be an IPv4 or IPv6"),
    ("LOG_LEVEL=9\n", ":1: LOG_LEVEL=9: must be a level from 0 to 4"),
    ("just words\n", ":1: 'just words' is not KEY=VALUE"),
])
def test_a_bad_config_file_is_one_line_naming_the_line(tmp_path: Path, text: str,
                                                       error: str) -> None:
    path = tmp_path / "config.cfg"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        parse_config(path)
    assert str(caught.value).startswith(f"{path}{error}")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("text", "nodes", "error"), [
    ("10.0.0.1\n10.0.0.2\n", ("10.0.0.1", "10.0.0.2"), None),
    ("# rack 1\ncompute-domain-daemon-0\n\ncompute-domain-daemon-1 # tray 2\n",
     ("compute-domain-daemon-0", "compute-domain-daemon-1"), None),
    ("", None, "lists no nodes"),
    ("10.0.0.1\n10.0.0.1\n", None, ":2: node '10.0.0.1' is listed twice"),
    ("10.0.0.1 10.0.0.2\n", None, ":1: '10.0.0.1 10.0.0.2' is not one IP address"),
])
def test_node_config_file(tmp_path: Path, text: str, nodes: tuple[str, ...] | None,
                          error: str | None) -> None:
    """One IP address or host name a line, in index order; none, or one twice, refused."""
    path = tmp_path / "nodes_config.cfg"
    path.write_text(text)
    if error is None:
        assert parse_nodes(path) == nodes
        return
    with pytest.raises(ConfigError, match=error):
        parse_nodes(path)


@pytest.mark.parametrize(("setting", "stderr"), [
    ({"SERVER_PORT": "port"}, "SERVER_PORT=port: must be a TCP port"),
    ({"IMEX_NODE_CONFIG_FILE": "/nonexistent/nodes.cfg"}, "/nonexistent/nodes.cfg: cannot read"),
    ({"BIND_INTERFACE_IP": "127.0.0.9"},
     "BIND_INTERFACE_IP=127.0.0.9 is not the address of a node"),
])
def test_the_daemon_refuses_a_bad_config_with_one_line(domain: Domain,
                                                       setting: dict[str, str],
                                                       stderr: str) -> None:
    """Exit 1 and one line on stderr, no traceback, nothing listening."""
    daemon = domain.start(0, **setting)
    _, err = daemon.communicate(timeout=30)
    assert daemon.returncode == 1
    assert stderr in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (domain.root / "cmd-0.sock").exists()


def test_an_injected_fault_fails_the_next_start(gb200: SimulatedNode, domain: Domain) -> None:
    """``nvidia-imex`` is a driver tool for faults: its next start exits 1 with the message,
    the one after starts."""
    gb200.add_fault("nvidia-imex", "IMEX driver version check failed")
    failed = domain.start(0)
    _, err = failed.communicate(timeout=30)
    assert (failed.returncode, err) == (1, "nvidia-imex: IMEX driver version check failed\n")
    domain.start(0)
    wait_for(lambda: domain.readiness(0) == "READY", "the second start")


# -- the domain ------------------------------------------------------------------------


def test_three_daemons_reach_ready_and_the_domain_is_up(domain: Domain) -> None:
    """Three simulated nodes with one 3-node list: each says READY (-q, exit 0), each sees
    every node READY and every link connected, and the domain UP (-N)."""
    for i in range(3):
        domain.start(i)
    for i in range(3):
        wait_for(lambda i=i: domain.status(i) == "UP", f"node {i} to see the domain UP")
        done = domain.ctl(i, "-q")
        assert (done.returncode, done.stdout) == (0, "READY\n")
    view = domain.domain(0)
    assert [(n["host"], n["status"]) for n in view["nodes"]] == [
        (a, "READY") for a in domain.addresses]
    table = domain.ctl(1, "-N").stdout
    assert "Node #2 - 127.0.0.3 - READY" in table
    assert "Domain State: UP" in table


def lost_third(view: dict[str, Any]) -> dict[str, Any] | None:
    """``view`` if it shows the third node gone: UNAVAILABLE, and every other node's link to
    it R."""
    rows = view.get("nodes", [])
    if not rows or rows[2]["status"] != "UNAVAILABLE":
        return None
    return view if all(r["connections"].get("127.0.0.3") == "R" for r in rows[:2]) else None


def test_a_killed_peer_is_reported_and_rejoins(domain: Domain) -> None:
    """SIGKILL of one daemon: the others stay READY but see it UNAVAILABLE, their link to it
    R (no clean-up without a grace time) and the domain DEGRADED; restarted, it rejoins as a
    new instance and the domain is UP again."""
    for i in range(3):
        domain.start(i)
    wait_for(lambda: domain.status(0) == "UP", "the domain to form")
    domain.daemons[2].kill()
    domain.daemons[2].wait(timeout=30)
    for i in (0, 1):
        view = wait_for(lambda i=i: lost_third(domain.domain(i)), f"node {i} to see node 2 lost")
        assert (view["status"], view["nodes"][i]["status"]) == ("DEGRADED", "READY")
        assert domain.readiness(i) == "READY"
    domain.start(2)
    wait_for(lambda: domain.status(0) == "UP", "the domain to form again")
    assert "is a new IMEX instance" in domain.log(0).read_text()


def test_after_the_grace_time_a_lost_peer_is_cleaned_up(gb200: SimulatedNode,
                                                        tmp_path: Path) -> None:
    """IMEX_NODE_DISCONNECTED_GRACE_TIME=1: a lost peer goes from R to D."""
    pair = Domain(gb200.tools_dir, tmp_path, 2, IMEX_NODE_DISCONNECTED_GRACE_TIME="1")
    try:
        pair.start(0)
        pair.start(1)
        wait_for(lambda: pair.status(0) == "UP", "the pair to form")
        pair.daemons[1].kill()
        wait_for(lambda: pair.links(0).get("127.0.0.2") == "D", "the grace time to pass")
    finally:
        pair.close()


def test_full_quorum_waits_for_every_node(gb200: SimulatedNode, tmp_path: Path) -> None:
    """IMEX_WAIT_FOR_QUORUM=FULL: alone, the daemon says WAITING_FOR_PEERS and the domain is
    DOWN; once the other node is up both are READY."""
    pair = Domain(gb200.tools_dir, tmp_path, 2, IMEX_WAIT_FOR_QUORUM="FULL")
    try:
        pair.start(0)
        wait_for(lambda: pair.readiness(0) == "WAITING_FOR_PEERS", "the daemon to wait")
        assert pair.status(0) == "DOWN"
        pair.start(1)
        wait_for(lambda: pair.status(0) == "UP", "the quorum")
        assert pair.readiness(0) == pair.readiness(1) == "READY"
    finally:
        pair.close()


def test_without_quorum_a_lone_daemon_is_ready_and_the_domain_degraded(
        domain: Domain) -> None:
    """RECOVERY (the default) and NONE: READY at once, peers or not."""
    domain.start(0)
    wait_for(lambda: domain.readiness(0) == "READY", "the daemon to be ready")
    assert domain.status(0) == "DEGRADED"
    assert domain.links(0) == {"127.0.0.1": "C", "127.0.0.2": "N", "127.0.0.3": "N"}


def test_peers_with_different_node_lists_refuse_each_other(domain: Domain) -> None:
    """The node maps must agree: a peer with another list shows M and never connects."""
    other = domain.root / "other_nodes.cfg"
    other.write_text("127.0.0.1\n127.0.0.2\n127.0.0.3\n127.0.0.4\n")
    domain.start(0)
    domain.start(1, IMEX_NODE_CONFIG_FILE=str(other))
    wait_for(lambda: domain.links(0).get("127.0.0.2") == "M", "node 0 to see the mismatch")
    assert "different node map" in domain.log(0).read_text()


def test_node_entries_may_be_names_resolved_at_each_connection(domain: Domain) -> None:
    """A name in the node list (``localhost``) is a node: BIND_INTERFACE_IP matches the
    address it resolves to, and the peers reach it by name."""
    domain.nodes_file.write_text("localhost\n127.0.0.2\n")
    domain.start(0)
    domain.start(1)
    wait_for(lambda: domain.status(1) == "UP", "the pair to form")
    assert [n["host"] for n in domain.domain(1)["nodes"]] == ["localhost", "127.0.0.2"]


def test_sigusr1_restarts_the_outgoing_connections(domain: Domain) -> None:
    """SIGUSR1: every outgoing connection is dropped and made again; the daemon runs on."""
    first, _ = domain.start(0), domain.start(1)
    wait_for(lambda: domain.links(0).get("127.0.0.2") == "C", "the pair to connect")
    first.send_signal(signal.SIGUSR1)
    wait_for(lambda: "connection restarted (SIGUSR1)" in domain.log(0).read_text(),
             "the connection to be restarted")
    wait_for(lambda: domain.links(0).get("127.0.0.2") == "C", "the pair to connect again")
    assert first.poll() is None


def test_sigterm_exits_cleanly_and_the_peers_see_it(domain: Domain) -> None:
    """SIGTERM: exit 0, the command socket removed, the log says so; the peer sees it go."""
    for i in range(2):
        domain.start(i)
    wait_for(lambda: domain.links(0).get("127.0.0.2") == "C", "the pair to connect")
    domain.daemons[1].send_signal(signal.SIGTERM)
    assert domain.daemons[1].wait(timeout=30) == 0
    assert not (domain.root / "cmd-1.sock").exists()
    assert "IMEX daemon exited" in domain.log(1).read_text()
    wait_for(lambda: domain.links(0).get("127.0.0.2") == "R", "node 0 to see node 1 go")
    done = domain.ctl(1, "-q")
    assert (done.returncode, done.stdout) == (1, "UNAVAILABLE\n")


def test_sighup_writes_the_in_memory_verbose_log(domain: Domain) -> None:
    """LOG_LEVEL=3 keeps INFO lines out of the log until SIGHUP writes them."""
    daemon = domain.start(0, LOG_LEVEL="3")
    wait_for(lambda: domain.readiness(0) == "READY", "the daemon to be ready")
    assert not domain.log(0).exists()  # every line so far is INFO
    daemon.send_signal(signal.SIGHUP)
    wait_for(lambda: domain.log(0).exists() and "IMEX daemon is READY" in
             domain.log(0).read_text(), "SIGHUP to write the verbose lines")
    assert daemon.poll() is None


def test_daemonize_detaches_and_the_starter_exits_0(domain: Domain) -> None:
    """DAEMONIZE=1: the starter exits 0 once the daemon listens; the daemon runs on."""
    done = subprocess.run([str(domain.tools / "nvidia-imex"), "-c",
                           str(domain.config(0, DAEMONIZE="1"))],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    assert domain.readiness(0) == "READY"
    config = str(domain.root / "config-0.cfg")
    [daemon] = [p for p in psutil.process_iter(["cmdline"])
                if config in (p.info["cmdline"] or []) and p.pid != os.getpid()]
    daemon.terminate()
    daemon.wait(timeout=30)  # not our child: its status is not ours to read; its log is
    assert "IMEX daemon exited" in domain.log(0).read_text()


@pytest.mark.parametrize(("args", "status", "stderr"), [
    (["-q"], 1, "cannot reach the IMEX command service"),
    ([], 2, "one of -q or -N is required"),
    (["-q", "-x"], 2, "unexpected argument '-x'"),
])
def test_ctl_exit_codes(domain: Domain, args: list[str], status: int, stderr: str) -> None:
    """No daemon: exit 1; bad arguments: exit 2 with the usage."""
    domain.config(0)
    done = domain.ctl(0, *args)
    assert done.returncode == status
    assert stderr in done.stderr


# -- channels --------------------------------------------------------------------------


def test_a_node_in_an_nvlink_domain_has_imex_channel_nodes(gb200: SimulatedNode,
                                                           make_node: NodeFactory) -> None:
    """channel0..2047 under /dev/nvidia-caps-imex-channels, the minor in the name, their
    major in /proc/devices as nvidia-caps-imex-channels; a node without a fabric has none."""
    channels = gb200.dev_root / "dev" / "nvidia-caps-imex-channels"
    names = {p.name for p in channels.iterdir()}
    assert names == {f"channel{n}" for n in range(devfs.IMEX_CHANNELS)}
    assert (gb200.dev_root / devfs.imex_channel_path(0)).is_file()
    devices = (gb200.proc_root / "devices").read_text()
    assert f"{procfs.NVIDIA_CAPS_IMEX_MAJOR} nvidia-caps-imex-channels\n" in devices
    l40s = make_node("l40s")
    assert not (l40s.dev_root / "dev" / "nvidia-caps-imex-channels").exists()
