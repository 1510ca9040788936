"""``gpu-agent mig ...`` and ``gpu-agent transitions``: MIG geometry from the terminal."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from agent.cli.client import AgentClient, ClientError
from agent.cli.tables import table
from agent.gpu.types import Placement
from agent.mig.geometry import Geometry, Instance
from agent.mig.parted_config import export_config


def add_parsers(sub: Any, client_opts: argparse.ArgumentParser) -> None:
    mig = sub.add_parser("mig", help="MIG geometry")
    verbs = mig.add_subparsers(dest="mig_verb", required=True)
    show = verbs.add_parser("show", parents=[client_opts], help="current geometry")
    show.add_argument("gpu", nargs="?", help="GPU index or UUID (default: every MIG GPU)")
    change = verbs.add_parser("set", parents=[client_opts], help="change a GPU's geometry")
    change.add_argument("gpu", help="GPU index or UUID")
    change.add_argument("profiles", nargs="*", help="profiles, one per instance (1g.10gb ...)")
    change.add_argument("--disable", action="store_true", help="MIG off")
    change.add_argument("--enable", action="store_true",
                        help="ask for MIG on explicitly (needed on pre-Hopper GPUs)")
    change.add_argument("--drain", choices=("fail", "wait"), default="fail")
    change.add_argument("--timeout", type=float, default=60.0, help="drain timeout, seconds")
    change.add_argument("--dry-run", action="store_true", help="only print the plan")
    change.add_argument("--allow-reset", action="store_true",
                        help="let the agent reset the idle GPU if the mode change is pending")
    change.add_argument("--wait", action="store_true",
                        help="follow the transition; exit non-zero unless it succeeded")
    apply = verbs.add_parser("apply", parents=[client_opts],
                             help="apply a mig-parted config by label")
    apply.add_argument("-f", "--file", required=True, help="mig-parted v1 config (YAML/JSON)")
    apply.add_argument("-c", "--config", required=True, dest="label", help="label to apply")
    apply.add_argument("--drain", choices=("fail", "wait"), default="fail")
    apply.add_argument("--timeout", type=float, default=60.0)
    apply.add_argument("--wait", action="store_true")
    verbs.add_parser("export", parents=[client_opts],
                     help="the current layout as a mig-parted config")
    transitions = sub.add_parser("transitions", parents=[client_opts],
                                 help="MIG transitions, or one of them")
    transitions.add_argument("id", nargs="?")


def _placement(p: dict[str, int]) -> str:
    return f"{p['start']}:{p['size']}"


def _show(args: argparse.Namespace, client: AgentClient) -> int:
    if args.gpu is not None:
        refs = [args.gpu]
    else:
        refs = [str(g["index"]) for g in client.request("GET", "/v1/gpus").body["gpus"]
                if g["mig_capable"]]
    docs = [client.request("GET", f"/v1/gpus/{ref}/mig").body for ref in refs]
    if args.json:
        print(json.dumps(docs if args.gpu is None else docs[0], indent=2))
        return 0
    rows = []
    for doc in docs:
        mode = doc["mig_mode"]
        state = "on" if mode["current"] else "off"
        if mode["pending"] != mode["current"]:
            state += " (pending " + ("on" if mode["pending"] else "off") + ")"
        notes = "; ".join(x for x in (doc["quarantined"] and f"QUARANTINED: {doc['quarantined']}",
                                      doc["drift"] and f"drift: {doc['drift']}",
                                      doc["active_transition"] and
                                      f"transition {doc['active_transition']}") if x)
        instances = ", ".join(
            f"{i['profile']}@{_placement(i['placement'])}" + (" (draining)" if i["draining"]
                                                             else "")
            for i in doc["instances"]) or "-"
        rows.append([str(doc["index"]), state, instances, notes or "-"])
    print(table(["GPU", "MIG", "INSTANCES (profile@start:size)", "NOTES"], rows))
    return 0


def _follow(client: AgentClient, location: str) -> dict[str, Any]:
    """Poll a transition (until terminal) or an apply (until no longer running)."""
    while True:
        body: dict[str, Any] = client.request("GET", location).body
        if body.get("terminal", body.get("state") != "running"):
            return body
        time.sleep(0.2)


def _set(args: argparse.Namespace, client: AgentClient) -> int:
    body: dict[str, Any] = {"drain": {"policy": args.drain, "timeout_s": args.timeout},
                            "allow_reset": args.allow_reset}
    if args.disable:
        if args.profiles or args.enable:
            raise ClientError("--disable takes no profiles and no --enable")
        body["mig_enabled"] = False
    else:
        body["profiles"] = args.profiles
        if args.enable:
            body["mig_enabled"] = True
    query = "?dry_run=true" if args.dry_run else ""
    answer = client.request("PUT", f"/v1/gpus/{args.gpu}/mig{query}", body).body
    transition = answer["transition"]
    if args.json and not args.wait:
        print(json.dumps(answer, indent=2))
        return 0
    print(("plan (dry run): " if args.dry_run else "plan: ") + answer["plan"]["summary"])
    if transition is None:
        if not args.dry_run:
            print("already applied: nothing to do")
        return 0
    print(f"transition {transition['id']}: {transition['state']}")
    if not args.wait:
        return 0
    done = _follow(client, f"/v1/transitions/{transition['id']}")
    if args.json:
        print(json.dumps(done, indent=2))
    print(f"transition {done['id']}: {done['state']}" +
          (f": {done['error']}" if done["error"] else ""))
    return 0 if done["state"] == "succeeded" else 1


def _apply(args: argparse.Namespace, client: AgentClient) -> int:
    try:
        text = Path(args.file).read_text()
    except OSError as err:
        raise ClientError(f"cannot read {args.file}: {err.strerror}") from err
    answer = client.request("POST", "/v1/mig/apply", {
        "config": text, "label": args.label,
        "drain": {"policy": args.drain, "timeout_s": args.timeout}}).body
    if args.wait:
        answer = _follow(client, f"/v1/mig/apply/{answer['apply_id']}")
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print(f"apply {answer['apply_id']} ({answer['label']}): {answer['state']}")
        print(table(["GPU", "TRANSITION", "STATE"], [
            [str(t["index"]), t["id"] or "-", t["state"]] for t in answer["transitions"]]))
    return 0 if not args.wait or answer["state"] == "succeeded" else 1


def _export(args: argparse.Namespace, client: AgentClient) -> int:
    layouts = {}
    for gpu in client.request("GET", "/v1/gpus").body["gpus"]:
        if not gpu["mig_capable"]:
            continue
        doc = client.request("GET", f"/v1/gpus/{gpu['index']}/mig").body
        layouts[gpu["index"]] = Geometry(mig_enabled=doc["mig_mode"]["current"], instances=tuple(
            Instance(i["profile"], Placement(i["placement"]["start"], i["placement"]["size"]))
            for i in doc["instances"]))
    if not layouts:
        raise ClientError("no MIG-capable GPU on this node")
    import yaml  # noqa: PLC0415 - only this verb writes YAML

    config = export_config(layouts)
    sys.stdout.write(json.dumps(config, indent=2) + "\n" if args.json
                     else yaml.safe_dump(config, sort_keys=False))
    return 0


def _transitions(args: argparse.Namespace, client: AgentClient) -> int:
    if args.id:
        body = client.request("GET", f"/v1/transitions/{args.id}").body
        if args.json:
            print(json.dumps(body, indent=2))
            return 0
        print(f"transition {body['id']} on GPU {body['gpu_index']}: {body['state']}")
        print(f"requested: {body['requested']}\nplan: {body['plan']['summary']}")
        if body["error"]:
            print(f"error: {body['error']}")
        print(table(["STEP", "SECONDS", "RESULT"], [
            [s["name"], "-" if s["duration_s"] is None else f"{s['duration_s']:.3f}",
             s["error"] or s["result"] or "-"] for s in body["steps"]]))
        return 0
    items = client.request("GET", "/v1/transitions").body["transitions"]
    if args.json:
        print(json.dumps(items, indent=2))
        return 0
    print(table(["ID", "GPU", "STATE", "SECONDS", "PLAN"], [
        [t["id"], str(t["gpu_index"]), t["state"],
         "-" if t["duration_s"] is None else f"{t['duration_s']:.2f}", t["plan"]["summary"]]
        for t in items]))
    return 0


def run(args: argparse.Namespace, client: AgentClient) -> int:
    if args.command == "transitions":
        return _transitions(args, client)
    verbs = {"show": _show, "set": _set, "apply": _apply, "export": _export}
    return verbs[args.mig_verb](args, client)
