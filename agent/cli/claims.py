"""``gpu-agent claims`` (list, show, prepare, unprepare resource claims on a running agent) and
``gpu-agent cdi`` (the agent's CDI specs; ``generate`` writes the node-wide spec offline, like
``nvidia-ctk cdi generate``, straight from NVML without an agent)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from agent.cli import options
from agent.cli.client import AgentClient, UsageError
from agent.cli.tables import key_values, table
from agent.device_names import ascii_integer, parse_device_name

if TYPE_CHECKING:
    from agent.gpu.types import Gpu

    _SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]
else:
    _SubParsers = argparse._SubParsersAction

_PREPARE_EPILOG = """\
--gpu takes an existing device by any of its names: a GPU index or UUID, a MIG UUID,
<gpu>:<mig>, or a ResourceSlice device name (gpu-<minor>, gpu-<minor>-mig-...).
--slice makes a MIG slice for the claim (destroyed at unprepare): PROFILE[@GPU][:START],
e.g. 1g.10gb (the agent chooses GPU and placement), 3g.40gb@2, 1g.10gb@GPU-...:5, or a
dynamic ResourceSlice device name such as gpu-1-mig-1g10gb-19-0."""


class _AnyName(Mapping[str, argparse.ArgumentParser]):
    """The verbs, as ``choices`` that admit any word (argparse checks the first word against
    ``choices`` before the action sees it)."""

    def __init__(self, verbs: dict[str, argparse.ArgumentParser]) -> None:
        self._verbs = verbs

    def __getitem__(self, name: str) -> argparse.ArgumentParser:
        return self._verbs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._verbs)

    def __len__(self) -> int:
        return len(self._verbs)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str)


class _VerbOrUid(_SubParsers):
    """``claims UID`` is ``claims show UID``: anything that is not a verb is a claim UID."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.choices = _AnyName(self._name_parser_map)  # type: ignore[assignment]

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        if isinstance(values, list) and values and values[0] not in self._name_parser_map:
            values = ["show", *values]
        super().__call__(parser, namespace, values, option_string)


