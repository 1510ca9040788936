"""Settings of ``gpu-agent serve``, parsed once and frozen.

Precedence: command-line flag, then ``GPU_AGENT_<FLAG>`` in the environment, then the TOML
``--config`` file (keys are the flag names with ``_`` or ``-``), then the defaults.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.device_names import ascii_integer
from agent.errors import InvalidRequest

DEFAULT_SOCKET = "unix:/run/gpu-agent/agent.sock"
DEFAULT_TCP = "127.0.0.1:9401"
SIM_STATE_DIR = Path(".gpu-agent-sim")


@dataclass(frozen=True)
class Listener:
    """Where the API listens: a TCP ``host:port`` (port 0 picks one) or a Unix socket path."""

    host: str | None = None
    port: int | None = None
    path: Path | None = None

    @classmethod
    def parse(cls, text: str) -> Listener:
        if text.startswith("unix:"):
            if not text[5:]:
                raise ValueError("unix: needs a socket path, e.g. unix:/run/gpu-agent/agent.sock")
            return cls(path=Path(text[5:]))
        host, sep, port = text.rpartition(":")
        number = ascii_integer(port, digits=5)
        if not sep or number is None or number > 65535:
            raise ValueError(f"{text!r} is neither HOST:PORT nor unix:PATH")
        return cls(host=host.strip("[]") or "0.0.0.0", port=number)

    def __str__(self) -> str:
        return f"unix:{self.path}" if self.path else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Settings:
    simulate: str | None
    state_dir: Path
    cdi_dir: Path
    listen: tuple[Listener, ...]
    token_file: Path | None
    auth_read: bool
    log_format: str
    log_level: str
    proc_root: Path
    node_name: str
    gpu_reset_command: str | None = None
    #: Per-boot files kept outside the state directory (a tmpfs on hosts): the marker that a
    #: claims checkpoint was written on this boot. None: not kept.
    run_dir: Path | None = None
    driver_root: Path | None = None
    claim_tombstone_s: float = 600.0
    #: Where device nodes are looked for before a prepare is answered (``<dev_root>/dev/...``);
    #: None: the driver root when it has ``dev/nvidiactl``, else ``/`` (the simulator's own).
    dev_root: Path | None = None
    #: How long a prepare waits for its devices' nodes to appear before answering 503.
    device_node_wait_s: float = 5.0
    reapply_mig: bool = True
    drift_check_interval_s: float = 30.0
    max_body_bytes: int = 1 << 20
    shutdown_timeout_s: float = 10.0
    collect_interval_s: float = 5.0
    #: A dedicated listener for /metrics, /healthz and /readyz (port 9400 in deployments).
    metrics_listen: Listener | None = None
    #: ``Hostname`` (dcgm-exporter up to 4.8.2) or ``hostname`` (newer releases).
    metrics_hostname_label: str = "Hostname"
    #: The DRA driver name the ResourceSlices carry.
    driver_name: str = "gpu.nodeagent.dev"
    #: Publish MIG as partitionable devices (every profile and placement, shared counters).
    dynamic_mig: bool = False
    #: TLS on the API's TCP listeners; client certificates required when a CA is given.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    #: Group that owns the API's Unix socket (mode 0660), by name or number.
    socket_group: str | None = None
    #: Kubelet's PodResources socket: label DCGM series with the pods holding the devices.
    #: None: off (needs the ``kubernetes`` extra when set).
    pod_resources_socket: Path | None = None
    #: Where each MPS control daemon's pipe, log and shm directories go (``<mps_root>/<id>/``).
    #: Keep it short: MPS puts Unix sockets in the pipe directory (108-byte path limit).
    mps_root: Path | None = None
    #: The ``nvidia-cuda-mps-control`` binary; None: ``<driver_root>/usr/bin/`` (or ``/usr/bin/``),
    #: the simulator's own with ``--simulate``.
    mps_control: Path | None = None
    #: The ``nvidia-smi`` binary (compute mode, time slice); None: as ``mps_control``.
    nvidia_smi: Path | None = None
    #: The MPS host's socket (``gpu-agent mps-host``): MPS daemons are started there, outside
    #: the agent's cgroup, so that they outlive an agent restart. None: the agent starts them
    #: itself (development only: they die with the agent's container or unit).
    mps_host_socket: Path | None = None
    #: Publish full GPUs as shareable devices with a ``memory`` capacity (DRA consumable
    #: capacity); each share is enforced with MPS.
    gpu_shares: bool = False
    #: Taint a lost GPU's devices, and those of a reboot-class fault (XID 79, or the driver's
    #: "reboot the node"), ``NoExecute`` instead of ``NoSchedule``: Kubernetes then evicts
    #: the pods using them (docs/health.md).
    no_execute_taints: bool = False
    #: With --simulate: the NVLink domain the simulated node's GPUs report (cluster UUID,
    #: clique id); agents given the same pair form one domain. None: the preset's own.
    sim_cluster_uuid: str | None = None
    sim_clique_id: int | None = None
    #: This node's IMEX address (the IP its IMEX daemon binds to, as the domain's peer lists
    #: name it). None: compute domains are not configured on this node.
    imex_address: str | None = None
    #: The IMEX daemons' peer port (the same on every node of a domain).
    imex_port: int = 50000
    #: How long a prepare of an IMEX channel waits for this node's daemon to be READY.
    imex_ready_timeout_s: float = 30.0
    #: The ``nvidia-imex`` and ``nvidia-imex-ctl`` binaries; None: as ``mps_control``.
    imex: Path | None = None
    imex_ctl: Path | None = None


# Flags the environment and the config file may set, with their parsers.
_FLAG_TYPES: dict[str, str] = {
    "simulate": "str", "state_dir": "path", "cdi_dir": "path", "listen": "list",
    "token_file": "path", "auth_read": "bool", "log_format": "str", "log_level": "str",
    "proc_root": "path", "node_name": "str", "config": "path", "gpu_reset_command": "str",
    "reapply_mig": "bool", "driver_root": "path", "claim_tombstone_s": "float",
    "collect_interval": "float", "metrics_listen": "str", "metrics_hostname_label": "str",
    "driver_name": "str", "dynamic_mig": "bool", "tls_cert": "path", "tls_key": "path",
    "tls_client_ca": "path", "socket_group": "str", "run_dir": "path", "dev_root": "path",
    "device_node_wait_s": "float", "pod_resources_socket": "path", "mps_root": "path",
    "mps_control": "path", "nvidia_smi": "path", "mps_host_socket": "path", "gpu_shares": "bool",
    "no_execute_taints": "bool", "sim_cluster_uuid": "str", "sim_clique_id": "int",
    "imex_address": "str", "imex_port": "int", "imex_ready_timeout_s": "float",
    "imex": "path", "imex_ctl": "path",
}


def _coerce(name: str, value: Any) -> Any:
    kind = _FLAG_TYPES[name]
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise InvalidRequest(f"{name}: {value!r} is not a boolean",
                             [{"field": name, "reason": "not a boolean"}])
    if kind == "list":
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return [str(v) for v in value]
    if kind == "path":
        return Path(str(value))
    if kind == "int":
        whole = None if isinstance(value, bool) else ascii_integer(str(value).strip(), digits=10)
        if whole is None:
            raise InvalidRequest(f"{name}: {value!r} is not a non-negative integer",
                                 [{"field": name, "reason": "not a non-negative integer"}])
        return whole
    if kind == "float":
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = -1.0
        if number < 0:
            raise InvalidRequest(f"{name}: {value!r} is not a non-negative number",
                                 [{"field": name, "reason": "not a non-negative number"}])
        return number
    return str(value)


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name in _FLAG_TYPES:
        key = f"GPU_AGENT_{name.upper()}"
        if key in env:
            found[name] = _coerce(name, env[key])
    return found


def _from_config(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            doc = tomllib.load(fh)
    except OSError as err:
        raise InvalidRequest(f"config file {path}: {err.strerror}") from err
    except tomllib.TOMLDecodeError as err:
        raise InvalidRequest(f"config file {path}: {err}") from err
    found: dict[str, Any] = {}
    for key, value in doc.items():
        name = key.replace("-", "_")
        if name not in _FLAG_TYPES or name == "config":
            raise InvalidRequest(f"config file {path}: unknown key {key!r}",
                                 [{"field": key, "reason": "unknown key"}])
        found[name] = _coerce(name, value)
    return found


def resolve(flags: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Settings:
    """Merge flags (``None`` = not given), environment and config file into :class:`Settings`."""
    env = os.environ if env is None else env
    from_env = _from_env(env)
    # Paths given as flags arrive as argparse's strings: typed as the environment's and the
    # config file's are (a string driver root crashed the start with a TypeError).
    given = {k: _coerce(k, v) if _FLAG_TYPES.get(k) == "path" else v
             for k, v in flags.items() if v is not None and v != []}
    config_path = given.get("config") or from_env.get("config")
    merged: dict[str, Any] = _from_config(Path(config_path)) if config_path else {}
    merged.update(from_env)
    merged.update(given)

    simulate = merged.get("simulate")
    state_dir = Path(merged.get("state_dir") or
                     (SIM_STATE_DIR if simulate else Path("/var/lib/gpu-agent"))).absolute()
    if simulate:
        default_listen = [f"unix:{state_dir / 'agent.sock'}", DEFAULT_TCP]
    else:
        default_listen = [DEFAULT_SOCKET, DEFAULT_TCP]
    try:
        listen = tuple(Listener.parse(t) for t in (merged.get("listen") or default_listen))
    except ValueError as err:
        raise InvalidRequest(f"--listen: {err}", [{"field": "listen", "reason": str(err)}]) from err
    metrics = _metrics_settings(merged)
    log_format = merged.get("log_format", "text")
    if merged.get("gpu_shares") and merged.get("dynamic_mig"):
        # MPS enforces every share, and NVIDIA's driver forbids MPS with dynamic MIG: a GPU
        # published both as MIG slices and as memory shares could be booked twice.
        raise InvalidRequest("--gpu-shares cannot be combined with --dynamic-mig: shares are "
                             "enforced with MPS, which dynamic MIG does not support",
                             [{"field": "gpu_shares", "reason": "conflicts with dynamic_mig"}])
    given_sim = [n for n in ("sim_cluster_uuid", "sim_clique_id") if merged.get(n) is not None]
    if given_sim and not simulate:
        raise InvalidRequest("--sim-cluster-uuid and --sim-clique-id need --simulate (a real "
                             "node's GPUs report their own NVLink domain)",
                             [{"field": given_sim[0], "reason": "needs simulate"}])
    if log_format not in ("text", "json"):
        raise InvalidRequest(f"--log-format must be text or json, not {log_format!r}",
                             [{"field": "log_format", "reason": "not text or json"}])
    # ``.gpu-agent-sim.run`` beside ``.gpu-agent-sim`` (one leading dot, ignored by git).
    run_dir = Path(merged.get("run_dir") or (
        state_dir.parent / f".{state_dir.name.lstrip('.')}.run" if simulate
        else Path("/run/gpu-agent"))).absolute()
    return Settings(
        simulate=simulate,
        state_dir=state_dir,
        cdi_dir=Path(merged.get("cdi_dir") or
                     (state_dir / "cdi" if simulate else Path("/var/run/cdi"))).absolute(),
        listen=listen,
        token_file=Path(merged["token_file"]) if merged.get("token_file") else None,
        auth_read=bool(merged.get("auth_read", False)),
        log_format=log_format,
        log_level=str(merged.get("log_level", "info")),
        proc_root=Path(merged.get("proc_root") or
                       (state_dir / "proc" if simulate else Path("/proc"))).absolute(),
        node_name=str(merged.get("node_name") or env.get("NODE_NAME") or socket.gethostname()),
        gpu_reset_command=merged.get("gpu_reset_command"),
        run_dir=run_dir,
        reapply_mig=bool(merged.get("reapply_mig", True)),
        driver_root=merged.get("driver_root"),
        claim_tombstone_s=float(merged.get("claim_tombstone_s", 600.0)),
        dev_root=merged.get("dev_root"),
        device_node_wait_s=float(merged.get("device_node_wait_s", 5.0)),
        driver_name=_driver_name(str(merged.get("driver_name", "gpu.nodeagent.dev"))),
        dynamic_mig=bool(merged.get("dynamic_mig", False)),
        socket_group=merged.get("socket_group"),
        pod_resources_socket=_pod_resources_socket(merged.get("pod_resources_socket")),
        mps_root=Path(merged.get("mps_root") or run_dir / "mps").absolute(),
        mps_control=merged.get("mps_control"),
        nvidia_smi=merged.get("nvidia_smi"),
        mps_host_socket=merged.get("mps_host_socket"),
        gpu_shares=bool(merged.get("gpu_shares", False)),
        no_execute_taints=bool(merged.get("no_execute_taints", False)),
        sim_cluster_uuid=merged.get("sim_cluster_uuid"),
        sim_clique_id=None if merged.get("sim_clique_id") is None
        else _coerce("sim_clique_id", merged["sim_clique_id"]),
        **metrics,
        **_tls_settings(merged),
        **_imex_settings(merged),
    )


def _imex_settings(merged: Mapping[str, Any]) -> dict[str, Any]:
    """--imex-address (an IP address), --imex-port (1-65535), --imex-ready-timeout-s
    (above 0, at most an hour), --imex and --imex-ctl."""
    address = merged.get("imex_address")
    if address is not None and str(address) != "":
        try:
            address = str(ipaddress.ip_address(str(address)))
        except ValueError:
            raise InvalidRequest(f"--imex-address {str(address)[:60]!r} is not an IP address "
                                 "(the address this node's IMEX daemon binds to)",
                                 [{"field": "imex_address", "reason": "not an IP address"}]
                                 ) from None
    else:
        address = None
    port = merged.get("imex_port", 50000)
    port = _coerce("imex_port", port) if not isinstance(port, int) else port
    if isinstance(port, bool) or not 1 <= port <= 65535:
        raise InvalidRequest(f"--imex-port must be 1-65535, not {port}",
                             [{"field": "imex_port", "reason": "not within 1-65535"}])
    timeout = float(_coerce("imex_ready_timeout_s", merged.get("imex_ready_timeout_s", 30.0)))
    if not 0 < timeout <= 3600:
        raise InvalidRequest(f"--imex-ready-timeout-s must be above 0 and at most 3600, not "
                             f"{timeout:g}", [{"field": "imex_ready_timeout_s",
                                               "reason": "not within (0, 3600]"}])
    return {"imex_address": address, "imex_port": port, "imex_ready_timeout_s": timeout,
            "imex": merged.get("imex"), "imex_ctl": merged.get("imex_ctl")}


def _tls_settings(merged: Mapping[str, Any]) -> dict[str, Any]:
    """--tls-cert and --tls-key together; --tls-client-ca only with them."""
    cert, key, ca = (merged.get(n) for n in ("tls_cert", "tls_key", "tls_client_ca"))
    if (cert is None) != (key is None):
        raise InvalidRequest("--tls-cert and --tls-key must be given together",
                             [{"field": "tls_cert" if cert is None else "tls_key",
                               "reason": "missing"}])
    if ca is not None and cert is None:
        raise InvalidRequest("--tls-client-ca needs --tls-cert and --tls-key (client "
                             "certificates are only asked for over TLS)",
                             [{"field": "tls_client_ca", "reason": "needs tls_cert"}])
    return {name: None if value is None else Path(value)
            for name, value in (("tls_cert", cert), ("tls_key", key), ("tls_client_ca", ca))}


def _pod_resources_socket(value: Any) -> Path | None:
    """--pod-resources-socket, refused at start-up when grpcio (the ``kubernetes`` extra) is
    not installed: pod labels silently missing would be worse than not starting."""
    if value is None or str(value) == "":
        return None
    if importlib.util.find_spec("grpc") is None:
        raise InvalidRequest(
            "--pod-resources-socket needs grpcio, which is not installed: install "
            "gpu-node-agent[kubernetes], or leave the flag out",
            [{"field": "pod_resources_socket", "reason": "grpcio is not installed"}])
    return Path(str(value)).absolute()


def _driver_name(name: str) -> str:
    """A DRA driver name: a lower-case DNS subdomain of at most 63 characters."""
    label = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
    if len(name) > 63 or not re.fullmatch(rf"{label}(\.{label})*", name):
        raise InvalidRequest(f"--driver-name {name!r} is not a lower-case DNS subdomain of at "
                             "most 63 characters (e.g. gpu.nodeagent.dev)",
                             [{"field": "driver_name", "reason": "not a DNS subdomain"}])
    return name


# Bounds of --collect-interval: faster than 50 ms is a busy loop, slower than an hour is off.
_COLLECT_INTERVAL_S = (0.05, 3600.0)


def _metrics_settings(merged: Mapping[str, Any]) -> dict[str, Any]:
    """--collect-interval, --metrics-listen and --metrics-hostname-label, validated."""
    interval = float(merged.get("collect_interval", 5.0))
    low, high = _COLLECT_INTERVAL_S
    if not low <= interval <= high:
        raise InvalidRequest(f"--collect-interval must be {low:g}-{high:g} seconds, not "
                             f"{interval:g}", [{"field": "collect_interval",
                                                "reason": f"not within {low:g}-{high:g}"}])
    label = str(merged.get("metrics_hostname_label", "Hostname"))
    if label not in ("Hostname", "hostname"):
        raise InvalidRequest(f"--metrics-hostname-label must be Hostname or hostname, not "
                             f"{label!r}", [{"field": "metrics_hostname_label",
                                             "reason": "not Hostname or hostname"}])
    listen = merged.get("metrics_listen")
    try:
        metrics_listen = Listener.parse(str(listen)) if listen else None
    except ValueError as err:
        raise InvalidRequest(f"--metrics-listen: {err}",
                             [{"field": "metrics_listen", "reason": str(err)}]) from err
    return {"collect_interval_s": interval, "metrics_listen": metrics_listen,
            "metrics_hostname_label": label}

