"""Cost per claim: the agent's and the kubelet plugin's CPU per prepare+unprepare, and the
plugin's hop over REST, side by side with a baseline tree (``python -m bench.claim_cost
--baseline REV_OR_TREE``).

One measurement (``--measure``, run by the driver below in the tree measured) starts a real
``gpu-agent serve --simulate dgx-h100`` (NVML latencies off; GPU 0 whole, GPUs 1-7 split
7x 1g.10gb) and the real plugin process (``python -m bench.dra_plugin kubelet-plugin``, claims
answered from memory, so no API server is involved), then runs prepare+unprepare cycles of a
whole H100 and of a 1g.10gb, one at a time, through two paths:

- **rest**: ``PUT /v1/claims/{uid}`` and ``DELETE`` over the agent's socket with the plugin's
  own client and body (``AgentClient``, ``agent_body``), from this process;
- **plugin**: ``NodePrepareResources`` and ``NodeUnprepareResources`` from a grpc.aio client
  on the plugin's socket (kubelet's side of the call), which the plugin turns into the same
  REST calls.

and, through the plugin, the 49 MIG devices at once (one call per claim, all in flight).
Every cycle uses a fresh claim UID, as every pod's claim is new. Paths and kinds alternate in
blocks; around each block the agent's and the plugin's CPU time (user + system, all threads,
``/proc/<pid>/stat``) is read, so each path is charged only its own cycles. The hop is the
plugin path's prepare p50 minus the REST prepare p50.

The driver runs the measurement ``--rounds`` times on each tree, alternating which goes first,
each run in its own subprocess with ``PYTHONPATH`` set to the tree (so the agent, the plugin
and the clients are that tree's code; this file is passed as source, so the baseline need not
contain it), and prints per figure both medians and their ratio against the issue's targets
(current <= 0.5x the baseline for the agent's CPU, the plugin's CPU and the hop).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

# What this file imports from the tree is what every tree it is run against has (it runs as
# source in the baseline's root, with that tree on PYTHONPATH): the agent and plugin it starts,
# and the clients (the plugin's own REST client and body, the committed gRPC stubs), are the
# measured tree's.
import agent
from agent.kubeplugin.agent_client import AgentClient
from agent.kubeplugin.claims import KubeletClaim, agent_body, our_devices
from agent.kubeplugin.proto import dra_v1_pb2, dra_v1_pb2_grpc
from bench.dra import Agent as DraAgent
from bench.dra import PluginProcess
from tests.agent_process import cpu_seconds, start_agent
from tests.k8s.published import set_mig, slices_of

NODE = "bench-node"
DRIVER = "gpu.nodeagent.dev"
MIG_CLASS = "mig.gpu.nodeagent.dev"
ONE_G = "1g.10gb"
SPLIT_GPUS = range(1, 8)
CYCLES = 300  # per (path, kind): one at a time
BLOCK = 10  # cycles of one (path, kind) between CPU readings
BATCHES = 6  # of 49 at once through the plugin
ROUNDS = 3
TARGET = 0.5  # current / baseline, for the figures the issue sets targets on
KINDS = ("gpu", "mig")
PATHS = ("rest", "plugin")
SLICES_FOR = "1.35"
#: Where the agent's state (its checkpoint) lives: on disk, as on a node, so each commit pays
#: its fsyncs; ``--state-root /dev/shm`` takes the disk's latency out of the prepare times.
STATE_ROOT = "/tmp"


# --- one measurement, in the tree on PYTHONPATH ---------------------------------------------


def _claim(uid: str, device: str) -> dict[str, Any]:
    """A ResourceClaim as the API server holds it once allocated and reserved for a pod."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": uid, "namespace": "default", "uid": uid,
                         "resourceVersion": "1"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": MIG_CLASS, "allocationMode": "ExactCount", "count": 1}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}]}},
                "reservedFor": [{"resource": "pods", "name": f"pod-{uid}",
                                 "uid": f"pod-{uid}"}]}}


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] if ordered else math.nan