def add_parsers(sub: Any) -> None:
    """Register ``claims`` and ``cdi``."""
    out = [options.OUTPUT]
    claims = sub.add_parser(
        "claims", parents=out, help="prepared resource claims, or one of them",
        description="List the claims prepared on this node (no arguments), show one "
                    "(claims UID), prepare or unprepare one.")
    # Set here only: leaf verbs leave unset options out, so these survive them.
    claims.set_defaults(claims_verb=None, uid=None)
    verbs = claims.add_subparsers(dest="claims_verb", action=_VerbOrUid,
                                  metavar="{UID,show,prepare,unprepare}")
    show = verbs.add_parser("show", parents=out, help="one claim (same as 'claims UID')")
    show.add_argument("uid", help="claim UID")
    prepare = verbs.add_parser(
        "prepare", parents=out, help="prepare a claim (as kubelet's DRA plugin would)",
        epilog=_PREPARE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    prepare.add_argument("uid", help="claim UID")
    prepare.add_argument("--gpu", action="append", default=[], metavar="DEVICE", dest="gpus",
                         help="an existing GPU or MIG device; repeatable")
    prepare.add_argument("--slice", action="append", default=[], dest="slices",
                         metavar="PROFILE[@GPU][:START]",
                         help="a MIG slice made on demand; repeatable")
    prepare.add_argument("--namespace", help="pod namespace (metadata)")
    prepare.add_argument("--name", help="claim name (metadata)")
    prepare.add_argument("--pod", help="pod name (metadata)")
    prepare.add_argument("--container", help="container name (metadata)")
    unprepare = verbs.add_parser("unprepare", parents=out,
                                 help="unprepare a claim (success if it is not prepared)")
    unprepare.add_argument("uid", help="claim UID")

    cdi = sub.add_parser("cdi", help="CDI specs")
    cdi_verbs = cdi.add_subparsers(dest="cdi_verb", required=True)
    cdi_verbs.add_parser("list", parents=out,
                         help="the spec files a running agent maintains")
    generate = cdi_verbs.add_parser(
        "generate", help="write the node-wide spec from NVML, without an agent",
        description="Read the GPUs through NVML (or a simulated node) and write the node-wide "
                    "CDI spec (every device by index and UUID, MIG devices as <gpu>:<mig> and "
                    "MIG-<uuid>, and 'all'), as 'nvidia-ctk cdi generate' does. The agent "
                    "keeps the same spec current by itself while it runs.")
    generate.add_argument("--output", metavar="DIR",
                          help="spec directory to write into, e.g. /var/run/cdi (default: "
                               "print the spec to stdout)")
    generate.add_argument("--simulate", metavar="PRESET",
                          help="read a simulated node (dgx-h100, dgx-a100, hgx-h200, "
                               "a100-pcie-bridged, l40s) instead of the real NVML")
    generate.add_argument("--state-dir", help="the simulated node's state directory "
                                              "(default ./.gpu-agent-sim, as 'serve')")
    generate.add_argument("--proc-root", help="where /proc is (device majors, MIG minors)")
    generate.add_argument("--driver-root", help="where the host's NVIDIA driver files are "
                                                "(adds library mounts and hooks)")


# -- claims -------------------------------------------------------------------------------


def _age(created_at: float, now: float) -> str:
    seconds = max(0, int(now - created_at))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _pod(metadata: dict[str, str]) -> str:
    pod = metadata.get("pod")
    if pod is None:
        return "-"
    namespace = metadata.get("namespace")
    return f"{namespace}/{pod}" if namespace else pod


def sharing_text(device: dict[str, Any]) -> str:
    """A device's sharing as applied: ``MPS 50% 10240 MiB`` (threads, pinned limit),
    ``TimeSlicing Short``, or ``-``."""
    sharing = device.get("sharing")
    if not sharing:
        return "-"
    parts = [sharing["strategy"]]
    if sharing["strategy"] == "TimeSlicing":
        parts.append(sharing.get("interval") or "Default")
    else:
        if sharing.get("thread_percentage") is not None:
            parts.append(f"{sharing['thread_percentage']}%")
        if sharing.get("pinned_limit_mib") is not None:
            parts.append(f"{sharing['pinned_limit_mib']} MiB")
    return " ".join(parts)


def share_text(device: dict[str, Any]) -> str:
    """A device's counted share of its GPU's memory: ``10240 MiB id-0``, or ``-``."""
    share = device.get("share")
    if not share:
        return "-"
    return f"{share['memory_mib']} MiB" + (f" {share['share_id']}" if share.get("share_id")
                                           else "")


def mps_text(claim: dict[str, Any]) -> str:
    """The claim's MPS daemon state (starting, running, failed), or ``-``."""
    mps = claim.get("mps")
    return mps["state"] if mps else "-"


def _joined(values: Sequence[str]) -> str:
    shown = [v for v in dict.fromkeys(values) if v != "-"]
    return ",".join(shown) or "-"


def _notes(claim: dict[str, Any]) -> str:
    mps = claim.get("mps")
    notes = [claim["lost_reason"]] if claim["lost_reason"] else []
    if mps and mps["state"] == "failed" and mps.get("reason"):
        notes.append(f"MPS: {mps['reason']}")
    return "; ".join(notes) or "-"


def devices_table(devices: Sequence[dict[str, Any]], width: int | None = None) -> str:
    """A claim's devices, a row each: what each request got, its sharing and share, and the
    CDI device name a container asks for; ``-o wide`` (``width`` None) adds the kind, the
    UUID and whether it was made on demand."""
    if width is not None:
        return table(["REQUEST", "DEVICE", "SHARING", "SHARE", "CDI DEVICE"], [
            [d["request"], d["device_name"], sharing_text(d), share_text(d),
             ",".join(d["cdi_devices"])] for d in devices], width)
    return table(["REQUEST", "KIND", "DEVICE", "UUID", "ON DEMAND", "SHARING", "SHARE",
                  "CDI DEVICE"], [
        [d["request"], d["kind"], d["device_name"], d["uuid"] or "-",
         "yes" if d["on_demand"] else "no", sharing_text(d), share_text(d),
         ",".join(d["cdi_devices"])] for d in devices])


def claims_table(body: dict[str, Any], width: int | None = None) -> str:
    """``claims``: a row per prepared claim."""
    claims = body["claims"]
    if not claims:
        return "no claims prepared on this node"
    now = time.time()
    return table(["UID", "STATE", "DEVICES", "SHARING", "SHARE", "MPS", "POD", "AGE", "NOTES"], [
        [c["uid"], c["state"], ",".join(d["device_name"] for d in c["devices"]) or "-",
         _joined([sharing_text(d) for d in c["devices"]]),
         _joined([share_text(d) for d in c["devices"]]), mps_text(c),
         _pod(c["metadata"]), _age(c["created_at"], now), _notes(c)]
        for c in claims], width)


def claim_text(claim: dict[str, Any], width: int | None = None) -> str:
    """``claims UID``: the claim as ``key  value`` lines, then its devices."""
    rows = [("uid", claim["uid"]), ("state", claim["state"]),
            ("created", time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(
                claim["created_at"]))),
            ("cdi spec", claim["cdi_spec"] or "-")]
    rows += [(key, value) for key, value in sorted(claim["metadata"].items())]
    if claim["lost_reason"]:
        rows.append(("lost", claim["lost_reason"]))
    mps = claim.get("mps")
    if mps:
        rows.append(("mps", mps["state"] + (f": {mps['reason']}" if mps.get("reason") else "")))
        rows.append(("mps pipe", mps["pipe_directory"]))
    return "\n".join(key_values(rows, width)) + "\n\n" + devices_table(claim["devices"], width)


