"""``gpu-agent mig ...`` and ``gpu-agent transitions``: MIG geometry from the terminal."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote

from agent.cli import options
from agent.cli.client import AgentClient, ClientError, UsageError
from agent.cli.tables import table

#: How often ``--wait`` asks for the state of what it follows.
POLL_S = 0.2


def add_parsers(sub: Any) -> None:
    out = [options.OUTPUT]
    mig = sub.add_parser("mig", parents=out, help="MIG geometry")
    verbs = mig.add_subparsers(dest="mig_verb", required=True)
    show = verbs.add_parser("show", parents=out, help="current geometry")
    show.add_argument("gpu", nargs="?", help="GPU index or UUID (default: every MIG GPU)")
    change = verbs.add_parser("set", parents=out, help="change a GPU's geometry")
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
    apply = verbs.add_parser("apply", parents=out, help="apply a mig-parted config by label")
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
    verbs.add_parser("export", parents=out,
                     help="the current layout as a mig-parted config (every GPU; YAML unless "
                          "-o json)")
    transitions = sub.add_parser("transitions", parents=out,
                                 help="MIG transitions, or one of them")
    transitions.add_argument("id", nargs="?")


def _placement(p: dict[str, int]) -> str:
    return f"{p['start']}:{p['size']}"


def geometry_table(docs: Sequence[dict[str, Any]], width: int | None = None) -> str:
    """``mig show``: a row per GPU (mode, instances, quarantine, drift, transition)."""
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
    return table(["GPU", "MIG", "INSTANCES (profile@start:size)", "NOTES"], rows, width)


def _show(args: argparse.Namespace, client: AgentClient) -> int:
    if args.gpu is not None:
        refs = [args.gpu]
    else:
        refs = [str(g["index"]) for g in client.request("GET", "/v1/gpus").body["gpus"]
                if g["mig_capable"]]
    docs = [client.request("GET", f"/v1/gpus/{quote(ref, safe='')}/mig").body for ref in refs]
    # One GPU: its answer as the agent gave it; every GPU: the list of their answers.
    options.emit(args, docs if args.gpu is None else docs[0],
                 lambda _, width: geometry_table(docs, width))
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


#: The problem type the agent answers a MIG mode change it was not asked for explicitly with.
MODE_NEEDS_EXPLICIT = "mig-mode-needs-explicit"


def _mode_flag_refusal(err: ClientError, gpu: str) -> ClientError:
    """The Ampere 409 in the CLI's words: the flag to pass, not the API's body field."""
    problem = err.problem
    if not str(problem.get("type", "")).endswith("/" + MODE_NEEDS_EXPLICIT) \
            or not isinstance(problem.get("mig_enabled"), bool):
        return err
    flag = "--enable" if problem["mig_enabled"] else "--disable"
    return ClientError(f"{err.status} {problem.get('title', 'Conflict')}: GPU {gpu} changes its "
                       "MIG mode only when asked explicitly (the change needs a GPU reset): "
                       f"add {flag} to 'gpu-agent mig set'", status=err.status, problem=problem)


def _set(args: argparse.Namespace, client: AgentClient) -> int:
    body: dict[str, Any] = {"drain": {"policy": args.drain, "timeout_s": args.timeout},
                            "allow_reset": args.allow_reset}
    if args.disable:
        if args.profiles or args.enable:
            raise UsageError("--disable takes no profiles and no --enable")
        body["mig_enabled"] = False
    else:
        body["profiles"] = args.profiles
        if args.enable:
            body["mig_enabled"] = True
    query = "?dry_run=true" if args.dry_run else ""
    try:
        answer = client.request("PUT", f"/v1/gpus/{quote(args.gpu, safe='')}/mig{query}",
                                body).body
    except ClientError as err:
        raise _mode_flag_refusal(err, args.gpu) from err
    transition = answer["transition"]
    if options.structured(args):  # the answer, or with --wait the finished transition
        if not args.wait or transition is None:
            options.emit(args, answer)
            return 0
        done = _follow(client, f"/v1/transitions/{transition['id']}")
        options.emit(args, done)
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


def apply_text(answer: dict[str, Any], width: int | None = None) -> str:
    """``mig apply``: the apply's state, a row per GPU, then what stopped or skipped each."""
    lines = [f"apply of {answer['label']} (dry run, nothing changed):" if answer["dry_run"]
             else f"apply {answer['apply_id']} ({answer['label']}): {answer['state']}"]
    rows = answer["transitions"]
    if rows:
        lines.append(table(["GPU", "TRANSITION", "STATE", "PLAN"], [
            [str(t["index"]), t["id"] or "-", t["state"],
             t["plan"]["summary"] if t["plan"] else "-"] for t in rows], width))
    for t in rows:
        if t["error"]:
            lines.append(f"GPU {t['index']}: {t['error']}")
        elif answer["dry_run"] and t["blockers"]:
            lines.append(f"GPU {t['index']}: in use now by " + ", ".join(
                f"{b['kind']} {b['id']} on {b['instance']}" for b in t["blockers"]))
    lines += [f"GPU {s['index']} skipped: {s['reason']}" for s in answer["skipped"]]
    if answer["missing_indices"]:
        missing = answer["missing_indices"]
        lines.append(f"{'GPU' if len(missing) == 1 else 'GPUs'} "
                     f"{', '.join(map(str, missing))} not on this node: ignored")
    if not rows and not answer["skipped"]:
        lines.append("the label selects no GPU of this node")
    return "\n".join(lines)