@dataclass
class _Row:
    """One (path, kind): CPU seconds over its cycles, and its prepare latencies."""

    agent_cpu_s: float = 0.0
    plugin_cpu_s: float = 0.0
    cycles: int = 0
    prepare_s: list[float] | None = None

    def add_block(self, agent_cpu_s: float, plugin_cpu_s: float, times: list[float]) -> None:
        self.agent_cpu_s += agent_cpu_s
        self.plugin_cpu_s += plugin_cpu_s
        self.cycles += len(times)
        self.prepare_s = (self.prepare_s or []) + times


def measure(cycles: int = CYCLES, batches: int = BATCHES, block: int = BLOCK,
            state_root: str = STATE_ROOT) -> dict[str, float]:
    """Figures of the tree on ``PYTHONPATH`` (ms, lower is better; see the module docstring),
    the agent's state directory under ``state_root``."""
    with _short_dir(state_root) as root:
        return asyncio.run(_measure(root, cycles=cycles, batches=batches, block=block))


@contextlib.contextmanager
def _short_dir(parent: str) -> Iterator[Path]:
    # A Unix socket path holds at most 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="bcc-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def _measure(root: Path, *, cycles: int, batches: int, block: int) -> dict[str, float]:
    state = root / "state"
    state.mkdir()
    admin, plugin_token = secrets.token_hex(16), secrets.token_hex(16)
    (state / "tokens").write_text(f"admin:{admin}\nplugin:{plugin_token}:claims\n")
    (state / "tokens").chmod(0o600)
    token_file = root / "plugin.token"
    token_file.write_text(plugin_token + "\n")
    token_file.chmod(0o600)
    cdi = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else root
    cdi_dir = Path(tempfile.mkdtemp(prefix="bcc-cdi-", dir=cdi))
    agent = start_agent(state, preset="dgx-h100", extra=[
        "--node-name", NODE, "--token-file", str(state / "tokens"), "--cdi-dir", str(cdi_dir)])
    agent.token = admin
    plugin: PluginProcess | None = None
    try:
        agent.request("PUT", "/v1/sim/latency", {})
        for gpu in SPLIT_GPUS:
            set_mig(agent, gpu, [ONE_G] * 7)
        names = [str(d["name"]) for item in slices_of(agent, SLICES_FOR)
                 for d in item["spec"].get("devices", [])]
        whole = next(n for n in names if n.startswith("gpu-0") and "-mig-" not in n)
        migs = sorted(n for n in names if "-mig-" in n)
        one_mig = next(n for n in migs if n.startswith("gpu-1-"))
        device = {"gpu": whole, "mig": one_mig}
        # Every claim of the run, fresh UIDs: the plugin loads the file once.
        warm = 10
        plan: dict[tuple[str, str], list[dict[str, Any]]] = {
            (path, kind): [_claim(f"{path}-{kind}-{i}", device[kind])
                           for i in range(cycles + warm)]
            for path in PATHS for kind in KINDS}
        at_once = [[_claim(f"b{b}-{i}", name) for i, name in enumerate(migs)]
                   for b in range(batches + 1)]
        claims_file = root / "claims.json"
        claims_file.write_text(json.dumps(
            [c for cs in plan.values() for c in cs] + [c for cs in at_once for c in cs]))
        plugin = PluginProcess(root / "plugin", DraAgent(agent, token_file),
                               reader=f"file:{claims_file}", registry_dir=root / "registry")
        client = AgentClient(agent.socket_path, token_file)
        channel = grpc.aio.insecure_channel(f"unix://{plugin.dra_socket}")
        stub = dra_v1_pb2_grpc.DRAPluginStub(channel)

        def stamp() -> int:
            return time.clock_gettime_ns(time.CLOCK_BOOTTIME)

        async def rest(obj: dict[str, Any]) -> float:
            meta = obj["metadata"]
            kc = KubeletClaim(meta["namespace"], meta["uid"], meta["name"])
            devices = our_devices(kc, obj, driver=DRIVER, pool=NODE)
            began = time.perf_counter()
            await client.prepare(kc.uid, agent_body(kc, obj, devices, stamp()))
            took = time.perf_counter() - began
            await client.unprepare(kc.uid, stamp())
            return took

        def message(obj: dict[str, Any]) -> Any:
            meta = obj["metadata"]
            return dra_v1_pb2.Claim(namespace=meta["namespace"], name=meta["name"],
                                    uid=meta["uid"])

        async def grpc_prepare(obj: dict[str, Any]) -> float:
            began = time.perf_counter()
            answer = await stub.NodePrepareResources(
                dra_v1_pb2.NodePrepareResourcesRequest(claims=[message(obj)]), timeout=60)
            took = time.perf_counter() - began
            if any(r.error for r in answer.claims.values()) or not answer.claims:
                raise RuntimeError(f"prepare failed: {dict(answer.claims)}")
            return took

        async def grpc_unprepare(obj: dict[str, Any]) -> None:
            answer = await stub.NodeUnprepareResources(
                dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[message(obj)]), timeout=60)
            if any(r.error for r in answer.claims.values()):
                raise RuntimeError(f"unprepare failed: {dict(answer.claims)}")

        async def via_plugin(obj: dict[str, Any]) -> float:
            took = await grpc_prepare(obj)
            await grpc_unprepare(obj)
            return took

        def usage() -> tuple[float, float]:
            assert plugin is not None
            return cpu_seconds(agent.proc.pid), cpu_seconds(plugin.proc.pid)

        rows = {key: _Row() for key in plan}
        for (path, _), objs in plan.items():  # warm-up: connections, first calls, caches
            for obj in objs[:warm]:
                await (rest(obj) if path == "rest" else via_plugin(obj))
        order = list(plan)
        done = dict.fromkeys(order, warm)
        for b in range(math.ceil(cycles / block)):
            shift = b % len(order)  # rotate so no row always follows the same one
            for key in order[shift:] + order[:shift]:
                objs = plan[key][done[key]:done[key] + block]
                if not objs:
                    continue
                done[key] += len(objs)
                agent_before, plugin_before = usage()
                times = [await (rest(o) if key[0] == "rest" else via_plugin(o)) for o in objs]
                agent_after, plugin_after = usage()
                rows[key].add_block(agent_after - agent_before, plugin_after - plugin_before,
                                    times)
        batch_row = _Row()
        for b, objs in enumerate(at_once):
            agent_before, plugin_before = usage()
            times = list(await asyncio.gather(*(grpc_prepare(o) for o in objs)))
            await asyncio.gather(*(grpc_unprepare(o) for o in objs))
            agent_after, plugin_after = usage()
            if b:  # the first batch warms up
                batch_row.add_block(agent_after - agent_before,
                                    plugin_after - plugin_before, times)
        await channel.close()
        await client.close()
    finally:
        if plugin is not None:
            plugin.stop()
        agent.stop()
        shutil.rmtree(cdi_dir, ignore_errors=True)
    return _figures(rows, batch_row, len(migs))


