"""The MPS host starting the simulated ``nvidia-imex`` (agent/gpu/sim/imex.py): a real host
process accepts a ``launch-imex`` of its ``--imex`` with a config and hosts file below its
``--imex-root``, and the daemon runs outside the caller's session, in the host's cgroup, with
that hosts file at its /etc/hosts and the argv the agent finds it by; anything else is
refused naming the field, and nothing starts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.domains.config import imex_files, render_config, render_hosts, render_nodes, seat_names
from agent.errors import ImexUnavailable
from agent.gpu.imex import ImexControl, command_line
from agent.gpu.sim.node import SimulatedNode
from agent.mps.host_client import HostLauncher

from .processes import (
    HostProcess,
    alive,
    cgroups,
    in_cgroup,
    require_cgroup2,
    start_host,
    wait_for,
)
from .test_host import _raw

_ADDRESSES = iter(range(1, 250))


def _address() -> str:
    """A loopback address of this test's own (the simulated daemon listens on it, port
    50000), apart from those of tests/integration/test_domains.py (127.0.10-39.x)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    net = 60 + (int(worker) if worker.isdigit() else 0) % 30
    return f"127.0.{net}.{next(_ADDRESSES)}"


@pytest.fixture
def gb200(tmp_path: Path) -> Iterator[SimulatedNode]:
    """A simulated GB200 tray: its tools directory holds nvidia-imex and nvidia-imex-ctl."""
    node = SimulatedNode("gb200-nvl72", tmp_path / "state", tmp_path / "proc")
    node.nvml.nvmlInit()
    yield node
    node.close()


