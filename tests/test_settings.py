"""Settings: flags beat environment beat config file beat defaults; bad values are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.errors import InvalidRequest
from agent.settings import Listener, resolve


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:9401", Listener(host="127.0.0.1", port=9401)),
    ("0.0.0.0:0", Listener(host="0.0.0.0", port=0)),
    ("[::1]:8080", Listener(host="::1", port=8080)),
    (":9401", Listener(host="0.0.0.0", port=9401)),
    ("unix:/run/gpu-agent/agent.sock", Listener(path=Path("/run/gpu-agent/agent.sock"))),
])
def test_listener_forms(text: str, expected: Listener) -> None:
    assert Listener.parse(text) == expected


@pytest.mark.parametrize("text", ["localhost", "host:port", "1.2.3.4:70000", "unix:"])
def test_bad_listener_is_rejected(text: str) -> None:
    with pytest.raises(ValueError, match=r"HOST:PORT|socket path"):
        Listener.parse(text)


def test_simulate_defaults_keep_everything_in_the_state_dir(tmp_path: Path) -> None:
    s = resolve({"simulate": "dgx-h100", "state_dir": str(tmp_path)}, env={})
    assert s.listen == (Listener(path=tmp_path / "agent.sock"),
                        Listener(host="127.0.0.1", port=9401))
    assert s.proc_root == tmp_path / "proc"
    assert s.cdi_dir == tmp_path / "cdi"


@pytest.mark.parametrize(("state_dir", "run_dir"), [
    (".gpu-agent-sim", ".gpu-agent-sim.run"),  # make run's: one dot, as .gitignore names it
    ("sim-state", ".sim-state.run"),
])
def test_simulated_run_dir_is_a_hidden_sibling_of_the_state_dir(
        state_dir: str, run_dir: str, tmp_path: Path) -> None:
    s = resolve({"simulate": "dgx-h100", "state_dir": str(tmp_path / state_dir)}, env={})
    assert s.run_dir == tmp_path / run_dir


def test_real_node_defaults() -> None:
    s = resolve({}, env={"NODE_NAME": "worker-1"})
    assert s.simulate is None
    assert s.state_dir == Path("/var/lib/gpu-agent")
    assert [str(x) for x in s.listen] == ["unix:/run/gpu-agent/agent.sock", "127.0.0.1:9401"]
    assert s.node_name == "worker-1"
    assert s.proc_root == Path("/proc")


def test_precedence_flag_over_env_over_config(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('log-format = "json"\nauth_read = true\nnode_name = "from-config"\n'
                      'listen = ["127.0.0.1:1"]\n')
    env = {"GPU_AGENT_CONFIG": str(config), "GPU_AGENT_NODE_NAME": "from-env",
           "GPU_AGENT_LISTEN": "127.0.0.1:2,unix:/tmp/x.sock"}
    s = resolve({"node_name": "from-flag"}, env=env)
    assert s.node_name == "from-flag"
    assert [str(x) for x in s.listen] == ["127.0.0.1:2", "unix:/tmp/x.sock"]
    assert s.log_format == "json"
    assert s.auth_read is True


@pytest.mark.parametrize(("env", "field"), [
    ({"GPU_AGENT_AUTH_READ": "maybe"}, "auth_read"),
    ({"GPU_AGENT_LOG_FORMAT": "xml"}, "log_format"),
    ({"GPU_AGENT_LISTEN": "nowhere"}, "listen"),
])
def test_bad_values_name_the_field(env: dict[str, str], field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        resolve({}, env=env)
    assert info.value.errors[0]["field"] == field


def test_unknown_config_key_is_an_error(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text("listn = ['127.0.0.1:1']\n")
    with pytest.raises(InvalidRequest, match="unknown key 'listn'"):
        resolve({"config": str(config)}, env={})


@pytest.mark.parametrize("name", ["driver_root", "dev_root", "mps_control", "nvidia_smi",
                                  "mps_host_socket", "tls_cert", "token_file"])
def test_path_flags_are_paths_whatever_their_source(name: str, tmp_path: Path) -> None:
    """A path flag is a Path from the command line (argparse gives a string) as from the
    environment: `gpu-agent serve --driver-root DIR`, as the DaemonSet runs it, crashed at
    start with a TypeError joining the string to the driver's library directories."""
    extra = {"tls_key": "/k"} if name == "tls_cert" else {}
    from_flag = resolve({name: "/some/where", **extra}, env={})
    from_env = resolve({**extra}, env={f"GPU_AGENT_{name.upper()}": "/some/where"})
    assert getattr(from_flag, name) == getattr(from_env, name)
    assert isinstance(getattr(from_flag, name), Path)