def _list(args: argparse.Namespace, client: AgentClient) -> int:
    options.emit(args, client.request("GET", "/v1/claims").body, claims_table)
    return 0


def _show(args: argparse.Namespace, client: AgentClient) -> int:
    options.emit(args, client.request("GET", f"/v1/claims/{_path(args.uid)}").body, claim_text)
    return 0


def parse_slice(text: str) -> dict[str, Any]:
    """``PROFILE[@GPU][:START]`` or a dynamic device name → a ``slice`` device request."""
    parsed = parse_device_name(text)
    if parsed is not None and parsed.profile is not None:
        return {"kind": "slice", "device": text}
    request: dict[str, Any] = {"kind": "slice"}
    rest, colon, start = text.rpartition(":")
    if colon:
        if ascii_integer(start) is None:
            raise UsageError(f"--slice {text!r}: START must be a memory slice number "
                             "(PROFILE[@GPU][:START])")
        request["placement"] = {"start": int(start)}
    else:
        rest = text
    profile, at, gpu = rest.partition("@")
    if not profile or (at and not gpu):
        raise UsageError(f"--slice {text!r}: expected PROFILE[@GPU][:START], "
                         "e.g. 1g.10gb, 3g.40gb@2 or 1g.10gb@0:4")
    request["profile"] = profile
    if gpu:
        request["gpu"] = gpu
    return request


def prepare_body(args: argparse.Namespace) -> dict[str, Any]:
    """The ``PUT /v1/claims/{uid}`` body of ``claims prepare``."""
    devices: list[dict[str, Any]] = [{"kind": "gpu", "device": d} for d in args.gpus]
    devices += [parse_slice(s) for s in args.slices]
    if not devices:
        raise UsageError("claims prepare: give at least one --gpu DEVICE or --slice PROFILE")
    body: dict[str, Any] = {"devices": devices}
    metadata = {key: getattr(args, key) for key in ("namespace", "name", "pod", "container")
                if getattr(args, key) is not None}
    if metadata:
        body["metadata"] = metadata
    return body


def _prepare(args: argparse.Namespace, client: AgentClient) -> int:
    claim = client.request("PUT", f"/v1/claims/{_path(args.uid)}", prepare_body(args)).body
    options.emit(args, claim, lambda body, width: (
        f"claim {body['uid']} prepared; CDI spec {body['cdi_spec']}\n"
        + devices_table(body["devices"], width)))
    return 0


