"""``gpu-agent admin ...`` (remediation, admin scope) and ``gpu-agent support-bundle``."""

from __future__ import annotations

import argparse
import io
import json
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import agent
from agent.cli import options
from agent.cli.client import AgentClient, ClientError, UsageError

_BEARER = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+")
_SECRET_FIELD = re.compile(r'(?i)("?[a-z_]*(?:token|secret|password|authorization)[a-z_]*"?\s*'
                           r'[:=]\s*)("[^"]*"|\S+)')
_LOG_LINES = 2000


#: What ``support-bundle -o FILE`` prints: ``-o`` means the output format everywhere else.
BUNDLE_OUTPUT_DEPRECATED = ("gpu-agent: support-bundle -o FILE is deprecated; use -f/--file "
                            "FILE")


def add_parsers(sub: Any) -> None:
    out = [options.OUTPUT]
    admin = sub.add_parser("admin", parents=out, help="remediation for operators (admin scope)")
    verbs = admin.add_subparsers(dest="admin_verb", required=True)
    clear = verbs.add_parser("clear-quarantine", parents=out,
                             help="lift a GPU's quarantine once its layout was fixed by hand")
    clear.add_argument("gpu", help="GPU index or UUID")
    health = verbs.add_parser("clear-xid", aliases=["clear-health"], parents=out,
                              help="lift a GPU's XID (and lost) marks after resetting it by "
                                   "hand")
    health.add_argument("gpu", help="GPU index or UUID")
    drain = verbs.add_parser("drain", parents=out,
                             help="keep new claims off a GPU (a NoSchedule drain taint with "
                                  "the reason); claims it holds stay")
    drain.add_argument("gpu", help="GPU index or UUID")
    drain.add_argument("--reason", required=True, help="why, for the cluster to see (1 to 256 "
                                                       "characters)")
    undrain = verbs.add_parser("undrain", parents=out,
                               help="lift an operator's drain of a GPU")
    undrain.add_argument("gpu", help="GPU index or UUID")
    resolve = verbs.add_parser("resolve", parents=out,
                               help="resolve a GPU's open MIG journal entry by hand")
    resolve.add_argument("gpu", help="GPU index or UUID")
    resolve.add_argument("action", choices=("roll-back", "finish"))
    checkpoint = verbs.add_parser("checkpoint", parents=out,
                                  help="the claims checkpoint: status, restore FILE, "
                                       "accept-empty")
    checkpoint.add_argument("action", nargs="?", default="status",
                            choices=("status", "restore", "accept-empty"))
    checkpoint.add_argument("file", nargs="?", help="kept-aside file to restore")
    # No -o/--output format here: the verb writes an archive and prints its path.
    bundle = sub.add_parser("support-bundle",
                            help="collect what support needs into one tar.gz (no secrets)")
    path = bundle.add_mutually_exclusive_group()
    path.add_argument("-f", "--file", metavar="FILE",
                      help="archive path (default gpu-agent-support-<node>-<time>.tar.gz)")
    path.add_argument("-o", "--output", dest="old_file", metavar="FILE",
                      help="deprecated spelling of -f/--file (removed in the next release)")
    bundle.add_argument("--log-file", help="the agent's log file, if it logs to one "
                                           "(its last lines are included, redacted)")


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """Bearer tokens, secret-looking fields and the given secrets replaced by <redacted>."""
    text = _BEARER.sub(r"\1<redacted>", text)
    text = _SECRET_FIELD.sub(r"\1<redacted>", text)
    for secret in secrets:
        if secret:
            text = text.replace(secret, "<redacted>")
    return text