def _apply(args: argparse.Namespace, client: AgentClient) -> int:
    try:
        text = Path(args.file).read_text()
    except OSError as err:
        raise UsageError(f"cannot read {args.file}: {err.strerror}") from err
    query = "?dry_run=true" if args.dry_run else ""
    answer = client.request("POST", f"/v1/mig/apply{query}", {
        "config": text, "label": args.label, "allow_reset": args.allow_reset,
        "drain": {"policy": args.drain, "timeout_s": args.timeout}}).body
    waited = args.wait and not args.dry_run
    if waited:
        progress = Progress(sys.stdout)
        answer = _follow(client, f"/v1/mig/apply/{answer['apply_id']}",
                         None if options.structured(args)
                         else lambda body: progress.show(
                             f"apply {body['apply_id']} ({body['label']})", _apply_lines(body)))
    options.emit(args, answer, apply_text)
    return 0 if not waited or answer["state"] == "succeeded" else 1


def _export(args: argparse.Namespace, client: AgentClient) -> int:
    config = client.request("GET", "/v1/mig/export").body
    # A mig-parted config reads as YAML: that is its text form (-o json for JSON).
    options.emit(args, config, lambda body, _: options.dump(body, "yaml"))
    return 0


def transition_text(body: dict[str, Any], width: int | None = None) -> str:
    """``transitions ID``: what was asked, the plan, the error, then each step."""
    lines = [f"transition {body['id']} on GPU {body['gpu_index']}: {body['state']}",
             f"requested: {body['requested']}", f"plan: {body['plan']['summary']}"]
    if body["error"]:
        lines.append(f"error: {body['error']}")
    lines = [options.cut(line, width) for line in lines]
    lines.append(table(["STEP", "SECONDS", "RESULT"], [
        [s["name"], "-" if s["duration_s"] is None else f"{s['duration_s']:.3f}",
         s["error"] or s["result"] or "-"] for s in body["steps"]], width))
    return "\n".join(lines)


def transitions_table(body: dict[str, Any], width: int | None = None) -> str:
    """``transitions``: a row per transition the agent remembers."""
    if not body["transitions"]:
        return "no MIG transitions on this node"
    return table(["ID", "GPU", "STATE", "SECONDS", "PLAN"], [
        [t["id"], str(t["gpu_index"]), t["state"],
         "-" if t["duration_s"] is None else f"{t['duration_s']:.2f}", t["plan"]["summary"]]
        for t in body["transitions"]], width)


def _transitions(args: argparse.Namespace, client: AgentClient) -> int:
    if args.id:
        body = client.request("GET", f"/v1/transitions/{quote(args.id, safe='')}").body
        options.emit(args, body, transition_text)
    else:
        options.emit(args, client.request("GET", "/v1/transitions").body, transitions_table)
    return 0


def run(args: argparse.Namespace, client: AgentClient) -> int:
    if args.command == "transitions":
        return _transitions(args, client)
    verbs = {"show": _show, "set": _set, "apply": _apply, "export": _export}
    return verbs[args.mig_verb](args, client)
