"""The systemd units (the agent, its kubelet plugin, its MPS host): ``systemd-analyze verify``
and the hardening score (Debian's systemd)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent.settings import resolve

from .tools import ROOT, require_tool

UNIT = ROOT / "systemd" / "gpu-agent.service"
PLUGIN_UNIT = ROOT / "systemd" / "gpu-agent-kubelet-plugin.service"
MPS_HOST_UNIT = ROOT / "systemd" / "gpu-agent-mps-host.service"
ENV_EXAMPLE = ROOT / "systemd" / "gpu-agent.env"
#: The issue's bar; the score measured is recorded in docs/deploy.md.
MAX_EXPOSURE = 3.5


def _test_copy(tmp_path: Path, unit: Path = UNIT) -> Path:
    """The unit with ExecStart on this environment's gpu-agent (a clean clone has no
    /usr/bin/gpu-agent)."""
    gpu_agent = Path(sys.executable).parent / "gpu-agent"
    assert gpu_agent.exists(), f"{gpu_agent} missing: install the project (make test does)"
    text = unit.read_text()
    assert text.count("ExecStart=/usr/bin/gpu-agent ") == 1
    copy = tmp_path / unit.name
    copy.write_text(text.replace("ExecStart=/usr/bin/gpu-agent ", f"ExecStart={gpu_agent} "))
    return copy


def _directives(unit: Path = UNIT) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            found.setdefault(key, []).append(value)
    return found


def test_units_verify(tmp_path: Path) -> None:
    """The three units, loaded together as on a host, verify without a word about any."""
    analyze = require_tool("systemd-analyze", "Debian: apt-get install systemd")
    units = (UNIT, PLUGIN_UNIT, MPS_HOST_UNIT)
    copies = [str(_test_copy(tmp_path, unit)) for unit in units]
    done = subprocess.run([analyze, "verify", *copies],
                          capture_output=True, text=True, timeout=60, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for unit in units:
        assert unit.name not in output, output


@pytest.mark.parametrize("unit", [UNIT, PLUGIN_UNIT], ids=lambda u: u.stem)
def test_security_exposure_is_at_most_3_5(tmp_path: Path, unit: Path) -> None:
    """Each unit's exposure is at most the issue's bar, and the score docs/deploy.md records
    is the one measured."""
    analyze = require_tool("systemd-analyze", "Debian: apt-get install systemd")
    done = subprocess.run([analyze, "security", "--offline=true", "--no-pager",
                           str(_test_copy(tmp_path, unit))],
                          capture_output=True, text=True, timeout=60, check=False)
    output = done.stdout + done.stderr
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", output)
    assert match, output
    score = float(match.group(1))
    assert score <= MAX_EXPOSURE, output
    assert re.search(rf"`{re.escape(unit.name)}`[^\n]*exposure level[^\n]*\b{score}\b",
                     (ROOT / "docs" / "deploy.md").read_text()), \
        f"record {unit.name}'s score {score} in docs/deploy.md"


def test_plugin_unit_follows_the_agent_and_owns_only_its_sockets() -> None:
    """The plugin starts after the agent and goes with it, reaches it on the socket the
    agent's settings example listens on, and may write only kubelet's registry and its own
    plugin directory, without any capability."""
    d = _directives(PLUGIN_UNIT)
    assert d["After"][0].split()[0] == "gpu-agent.service"
    assert d["Requires"] == ["gpu-agent.service"]
    assert d["Restart"] == ["always"]
    exec_start = d["ExecStart"][0].split()
    assert exec_start[:2] == ["/usr/bin/gpu-agent", "kubelet-plugin"]
    flags = dict(a.split("=", 1) for a in exec_start[2:] if a.startswith("--"))
    env = dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
               if line and not line.startswith("#"))
    assert f"unix:{flags['--agent-socket']}" in env["GPU_AGENT_LISTEN"].split(",")
    assert d["ReadWritePaths"] == [f"{flags['--registry-dir']} "
                                   f"{flags['--plugins-dir']}/{flags['--driver']}"]
    assert d["CapabilityBoundingSet"] == [""] and d["NoNewPrivileges"] == ["yes"]
    assert d["ProtectSystem"] == ["strict"]


def test_unit_has_what_the_agent_relies_on() -> None:
    d = _directives()
    for key, value in {"Type": "notify", "NotifyAccess": "main", "Restart": "on-failure",
                       "RuntimeDirectory": "gpu-agent", "StateDirectory": "gpu-agent",
                       "ProtectSystem": "strict", "DevicePolicy": "closed",
                       "NoNewPrivileges": "yes", "MemoryDenyWriteExecute": "yes"}.items():
        assert d.get(key) == [value], key
    assert "WatchdogSec" in d
    # Over systemd's 1,024 default, so the API listeners' connection caps are not squeezed.
    assert int(d["LimitNOFILE"][0]) >= 4096
    assert d["ReadWritePaths"] == ["/var/run/cdi -/run/gpu-agent-mps"]
    assert d["SystemCallFilter"][0] == "@system-service"
    assert "CAP_SYS_ADMIN" in d["CapabilityBoundingSet"][0]
    assert {v.split()[0] for v in d["DeviceAllow"]} >= {"/dev/nvidiactl", "char-nvidia",
                                                        "char-nvidia-caps", "/dev/nvidia-uvm"}
    assert d["EnvironmentFile"] == ["-/etc/gpu-agent/gpu-agent.env"]


def test_env_example_is_valid_settings() -> None:
    env = dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
               if line and not line.startswith("#"))
    settings = resolve({}, env)
    assert settings.simulate is None
    assert str(settings.state_dir) == "/var/lib/gpu-agent"
    assert [str(listener) for listener in settings.listen] == [
        "unix:/run/gpu-agent/agent.sock", "127.0.0.1:9401"]
    assert str(settings.metrics_listen) == "0.0.0.0:9400"
    assert str(settings.token_file) == "/etc/gpu-agent/tokens"


#: The MPS host's bar: its sandbox binds the MPS servers its daemons start (CUDA JIT, one
#: server per client user, a mount namespace per daemon), so it keeps more than the agent.
MPS_HOST_MAX_EXPOSURE = 5.0


def test_mps_host_exposure_is_at_most_5_and_recorded(tmp_path: Path) -> None:
    """The MPS host unit's exposure is at most 5.0, and docs/sharing.md records the score
    measured."""
    analyze = require_tool("systemd-analyze", "Debian: apt-get install systemd")
    done = subprocess.run([analyze, "security", "--offline=true", "--no-pager",
                           str(_test_copy(tmp_path, MPS_HOST_UNIT))],
                          capture_output=True, text=True, timeout=60, check=False)
    output = done.stdout + done.stderr
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", output)
    assert match, output
    score = float(match.group(1))
    assert score <= MPS_HOST_MAX_EXPOSURE, output
    assert re.search(rf"`{re.escape(MPS_HOST_UNIT.name)}`[^\n]*exposure level[^\n]*\b{score}\b",
                     (ROOT / "docs" / "sharing.md").read_text()), \
        f"record {MPS_HOST_UNIT.name}'s score {score} in docs/sharing.md"


def test_mps_host_outlives_the_agent_and_keeps_its_daemons() -> None:
    """The agent wants the MPS host and starts after it, without the host following the
    agent; stopping the host signals only its own process (KillMode=process) and keeps its
    directories; host and agent name the same socket and MPS root, outside the agent's
    RuntimeDirectory (removed whenever the agent stops)."""
    host = _directives(MPS_HOST_UNIT)
    agent = _directives()
    assert "gpu-agent-mps-host.service" in " ".join(agent["Wants"]).split()
    assert "gpu-agent-mps-host.service" in agent["After"][0].split()
    assert "Requires" not in host and "PartOf" not in host and "BindsTo" not in host
    assert host["KillMode"] == ["process"]
    assert host["RuntimeDirectoryPreserve"] == ["yes"]
    assert host["Restart"] == ["always"]
    exec_start = host["ExecStart"][0].split()
    assert exec_start[:2] == ["/usr/bin/gpu-agent", "mps-host"]
    flags = dict(a.split("=", 1) for a in exec_start[2:] if a.startswith("--") and "=" in a)
    assert "--private-shm" in exec_start
    env = dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
               if line and not line.startswith("#"))
    settings = resolve({}, env)
    assert str(settings.mps_host_socket) == flags["--socket"]
    assert str(settings.mps_root) == flags["--mps-root"]
    runtime = {f"/run/{name}" for name in host["RuntimeDirectory"][0].split()}
    assert {flags["--mps-root"], str(Path(flags["--socket"]).parent)} == runtime
    assert not flags["--mps-root"].startswith(f"/run/{agent['RuntimeDirectory'][0]}/")
    assert f"-{flags['--mps-root']}" in agent["ReadWritePaths"][0].split()


def test_mps_host_starts_the_agent_s_imex_daemon_from_the_agent_s_imex_directory() -> None:
    """The host unit runs the IMEX daemon with the agent's <state dir>/imex as its IMEX root,
    writable in its sandbox (StateDirectory), and lets it use the network it listens on."""
    host = _directives(MPS_HOST_UNIT)
    exec_start = host["ExecStart"][0].split()
    flags = dict(a.split("=", 1) for a in exec_start[2:] if a.startswith("--") and "=" in a)
    env = dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
               if line and not line.startswith("#"))
    settings = resolve({}, env)
    assert flags["--imex-root"] == str(settings.state_dir / "imex")
    assert flags["--imex"] == "${IMEX}" and "IMEX=/usr/bin/nvidia-imex" in host["Environment"]
    assert host["StateDirectory"] == ["gpu-agent/imex"]
    families = host["RestrictAddressFamilies"][0].split()
    assert {"AF_INET", "AF_INET6"} <= set(families)