@pytest.fixture
def imex_root(tmp_path: Path) -> Iterator[Path]:
    """The IMEX root, with a domain's config, node list and hosts file written as the agent
    writes them; the daemon started from it is killed afterwards."""
    root = tmp_path / "imex"
    root.mkdir()
    files = imex_files(root)
    names = seat_names("job-1", 1)
    address = _address()
    files.config.write_text(render_config(files, address=address, port=50000))
    files.nodes.write_text(render_nodes(names))
    files.hosts.write_text(render_hosts(names, [address]))
    yield root
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and str(files.config) in " ".join(
                command_line(int(entry.name)) or []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def _host(tmp_path: Path, node: SimulatedNode, imex_root: Path, **kwargs: object) -> HostProcess:
    mps_root = tmp_path / "mps"
    mps_root.mkdir(exist_ok=True)
    return start_host(tmp_path, mps_root=mps_root,
                      mps_control=node.tools_dir / "nvidia-cuda-mps-control",
                      flags=("--imex", str(node.tools_dir / "nvidia-imex"),
                             "--imex-root", str(imex_root)), **kwargs)  # type: ignore[arg-type]


def test_the_host_starts_the_imex_daemon_in_its_cgroup_with_the_domain_s_hosts_file(
        tmp_path: Path, gb200: SimulatedNode, imex_root: Path) -> None:
    """ImexControl with a HostLauncher: the simulated daemon runs ``nvidia-imex -c <config>``
    (the argv the agent finds it by), sees the domain's hosts file at /etc/hosts (the node's
    is untouched), answers READY, lives in the host's cgroup and in no session of the
    caller's; the host logs the start."""
    require_cgroup2()
    files = imex_files(imex_root)
    imex = gb200.tools_dir / "nvidia-imex"
    node_hosts = Path("/etc/hosts").read_bytes()
    with cgroups("host") as groups:
        host = _host(tmp_path, gb200, imex_root, cgroup=groups["host"])
        try:
            control = ImexControl(imex, gb200.tools_dir / "nvidia-imex-ctl",
                                  HostLauncher(host.socket))
            asyncio.run(control.start(files.config, files.hosts))
            pid = control.find(files.config)
            assert pid is not None
            assert command_line(pid) is not None
            assert control.runs(pid, files.config)
            assert Path(f"/proc/{pid}/root/etc/hosts").read_text() == files.hosts.read_text()
            assert Path("/etc/hosts").read_bytes() == node_hosts
            wait_for(lambda: asyncio.run(control.state(files.config)) == "READY", 20,
                     "the daemon to answer READY")
            assert in_cgroup(pid).endswith(f"/{groups['host'].name}")
            assert os.getsid(pid) != os.getsid(0)
            launched = [line for line in host.logs().splitlines()
                        if "imex daemon launched" in line]
            assert len(launched) == 1 and str(files.config) in launched[0], host.logs()
            asyncio.run(control.stop(pid, files.config))
            assert not alive(pid)
        finally:
            host.stop()


def _launch(host: HostProcess, **fields: str) -> None:
    asyncio.run(HostLauncher(host.socket).launch_imex(
        fields["imex"], fields["config"], fields["hosts"], timeout_s=20))


def test_what_the_host_does_not_run_is_refused_naming_the_field(
        tmp_path: Path, gb200: SimulatedNode, imex_root: Path) -> None:
    """Another binary, a config outside the root or spelled with ``..``, a hosts file that is
    a symlink, an unknown key: each is refused with the field at fault (the agent sees
    ImexUnavailable naming the host's socket), nothing starts, and the host keeps serving."""
    files = imex_files(imex_root)
    imex = str(gb200.tools_dir / "nvidia-imex")
    outside = tmp_path / "outside.cfg"
    outside.write_text(files.config.read_text())
    (imex_root / "linked-hosts").symlink_to(files.hosts)
    good = {"imex": imex, "config": str(files.config), "hosts": str(files.hosts)}
    host = _host(tmp_path, gb200, imex_root)
    try:
        for change, field in [
                ({"imex": "/bin/sh"}, "imex"),
                ({"imex": str(gb200.tools_dir / "nvidia-imex-ctl")}, "imex"),
                ({"config": str(outside)}, "config"),
                ({"config": f"{imex_root}/../outside.cfg"}, "config"),
                ({"hosts": str(imex_root / "linked-hosts")}, "hosts"),
                ({"hosts": str(imex_root / "absent")}, "hosts")]:
            with pytest.raises(ImexUnavailable) as refused:
                _launch(host, **{**good, **change})
            assert f"({field})" in refused.value.detail, (change, refused.value.detail)
            assert str(host.socket) in refused.value.detail
        unknown = _raw(host.socket, json.dumps(
            {"v": 1, "op": "launch-imex", **good, "env": {"LD_PRELOAD": "/x.so"}}).encode()
            + b"\n")
        assert (unknown["ok"], unknown["error"], unknown["field"]) == (
            False, "bad-request", "env")
        assert not any(str(files.config) in " ".join(command_line(int(p.name)) or [])
                       for p in Path("/proc").iterdir() if p.name.isdigit())
        assert _raw(host.socket, b'{"v": 1, "op": "ping"}\n')["imex"] == imex
    finally:
        host.stop()


def test_a_host_without_imex_refuses_every_imex_start(
        tmp_path: Path, gb200: SimulatedNode, imex_root: Path) -> None:
    files = imex_files(imex_root)
    mps_root = tmp_path / "mps"
    mps_root.mkdir()
    host = start_host(tmp_path, mps_root=mps_root,
                      mps_control=gb200.tools_dir / "nvidia-cuda-mps-control")
    try:
        with pytest.raises(ImexUnavailable) as refused:
            _launch(host, imex=str(gb200.tools_dir / "nvidia-imex"), config=str(files.config),
                    hosts=str(files.hosts))
        assert "refused (imex)" in refused.value.detail and "--imex" in refused.value.detail
        ping = _raw(host.socket, b'{"v": 1, "op": "ping"}\n')
        assert (ping["imex"], ping["imex_root"]) == (None, None)
    finally:
        host.stop()