@pytest.mark.parametrize(("flags", "env", "config", "expected"), [
    ({"sim_clique_id": "7"}, {}, None, 7),
    ({}, {"GPU_AGENT_SIM_CLIQUE_ID": "7"}, None, 7),
    ({}, {}, "sim-clique-id = 7\n", 7),
    ({}, {}, None, None),
])
def test_the_simulated_clique_id_is_an_integer_from_any_source(
        tmp_path: Path, flags: dict[str, str], env: dict[str, str], config: str | None,
        expected: int | None) -> None:
    if config is not None:
        (tmp_path / "agent.toml").write_text(config)
        env = {**env, "GPU_AGENT_CONFIG": str(tmp_path / "agent.toml")}
    settings = resolve({"simulate": "gb200-nvl72", "state_dir": str(tmp_path / "s"), **flags},
                       env=env)
    assert settings.sim_clique_id == expected


@pytest.mark.parametrize(("flags", "field", "message"), [
    ({"simulate": "gb200-nvl72", "sim_clique_id": "seven"}, "sim_clique_id",
     "not a non-negative integer"),
    ({"simulate": "gb200-nvl72", "sim_clique_id": "-1"}, "sim_clique_id",
     "not a non-negative integer"),
    ({"sim_cluster_uuid": "9c6f5af3-0b6d-4c1e-8f43-6a2d51f0c7e2"}, "sim_cluster_uuid",
     "need --simulate"),
    ({"sim_clique_id": "3"}, "sim_clique_id", "need --simulate"),
])
def test_bad_domain_flags_name_the_field(flags: dict[str, str], field: str,
                                         message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as info:
        resolve(flags, env={})
    assert info.value.errors[0]["field"] == field


@pytest.mark.parametrize(("flags", "field"), [
    ({"imex_address": "node-1"}, "imex_address"),
    ({"imex_address": "10.0.0.5", "imex_port": "0"}, "imex_port"),
    ({"imex_address": "10.0.0.5", "imex_port": "70000"}, "imex_port"),
    ({"imex_address": "10.0.0.5", "imex_ready_timeout_s": "0"}, "imex_ready_timeout_s"),
])
def test_imex_settings_are_refused_naming_the_flag(flags: dict[str, str], field: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        resolve({"simulate": "gb200-nvl72", **flags}, env={})
    assert [e["field"] for e in refused.value.errors] == [field]


def test_imex_settings_default_to_off_and_read_the_environment() -> None:
    off = resolve({"simulate": "gb200-nvl72"}, env={})
    assert (off.imex_address, off.imex_port, off.imex_ready_timeout_s) == (None, 50000, 30.0)
    on = resolve({"simulate": "gb200-nvl72"}, env={"GPU_AGENT_IMEX_ADDRESS": "10.0.0.5",
                                                    "GPU_AGENT_IMEX_PORT": "50001",
                                                    "GPU_AGENT_IMEX_READY_TIMEOUT_S": "5"})
    assert (on.imex_address, on.imex_port, on.imex_ready_timeout_s) == ("10.0.0.5", 50001, 5.0)