def _admin(args: argparse.Namespace, client: AgentClient) -> int:
    verb = args.admin_verb
    if verb == "clear-quarantine":
        body = client.request("POST", f"/v1/admin/gpus/{args.gpu}/clear-quarantine").body
    elif verb in ("clear-xid", "clear-health"):
        body = client.request("POST", f"/v1/admin/gpus/{args.gpu}/clear-health").body
    elif verb == "drain":
        body = client.request("POST", f"/v1/admin/gpus/{args.gpu}/drain",
                              {"reason": args.reason}).body
    elif verb == "undrain":
        body = client.request("DELETE", f"/v1/admin/gpus/{args.gpu}/drain").body
    elif verb == "resolve":
        body = client.request("POST", f"/v1/admin/transitions/{args.gpu}/resolve",
                              {"action": args.action}).body
    elif args.action == "status":
        body = client.request("GET", "/v1/admin/claims-checkpoint").body
    elif args.action == "restore":
        if not args.file:
            raise UsageError("restore needs the kept-aside file's name (see "
                             "'gpu-agent admin checkpoint')")
        body = client.request("POST", "/v1/admin/claims-checkpoint",
                              {"action": "restore", "file": args.file}).body
    else:
        body = client.request("POST", "/v1/admin/claims-checkpoint",
                              {"action": "accept-empty"}).body
    options.emit(args, body)
    return 0


def _collect(client: AgentClient) -> dict[str, Any]:
    """Everything the bundle holds, by file name; a failing call records its error."""
    found: dict[str, Any] = {}

    def get(name: str, path: str) -> Any:
        try:
            found[name] = client.request("GET", path, text=name.endswith(".txt")).body
        except ClientError as err:
            found[name] = {"error": str(err)}
        return found[name]

    found["versions.json"] = {"gpu-agent-cli": agent.__version__,
                              "python": platform.python_version(),
                              "platform": platform.platform(), "collected_at": time.time()}
    get("readyz.json", "/readyz")
    get("node.json", "/v1/node")
    gpus = get("gpus.json", "/v1/gpus")
    for gpu in gpus.get("gpus", []) if isinstance(gpus, dict) else []:
        if gpu.get("mig_capable"):
            get(f"mig/gpu{gpu['index']}.json", f"/v1/gpus/{gpu['index']}/mig")
    get("transitions.json", "/v1/transitions")
    get("claims.json", "/v1/claims")
    get("cdi.json", "/v1/cdi")
    get("claims-checkpoint.json", "/v1/admin/claims-checkpoint")
    get("topology.json", "/v1/topology")
    get("events.json", "/v1/events")
    get("metrics.txt", "/metrics")
    return found


def _support_bundle(args: argparse.Namespace, client: AgentClient) -> int:
    if args.old_file is not None:
        print(BUNDLE_OUTPUT_DEPRECATED, file=sys.stderr)
    found = _collect(client)
    node = found.get("node.json")
    name = node.get("hostname") if isinstance(node, dict) else None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    output = Path(args.file or args.old_file
                  or f"gpu-agent-support-{name or 'node'}-{stamp}.tar.gz")
    if args.log_file:
        try:
            lines = Path(args.log_file).read_text(errors="replace").splitlines()[-_LOG_LINES:]
            found["agent.log"] = "\n".join(lines) + "\n"
        except OSError as err:
            found["agent.log"] = f"cannot read {args.log_file}: {err.strerror}\n"
    secrets = (client.token,) if client.token else ()
    import tarfile  # noqa: PLC0415 - only the support bundle writes an archive

    with tarfile.open(output, "w:gz") as archive:
        for member, content in sorted(found.items()):
            text = content if isinstance(content, str) else json.dumps(content, indent=2)
            data = redact(text, secrets).encode()
            info = tarfile.TarInfo(f"gpu-agent-support/{member}")
            info.size = len(data)
            info.mtime = int(time.time())
            info.mode = 0o600
            archive.addfile(info, io.BytesIO(data))
    output.chmod(0o600)
    print(f"wrote {output} ({len(found)} files)", file=sys.stderr)
    print(output)
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace, AgentClient], int]] = {
    "admin": _admin, "support-bundle": _support_bundle}
