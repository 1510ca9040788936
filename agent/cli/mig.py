"""``gpu-agent mig ...`` and ``gpu-agent transitions``: MIG geometry from the terminal."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from agent.cli.client import AgentClient, ClientError
from agent.cli.tables import table

#: How often ``--wait`` asks for the state of what it follows.
POLL_S = 0.2


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
    apply.add_argument("--timeout", type=float, default=60.0, help="drain timeout, seconds")
    apply.add_argument("--dry-run", action="store_true",
                       help="only print every GPU's plan; nothing changes")
    apply.add_argument("--allow-reset", action="store_true",
                       help="let the agent reset idle GPUs whose MIG mode change is pending "
                            "(Ampere), with its --gpu-reset-command")
    apply.add_argument("--wait", action="store_true",
                       help="follow every GPU's transition; exit non-zero unless all succeeded")
    verbs.add_parser("export", parents=[client_opts],
                     help="the current layout as a mig-parted config (every GPU)")
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


# --- progress of a long operation ------------------------------------------------------------


def _live(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal that can redraw lines in place."""
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


class Progress:
    """Live progress of a long operation. On a terminal: one block (a title with the elapsed
    time, a line per GPU) redrawn in place at every poll. Otherwise: plain lines, one each
    time a GPU's line changes (never one per poll), each with the elapsed time."""

    def __init__(self, stream: TextIO, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._stream = stream
        self._live = _live(stream)
        self._clock = clock
        self._started = clock()
        self._drawn = 0
        self._shown: dict[str, str] = {}

    def show(self, title: str, lines: Mapping[str, str]) -> None:
        """Show ``title`` and ``lines`` (key -> text; a key is one GPU)."""
        elapsed = self._clock() - self._started
        if self._live:
            self._draw([f"{title}  [{elapsed:.1f}s]", *(f"  {text}" for text in lines.values())])
            return
        out = []
        if self._shown.get("") != title:
            self._shown[""] = title
            out.append(title)
        for key, text in lines.items():
            if self._shown.get(key) != text:
                self._shown[key] = text
                out.append(f"[{elapsed:6.1f}s] {text}")
        if out:
            self._stream.write("".join(line + "\n" for line in out))
            self._stream.flush()

    def _draw(self, lines: Sequence[str]) -> None:
        # Cut to the width so no line wraps: the cursor then goes back exactly len(lines).
        width = max(20, shutil.get_terminal_size((100, 24)).columns - 1)
        back = f"\x1b[{self._drawn}F" if self._drawn else ""
        self._stream.write(back + "\x1b[J" + "".join(line[:width] + "\n" for line in lines))
        self._stream.flush()
        self._drawn = len(lines)


def _doing(state: str, step: str | None, blockers: Sequence[dict[str, Any]],
           error: str | None) -> str:
    """One transition in words: the state, and what it waits for or the step it runs."""
    if state == "draining" and blockers:
        return "draining: waiting for " + ", ".join(
            f"{b['kind']} {b['id']} on {b['instance']}" for b in blockers)
    if state in ("applying", "rolling_back") and step:
        return f"{state}: {step}"
    return state + (f": {error}" if error else "")


def _transition_line(t: dict[str, Any]) -> str:
    step = t["steps"][-1]["name"] if t["steps"] else None
    return f"GPU {t['gpu_index']}: " + _doing(t["state"], step, t["blockers"], t["error"])


def _apply_lines(body: dict[str, Any]) -> dict[str, str]:
    return {str(r["index"]): f"GPU {r['index']}: " + _doing(r["state"], r["step"],
                                                           r["blockers"], r["error"])
            for r in body["transitions"]}


def _follow(client: AgentClient, location: str,
            render: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Poll a transition (until terminal) or an apply (until no longer running), rendering
    each answer. Ctrl-C stops following, not the change: one line says where to look."""
    try:
        while True:
            body: dict[str, Any] = client.request("GET", location).body
            if render is not None:
                render(body)
            if body.get("terminal", body.get("state") != "running"):
                return body
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        raise ClientError(f"stopped following; the change goes on: GET {location}") from None


# --- the verbs ----------------------------------------------------------------------------------


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
    if args.json:  # JSON only: the answer, or with --wait the finished transition
        if not args.wait or transition is None:
            print(json.dumps(answer, indent=2))
            return 0
        done = _follow(client, f"/v1/transitions/{transition['id']}")
        print(json.dumps(done, indent=2))
        return 0 if done["state"] == "succeeded" else 1
    print(("plan (dry run): " if args.dry_run else "plan: ") + answer["plan"]["summary"])
    if transition is None:
        if not args.dry_run:
            print("already applied: nothing to do")
        return 0
    print(f"transition {transition['id']}: {transition['state']}")
    if not args.wait:
        return 0
    progress = Progress(sys.stdout)
    done = _follow(client, f"/v1/transitions/{transition['id']}", lambda t: progress.show(
        f"transition {t['id']} on GPU {t['gpu_index']}", {"gpu": _transition_line(t)}))
    print(f"transition {done['id']}: {done['state']}" +
          (f": {done['error']}" if done["error"] else ""))
    return 0 if done["state"] == "succeeded" else 1


def _print_apply(answer: dict[str, Any]) -> None:
    if answer["dry_run"]:
        print(f"apply of {answer['label']} (dry run, nothing changed):")
    else:
        print(f"apply {answer['apply_id']} ({answer['label']}): {answer['state']}")
    rows = answer["transitions"]
    if rows:
        print(table(["GPU", "TRANSITION", "STATE", "PLAN"], [
            [str(t["index"]), t["id"] or "-", t["state"],
             t["plan"]["summary"] if t["plan"] else "-"] for t in rows]))
    for t in rows:
        if t["error"]:
            print(f"GPU {t['index']}: {t['error']}")
        elif answer["dry_run"] and t["blockers"]:
            print(f"GPU {t['index']}: in use now by " + ", ".join(
                f"{b['kind']} {b['id']} on {b['instance']}" for b in t["blockers"]))
    for s in answer["skipped"]:
        print(f"GPU {s['index']} skipped: {s['reason']}")
    if answer["missing_indices"]:
        missing = answer["missing_indices"]
        print(f"{'GPU' if len(missing) == 1 else 'GPUs'} {', '.join(map(str, missing))} "
              "not on this node: ignored")
    if not rows and not answer["skipped"]:
        print("the label selects no GPU of this node")


def _apply(args: argparse.Namespace, client: AgentClient) -> int:
    try:
        text = Path(args.file).read_text()
    except OSError as err:
        raise ClientError(f"cannot read {args.file}: {err.strerror}") from err
    query = "?dry_run=true" if args.dry_run else ""
    answer = client.request("POST", f"/v1/mig/apply{query}", {
        "config": text, "label": args.label, "allow_reset": args.allow_reset,
        "drain": {"policy": args.drain, "timeout_s": args.timeout}}).body
    waited = args.wait and not args.dry_run
    if waited:
        progress = Progress(sys.stdout)
        answer = _follow(client, f"/v1/mig/apply/{answer['apply_id']}", None if args.json
                         else lambda body: progress.show(
                             f"apply {body['apply_id']} ({body['label']})", _apply_lines(body)))
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        _print_apply(answer)
    return 0 if not waited or answer["state"] == "succeeded" else 1


def _export(args: argparse.Namespace, client: AgentClient) -> int:
    config = client.request("GET", "/v1/mig/export").body
    import yaml  # noqa: PLC0415 - only this verb writes YAML

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