def _unprepare(args: argparse.Namespace, client: AgentClient) -> int:
    client.request("DELETE", f"/v1/claims/{_path(args.uid)}")
    options.emit(args, {"uid": args.uid, "unprepared": True},
                 lambda body, _: f"claim {body['uid']} unprepared")
    return 0


def _path(uid: str) -> str:
    """A claim UID as one path segment (whatever characters it holds)."""
    return quote(uid, safe="")


# -- cdi ----------------------------------------------------------------------------------


def specs_table(body: dict[str, Any], width: int | None = None) -> str:
    """``cdi list``: the spec directory, then a row per spec file."""
    return f"spec directory {body['spec_dir']}\n" + table(
        ["FILE", "KIND", "CDI VERSION", "DEVICES"],
        [[Path(s["path"]).name, s["kind"], s["cdi_version"], str(len(s["devices"]))]
         for s in body["specs"]], width)


def _cdi_list(args: argparse.Namespace, client: AgentClient) -> int:
    options.emit(args, client.request("GET", "/v1/cdi").body, specs_table)
    return 0


async def _read_gpus(nvml: Any) -> tuple[Gpu, ...]:
    from agent.gpu.inventory import GpuInventory  # noqa: PLC0415 - keeps client verbs fast
    from agent.gpu.session import NvmlSession  # noqa: PLC0415

    session = NvmlSession(nvml)
    try:
        await session.initialise()
        inventory = GpuInventory(session)
        await inventory.load()
        return inventory.gpus
    finally:
        session.close()


def generate(args: argparse.Namespace) -> int:
    """``cdi generate``: open NVML (or the simulated node) as ``serve`` would, with the same
    settings resolution and backend choice, without starting the agent; write the node-wide
    spec."""
    from agent.claims.cdi_writer import CdiWriter  # noqa: PLC0415 - keeps client verbs fast
    from agent.errors import AgentError  # noqa: PLC0415
    from agent.gpu.backend import open_backend  # noqa: PLC0415
    from agent.settings import resolve  # noqa: PLC0415

    try:
        settings = resolve({"simulate": args.simulate, "state_dir": args.state_dir,
                            "proc_root": args.proc_root, "driver_root": args.driver_root})
        backend = open_backend(simulate=settings.simulate, state_dir=settings.state_dir,
                               proc_root=settings.proc_root)
        try:
            gpus = asyncio.run(_read_gpus(backend.nvml))
        finally:
            if backend.sim is not None:
                backend.sim.close()
        with tempfile.TemporaryDirectory(prefix="gpu-agent-cdi-") as scratch:
            directory = Path(args.output) if args.output else Path(scratch)
            path = CdiWriter(directory, settings.proc_root, settings.driver_root).write_node(gpus)
            if path is None:
                print("gpu-agent: no GPU to describe: NVML lists no usable device",
                      file=sys.stderr)
                return 1
            if args.output is None:
                text = path.read_text()
                sys.stdout.write(text if text.endswith("\n") else text + "\n")
                return 0
            spec = json.loads(path.read_bytes())
            print(f"wrote {path}: kind {spec['kind']}, cdiVersion {spec['cdiVersion']}, "
                  f"{len(spec['devices'])} device names ({backend.name})")
            return 0
    except AgentError as err:
        print(f"gpu-agent: {err.detail}", file=sys.stderr)
    except (OSError, ValueError) as err:  # spec directory not writable; /proc lacks the driver
        print(f"gpu-agent: cdi generate: {err}", file=sys.stderr)
    return 1


def run(args: argparse.Namespace, client: AgentClient) -> int:
    if args.command == "cdi":
        if args.cdi_verb == "generate":
            return generate(args)
        return _cdi_list(args, client)
    verbs = {None: _list, "show": _show, "prepare": _prepare, "unprepare": _unprepare}
    return verbs[args.claims_verb](args, client)