def _figures(rows: dict[tuple[str, str], _Row], batch: _Row, at_once: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for kind in KINDS:
        rest, via = rows[("rest", kind)], rows[("plugin", kind)]
        out[f"agent CPU ms/cycle, REST, {kind}"] = rest.agent_cpu_s / rest.cycles * 1e3
        out[f"agent CPU ms/cycle, plugin path, {kind}"] = via.agent_cpu_s / via.cycles * 1e3
        out[f"plugin CPU ms/cycle, {kind}"] = via.plugin_cpu_s / via.cycles * 1e3
        rest_p50 = _percentile(rest.prepare_s or [], 50)
        via_p50 = _percentile(via.prepare_s or [], 50)
        out[f"prepare p50 ms, REST, {kind}"] = rest_p50 * 1e3
        out[f"prepare p50 ms, plugin path, {kind}"] = via_p50 * 1e3
        out[f"plugin hop over REST p50 ms, {kind}"] = (via_p50 - rest_p50) * 1e3
    out[f"agent CPU ms/cycle, plugin path, {at_once} at once"] = \
        batch.agent_cpu_s / batch.cycles * 1e3
    out[f"plugin CPU ms/cycle, {at_once} at once"] = batch.plugin_cpu_s / batch.cycles * 1e3
    out[f"prepare p50 ms, plugin path, {at_once} at once"] = \
        _percentile(batch.prepare_s or [], 50) * 1e3
    return out


def targeted(name: str) -> bool:
    """Whether the issue sets the 0.5x target on this figure (agent CPU, plugin CPU, hop)."""
    return name.startswith(("agent CPU", "plugin CPU", "plugin hop"))


# --- side by side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    label: str  # "baseline" or "current"
    root: Path
    describe: str


def run_tree(tree: Tree, sizes: dict[str, int], workdir: Path,
             timeout_s: float = 900) -> dict[str, float]:
    """One measurement of ``tree`` in a subprocess (this file's source, run in the tree)."""
    out = workdir / f"{tree.label}.json"
    log = workdir / f"{tree.label}.log"
    out.unlink(missing_ok=True)
    with log.open("wb") as sink:
        done = subprocess.run(
            [sys.executable, "-c", Path(__file__).read_text(), "--measure", json.dumps(sizes),
             str(out)], cwd=tree.root, env={**os.environ, "PYTHONPATH": str(tree.root)},
            stdout=sink, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"the {tree.label} tree's run exited {done.returncode}:\n"
                           + log.read_text(errors="replace")[-4000:])
    figures: dict[str, float] = json.loads(out.read_text())
    return figures


def _ratio(current: float, baseline: float) -> float:
    return current / baseline if baseline > 0 else math.inf


def report(runs: dict[str, list[dict[str, float]]], header: Sequence[str]) -> list[str]:
    """One table: per figure both medians, their ratio, the per-round ratios, the target."""
    lines = list(header)
    lines.append(f"{'figure (ms, lower is better)':<46} {'baseline':>9} {'current':>9} "
                 f"{'ratio':>6} {'round ratios: median (min-max)':>31}  target")
    for name in runs["current"][0]:
        base = [r[name] for r in runs["baseline"] if name in r]
        cur = [r[name] for r in runs["current"]]
        if len(base) != len(cur):
            lines.append(f"{name:<46} only the current tree reports it")
            continue
        ratio = _ratio(statistics.median(cur), statistics.median(base))
        per_round = [_ratio(c, b) for b, c in zip(base, cur, strict=True)]
        spread = (f"{statistics.median(per_round):.3f} "
                  f"({min(per_round):.3f}-{max(per_round):.3f})")
        goal = (f"<= {TARGET}x: {'yes' if ratio <= TARGET else 'NO'}" if targeted(name)
                else "")
        lines.append(f"{name:<46} {statistics.median(base):>9.3f} "
                     f"{statistics.median(cur):>9.3f} {ratio:>6.3f} {spread:>31}  {goal}")
    return lines


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def _filesystem(path: str) -> str:
    """The type of the filesystem holding ``path`` (from /proc/mounts), for the header."""
    best, kind = "", "?"
    with contextlib.suppress(OSError):
        resolved = os.path.realpath(path)
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            mount = parts[1] if len(parts) >= 3 else ""
            if mount and (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) \
                    and len(mount) >= len(best):
                best, kind = mount, parts[2]
    return kind


def machine() -> str:
    return (f"{os.cpu_count()} CPUs {platform.machine()}, "
            f"Python {platform.python_version()}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.claim_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a git revision, or a directory holding the "
                        "baseline tree (checked out already)")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--cycles", type=int, default=CYCLES,
                        help=f"prepare+unprepare cycles per path and kind (default {CYCLES})")
    parser.add_argument("--batches", type=int, default=BATCHES,
                        help=f"batches of 49 at once through the plugin (default {BATCHES})")
    parser.add_argument("--state-root", default=STATE_ROOT,
                        help=f"directory holding the agent's state directory (default "
                        f"{STATE_ROOT}, on disk; a tmpfs takes fsync latency out of the times)")
    parser.add_argument("--json", type=Path, help="also write every run's figures here")
    parser.add_argument("--measure", nargs=2, metavar=("SIZES", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        # The tree's, through PYTHONPATH: checked, or the comparison means nothing.
        if not Path(str(agent.__file__)).resolve().is_relative_to(Path.cwd().resolve()):
            raise SystemExit(f"agent comes from {agent.__file__}, not from {Path.cwd()}")
        sizes = json.loads(args.measure[0])
        Path(args.measure[1]).write_text(json.dumps(measure(**sizes)))
        return 0
    repo = Path(__file__).resolve().parents[1]
    sizes = {"cycles": args.cycles, "batches": args.batches, "state_root": args.state_root}
    head = _git("rev-parse", "--short", "HEAD", cwd=repo)
    dirty = " + uncommitted changes" if _git("status", "--porcelain", "--untracked-files=no",
                                             cwd=repo) else ""
    current = Tree("current", repo, f"{head}{dirty} ({repo})")
    loads: list[float] = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-claim-cost-") as tmp:
        workdir = Path(tmp)
        worktree: Path | None = None
        trees: list[Tree] = []
        if args.baseline and Path(args.baseline).is_dir():
            root = Path(args.baseline).resolve()
            trees.append(Tree("baseline", root,
                              f"{_git('rev-parse', '--short', 'HEAD', cwd=root)} ({root})"))
        elif args.baseline:
            commit = _git("rev-parse", "--verify", f"{args.baseline}^{{commit}}", cwd=repo)
            worktree = workdir / "baseline"
            _git("worktree", "add", "--detach", "--quiet", str(worktree), commit, cwd=repo)
            trees.append(Tree("baseline", worktree, f"{args.baseline} = {commit[:7]}"))
        trees.append(current)
        runs: dict[str, list[dict[str, float]]] = {"baseline": [], "current": []}
        try:
            for r in range(args.rounds):
                for tree in trees if r % 2 == 0 else trees[::-1]:
                    started = time.monotonic()
                    runs[tree.label].append(run_tree(tree, sizes, workdir))
                    loads.append(os.getloadavg()[0])
                    print(f"round {r + 1}/{args.rounds} {tree.label:<8} "
                          f"{time.monotonic() - started:6.1f} s", file=sys.stderr, flush=True)
        finally:
            if worktree is not None:
                with contextlib.suppress(subprocess.CalledProcessError):
                    _git("worktree", "remove", "--force", str(worktree), cwd=repo)
                _git("worktree", "prune", cwd=repo)
    minutes = (time.monotonic() - began) / 60
    if not runs["baseline"]:
        runs["baseline"] = [{} for _ in runs["current"]]
    header = [
        f"# cost per claim: baseline {trees[0].describe if len(trees) > 1 else '(none)'} vs "
        f"current {current.describe}",
        f"# {args.rounds} rounds, order swapped each round, {minutes:.1f} min; {machine()}; "
        f"{args.cycles} cycles per path and kind one at a time, {args.batches} batches of 49 "
        f"at once; agent state under {args.state_root} ({_filesystem(args.state_root)}), CDI "
        "specs on /dev/shm",
        f"# load average (1 min) after each run: median {statistics.median(loads):.1f}, max "
        f"{max(loads):.1f}",
        "# CPU: user + system of the process over its path's cycles, per prepare+unprepare; "
        "hop: plugin path prepare p50 - REST prepare p50; ratio = current / baseline medians"]
    for line in report(runs, header):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"sizes": sizes, "machine": machine(), "runs": runs},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
