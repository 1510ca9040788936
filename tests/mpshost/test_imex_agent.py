"""The product path: an agent with ``--mps-host-socket`` and IMEX (a simulated GB200 tray) has
``gpu-agent mps-host`` start its IMEX daemon, so the daemon is neither in the agent's session
nor in its cgroup: it survives SIGKILL of the agent's whole process group, and everything in
the agent's cgroup being killed, and the restarted agent re-adopts it (by pid and
``-c <config>``)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent_process import AgentProcess, kill_daemons_of, start_agent

from .processes import (
    HostProcess,
    alive,
    cgroups,
    in_cgroup,
    kill_cgroup,
    require_cgroup2,
    start_host,
    wait_for,
)
from .test_imex_host import _address

CLUSTER = "3f1f6c1e-7a55-4c52-9d0e-1b2a3c4d5e6f"
CHANNEL = {"devices": [{"kind": "imex-channel", "name": "channel", "domain": "job-1"}]}


class Tray:
    """One simulated tray: its agent (restartable) and its MPS host, on one IMEX address."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.state = tmp_path / "state"
        self.socket = tmp_path / "host.sock"
        self.mps_root = tmp_path / "mps"
        self.mps_root.mkdir()
        self.address = _address()
        self.agent: AgentProcess | None = None
        self.host: HostProcess | None = None

    def start_agent(self) -> AgentProcess:
        self.agent = start_agent(self.state, preset="gb200-nvl72", extra=[
            "--sim-cluster-uuid", CLUSTER, "--sim-clique-id", "3",
            "--imex-address", self.address, "--imex-ready-timeout-s", "10",
            "--mps-host-socket", str(self.socket), "--mps-root", str(self.mps_root)])
        return self.agent

    def start_host(self, cgroup: Path | None = None) -> HostProcess:
        """The host, with the binaries the agent's simulated node wrote as it started."""
        tools = self.state / "sim" / "bin"
        self.host = start_host(self.tmp, mps_root=self.mps_root, sock=self.socket,
                               mps_control=tools / "nvidia-cuda-mps-control", cgroup=cgroup,
                               flags=("--imex", str(tools / "nvidia-imex"),
                                      "--imex-root", str(self.state / "imex")))
        return self.host

    def daemon(self) -> dict[str, Any]:
        """The domain's daemon once the domain is UP."""
        assert self.agent is not None
        agent = self.agent

        def up() -> dict[str, Any] | None:
            domains = agent.request("GET", "/v1/domains").body["domains"]
            if domains and domains[0]["state"] == "UP":
                daemon: dict[str, Any] = domains[0]["daemon"]
                return daemon
            return None
        found: dict[str, Any] = wait_for_value(up, "the domain to be UP")
        return found

    def join(self) -> int:
        """PUT the one-member domain and prepare its channel: the daemon's pid."""
        assert self.agent is not None
        put = self.agent.request("PUT", "/v1/domains/job-1", {"peers": [self.address]})
        assert put.status == 200, put.body
        prepared = self.agent.request("PUT", "/v1/claims/claim-1", CHANNEL)
        assert prepared.status == 200, prepared.body
        daemon = self.daemon()
        assert daemon["state"] == "running"
        pid: int = daemon["pid"]
        return pid

    def close(self) -> None:
        if self.agent is not None and self.agent.proc.poll() is None:
            self.agent.stop(signal.SIGKILL)
        kill_daemons_of(self.state)
        if self.host is not None:
            self.host.stop()


def wait_for_value(probe: Callable[[], Any], what: str) -> Any:
    """``probe()`` once it is not None (at most 30 s)."""
    found: list[Any] = []

    def ready() -> bool:
        value = probe()
        if value is not None:
            found.append(value)
        return value is not None
    wait_for(ready, 30, what)
    return found[-1]


@pytest.fixture
def tray(tmp_path: Path) -> Iterator[Tray]:
    if os.geteuid() != 0:
        pytest.skip("the MPS host and the daemon's mount namespace need root")
    made = Tray(tmp_path)
    yield made
    made.close()


def _readopted(tray: Tray, pid: int) -> None:
    """The restarted agent shows the same daemon running and says it adopted it; the
    channel's unprepare then stops it."""
    agent = tray.start_agent()
    daemon = tray.daemon()
    assert (daemon["state"], daemon["pid"]) == ("running", pid)
    kinds = [e["kind"] for e in agent.request("GET", "/v1/events").body["events"]]
    assert "domain.daemon_adopted" in kinds, kinds
    assert agent.request("DELETE", "/v1/claims/claim-1").status == 204
    wait_for(lambda: not alive(pid), 20, "the last unprepare to stop the daemon")


def test_the_daemon_is_the_host_s_and_survives_sigkill_of_the_agent_s_group(
        tray: Tray) -> None:
    """The daemon started for the channel is the host's start (its log says so), in no
    session or process group of the agent's; SIGKILL to the agent's whole group leaves it
    running, and the restarted agent re-adopts it."""
    agent = tray.start_agent()
    host = tray.start_host()
    pid = tray.join()
    launched = [line for line in host.logs().splitlines() if "imex daemon launched" in line]
    assert len(launched) == 1 and str(tray.state / "imex" / "config.cfg") in launched[0], \
        host.logs()
    assert os.getsid(pid) != os.getsid(agent.proc.pid)
    assert os.getpgid(pid) != os.getpgid(agent.proc.pid)
    os.killpg(agent.proc.pid, signal.SIGKILL)
    agent.proc.wait(20)
    assert alive(pid)
    _readopted(tray, pid)


def test_the_daemon_survives_everything_in_the_agent_s_cgroup_being_killed(
        tray: Tray) -> None:
    """Agent and host each in a cgroup of its own (two containers, two units): the daemon
    lives in the host's, so killing the agent's cgroup (a container restart, ``systemctl
    restart gpu-agent``) leaves it running, and the restarted agent re-adopts it."""
    require_cgroup2()
    with cgroups("agent", "host") as groups:
        agent = tray.start_agent()
        (groups["agent"] / "cgroup.procs").write_text(str(agent.proc.pid))
        tray.start_host(cgroup=groups["host"])
        pid = tray.join()
        assert in_cgroup(pid).endswith(f"/{groups['host'].name}")
        kill_cgroup(groups["agent"])
        agent.proc.wait(20)
        assert alive(pid)
        assert in_cgroup(pid).endswith(f"/{groups['host'].name}")
        _readopted(tray, pid)
