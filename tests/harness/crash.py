"""Crash-consistency harness: a real agent process on the simulator with per-call latency,
a seeded mix of geometry changes and claim prepares/unprepares, SIGKILLed at seeded random
moments and at deterministic points (the simulator's CRASH fault at the k-th mutating NVML
call of a transition, of a slice prepare and of a slice unprepare), restarted, and checked.
MPS prepares (a whole GPU under MPS, memory shares) are killed at seeded moments too, while
nvidia-smi runs or the daemon starts: after the restart no daemon runs that no prepared claim
owns, every prepared claim's daemon runs, and a full GPU is in EXCLUSIVE_PROCESS exactly when
a whole-GPU MPS claim holds it.
Each restart is met the way kubelet meets a plugin socket: prepares, unprepares, claim reads
and geometry requests from the moment the socket accepts, not after ``/readyz``; every one
answered before ready must be 503 ``not-ready`` with ``Retry-After`` (nothing acknowledged).

``python -m tests.harness.crash --trials N --seed S`` runs N trials and prints figures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.claims.checkpoint import decode
from tests.agent_process import AgentProcess, start_agent
from tests.from_bind import Background, Call
from tests.waiting import wait_for

MUTATING = {"destroy_ci": "nvmlComputeInstanceDestroy", "destroy_gi": "nvmlGpuInstanceDestroy",
            "set_mode": "nvmlDeviceSetMigMode",
            "create_gi": "nvmlDeviceCreateGpuInstanceWithPlacement",
            "create_ci": "nvmlGpuInstanceCreateComputeInstance"}
LATENCY_S = 0.01
GEOMETRY_GPUS = ("0", "1", "2", "3")  # geometry changes only; no claim uses them
FULL_GPUS = ("4", "5")  # whole-GPU claims, MPS ones and memory shares included
MPS_DEVICES: tuple[dict[str, Any], ...] = (
    {"sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}},
    {"capacity": {"memory": "10Gi"}},
    {"capacity": {"memory": "20Gi"}},
)
SLICE_GPUS = ("6", "7")  # MIG on, on-demand slices only
TARGETS: tuple[dict[str, Any], ...] = (
    {"profiles": ["7g.80gb"]},
    {"profiles": ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]},
    {"profiles": ["3g.40gb", "3g.40gb"]},
    {"profiles": ["1g.10gb"] * 7},
    {"profiles": ["4g.40gb", "2g.20gb", "1g.10gb"]},
    {"mig_enabled": False},
)
OK_CODES = frozenset({200, 202, 204, 409, 422, 503})


class InvariantBroken(AssertionError):
    pass


@dataclass
class Figures:
    trials: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    faults_injected: int = 0
    kills: int = 0
    requests: int = 0
    acknowledged_prepares: int = 0
    acknowledged_unprepares: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    early_answers: int = 0
    """Requests sent from the socket's bind and answered before ready (each a 503)."""
    seconds: float = 0.0


def layout(agent: AgentProcess, gpu: str) -> list[str]:
    body = agent.request("GET", f"/v1/gpus/{gpu}/mig", token=None).body
    if not body["mig_mode"]["current"]:
        return ["MIG off"]
    return sorted(f"{i['profile']}@{i['placement']['start']}:{i['placement']['size']}"
                  for i in body["instances"])


def _plan_layout(plan: dict[str, Any]) -> list[str]:
    if not plan["mig_enabled_after"]:
        return ["MIG off"]
    return sorted(f"{i['profile']}@{i['placement']['start']}:{i['placement']['size']}"
                  for i in plan["keep"] + plan["create"])


def mutation_sequence(plan: dict[str, Any]) -> list[str]:
    """The NVML mutations a plan makes, in order (one CI per GI)."""
    seq = [MUTATING["destroy_ci"]] * len(plan["destroy"])
    seq += [MUTATING["destroy_gi"]] * len(plan["destroy"])
    if plan["mig_enabled_before"] != plan["mig_enabled_after"]:
        seq.append(MUTATING["set_mode"])
    seq += [MUTATING["create_gi"], MUTATING["create_ci"]] * len(plan["create"])
    return seq


class Harness:
    def __init__(self, workdir: Path, seed: int, mps_root: Path) -> None:
        self.state = workdir / "state"
        self.mps_root = mps_root
        self.extra = ["--mps-root", str(mps_root)]
        self.rng = random.Random(seed)
        # Requests sent from bind are as many as the start-up takes: their own generator keeps
        # the seeded trial sequence independent of timing.
        self.early_rng = random.Random(seed + 1)
        self.figures = Figures()
        self.acknowledged: dict[str, list[str]] = {}  # uid -> device uuids
        self.unprepare_sent: set[str] = set()
        self.geometry: dict[str, list[str]] = {}
        self.serial = 0
        self.agent = start_agent(self.state, extra=self.extra)
        for gpu in SLICE_GPUS:
            self._wait(self.agent.request("PUT", f"/v1/gpus/{gpu}/mig", {"profiles": []}))
        for gpu in GEOMETRY_GPUS:
            self.geometry[gpu] = layout(self.agent, gpu)
        self._latency()
        self._points: list[tuple[str, int]] = []  # deterministic points still to visit

    def _latency(self) -> None:
        self.agent.request("PUT", "/v1/sim/latency", dict.fromkeys(MUTATING.values(),
                                                                   LATENCY_S))

    def _wait(self, reply: Any) -> None:
        if reply.status != 202:
            return
        try:
            wait_for(lambda: self.agent.request("GET", reply.headers["location"],
                                                token=None).body["terminal"],
                     "the transition to end", 30, every_s=0.01)
        except AssertionError as err:
            raise InvariantBroken(f"transition did not end ({err})") from None

    def _req(self, method: str, path: str, body: Any = None) -> Any:
        self.figures.requests += 1
        reply = self.agent.request(method, path, body)
        if reply.status not in OK_CODES:
            raise InvariantBroken(f"{method} {path}: {reply.status} {reply.body}")
        return reply

    def _uid(self) -> str:
        self.serial += 1
        return f"c{self.serial}"

    def _prepare(self, devices: list[dict[str, Any]]) -> None:
        uid = self._uid()
        try:
            reply = self._req("PUT", f"/v1/claims/{uid}", {"devices": devices})
        except OSError:
            return
        if any("sharing" in d or "capacity" in d for d in devices):
            self.figures.outcomes[f"mps prepare: {reply.status}"] += 1
        if reply.status == 200:
            self.acknowledged[uid] = [d["uuid"] for d in reply.body["devices"]]
            self.figures.acknowledged_prepares += 1

    def _unprepare(self, uid: str) -> None:
        self.unprepare_sent.add(uid)
        try:
            reply = self._req("DELETE", f"/v1/claims/{uid}")
        except OSError:
            return
        if reply.status == 204:
            self.acknowledged.pop(uid, None)
            self.unprepare_sent.discard(uid)
            self.figures.acknowledged_unprepares += 1

    def _fault(self, function: str, gpu: str, skip: int) -> None:
        uuid = self.agent.request("GET", f"/v1/gpus/{gpu}", token=None).body["uuid"]
        self.agent.request("POST", "/v1/sim/faults", {"function": function, "error": "CRASH",
                                                      "gpu": uuid, "skip": skip})
        self.figures.faults_injected += 1

    # -- trials ----------------------------------------------------------------------------

    def trial(self) -> None:
        self.figures.trials += 1
        kind = self.rng.choice(("transition", "transition", "prepare", "unprepare", "random",
                                "random", "mps"))
        if kind == "unprepare" and not self._slice_claims():
            kind = "prepare"
        self.figures.kinds[kind] += 1
        changing: dict[str, list[list[str]]] = {}
        if kind == "transition":
            gpu = self.rng.choice(GEOMETRY_GPUS)
            target = self.rng.choice(TARGETS)
            dry = self._req("PUT", f"/v1/gpus/{gpu}/mig?dry_run=true", target)
            if dry.status != 200 or not mutation_sequence(dry.body["plan"]):
                self.figures.outcomes["transition: nothing to do"] += 1
                return
            seq = mutation_sequence(dry.body["plan"])
            k = self.rng.randrange(len(seq))
            self._fault(seq[k], gpu, seq[:k].count(seq[k]))
            changing[gpu] = [self.geometry[gpu], _plan_layout(dry.body["plan"])]
            self._req("PUT", f"/v1/gpus/{gpu}/mig", target)
            self._await_death()
        elif kind == "prepare":
            gpu = self.rng.choice(SLICE_GPUS)
            function = self.rng.choice((MUTATING["create_gi"], MUTATING["create_ci"]))
            self._fault(function, gpu, 0)
            uid = self._uid()
            try:
                self._req("PUT", f"/v1/claims/{uid}", {"devices": [
                    {"kind": "slice", "profile": self._profile(), "gpu": gpu}]})
            except OSError:
                self._await_death()
            else:  # refused before any mutation (no room): kill it anyway
                self.figures.outcomes["prepare: refused"] += 1
                self.agent.stop(signal.SIGKILL)
                self.figures.kills += 1
        elif kind == "unprepare":
            uid, gpu = self.rng.choice(self._slice_claims())
            function = self.rng.choice((MUTATING["destroy_ci"], MUTATING["destroy_gi"]))
            self._fault(function, gpu, 0)
            self._unprepare(uid)
            if uid in self.acknowledged:
                self._await_death()
            else:
                raise InvariantBroken(f"an unprepare of {uid} that crashed was answered")
        elif kind == "mps":
            self._mps_burst()
        else:
            changing = self._random_burst()
        self._restart_and_check(changing)

    def _mps_device(self) -> dict[str, Any]:
        return {"kind": "gpu", "device": self.rng.choice(FULL_GPUS),
                **self.rng.choice(MPS_DEVICES)}

    def _mps_burst(self) -> None:
        """MPS prepares and unprepares in flight, SIGKILLed at a seeded moment (nvidia-smi
        running, a daemon starting, a checkpoint being written)."""
        ops: list[Any] = [("prepare", [self._mps_device()])
                          for _ in range(self.rng.randrange(1, 4))]
        if self.acknowledged and self.rng.random() < 0.5:
            ops.append(("unprepare", self.rng.choice(sorted(self.acknowledged))))
        threads = [threading.Thread(target=self._prepare if op == "prepare" else
                                    self._unprepare, args=(arg,)) for op, arg in ops]
        for t in threads:
            t.start()
        # An MPS prepare takes a few hundred ms (the daemon's start): some finish, most not.
        time.sleep(self.rng.uniform(0.0, 0.8))
        self.agent.stop(signal.SIGKILL)
        self.figures.kills += 1
        for t in threads:
            t.join()

    def _profile(self) -> str:
        return self.rng.choice(("1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"))

    def _slice_claims(self) -> list[tuple[str, str]]:
        body = self.agent.request("GET", "/v1/claims", token=None).body["claims"]
        index = {self.agent.request("GET", f"/v1/gpus/{g}", token=None).body["uuid"]: g
                 for g in SLICE_GPUS}
        return [(c["uid"], index[c["devices"][0]["parent_uuid"]]) for c in body
                if c["devices"] and c["devices"][0].get("on_demand")
                and c["devices"][0].get("parent_uuid") in index]

    def _random_burst(self) -> dict[str, list[list[str]]]:
        changing: dict[str, list[list[str]]] = {}
        gpu = self.rng.choice(GEOMETRY_GPUS)
        target = self.rng.choice(TARGETS)
        dry = self._req("PUT", f"/v1/gpus/{gpu}/mig?dry_run=true", target)
        if dry.status == 200:
            changing[gpu] = [self.geometry[gpu], _plan_layout(dry.body["plan"])]
        ops: list[Any] = []
        for _ in range(self.rng.randrange(2, 8)):
            choice = self.rng.random()
            if choice < 0.2:
                ops.append(("prepare", [{"kind": "gpu",
                                         "device": self.rng.choice(FULL_GPUS)}]))
            elif choice < 0.3:
                ops.append(("prepare", [self._mps_device()]))
            elif choice < 0.7:
                ops.append(("prepare", [{"kind": "slice",
                                         "profile": self._profile(),
                                         "gpu": self.rng.choice(SLICE_GPUS)}]))
            elif self.acknowledged:
                ops.append(("unprepare", self.rng.choice(sorted(self.acknowledged))))
        delay = self.rng.uniform(0.0, 0.4)

        def transition() -> None:
            with contextlib.suppress(OSError):
                self._req("PUT", f"/v1/gpus/{gpu}/mig", target)

        def client(op: tuple[str, Any]) -> None:
            if op[0] == "prepare":
                self._prepare(op[1])
            else:
                self._unprepare(op[1])

        threads = [threading.Thread(target=transition)]
        threads += [threading.Thread(target=client, args=(op,)) for op in ops]
        for t in threads:
            t.start()
        time.sleep(delay)
        self.agent.stop(signal.SIGKILL)
        self.figures.kills += 1
        for t in threads:
            t.join()
        return changing

    def _await_death(self) -> None:
        try:
            code = self.agent.proc.wait(30)
        except Exception as err:
            raise InvariantBroken(f"the CRASH fault did not kill the agent: {err}") from err
        if code != -signal.SIGKILL:
            raise InvariantBroken(f"agent exited with {code}, not by SIGKILL")
        self.figures.kills += 1

    # -- restart and invariants ------------------------------------------------------------

    def _early_call(self, n: int) -> Call:
        """The n-th request sent from the socket's bind: prepares (whole GPU, slice), an
        unprepare of a claim nobody made, claim and CDI reads, a geometry dry run."""
        kind = n % 6
        if kind == 0:
            return Call("PUT", f"/v1/claims/{self._uid()}", {"devices": [
                {"kind": "gpu", "device": self.early_rng.choice(FULL_GPUS)}]})
        if kind == 1:
            return Call("PUT", f"/v1/claims/{self._uid()}", {"devices": [
                {"kind": "slice", "profile": "1g.10gb",
                 "gpu": self.early_rng.choice(SLICE_GPUS)}]})
        if kind == 2:
            return Call("DELETE", f"/v1/claims/never-{n}")
        if kind == 3:
            return Call("GET", "/v1/claims")
        if kind == 4:
            return Call("GET", "/v1/cdi")
        return Call("PUT", f"/v1/gpus/{self.early_rng.choice(GEOMETRY_GPUS)}/mig?dry_run=true",
                    self.early_rng.choice(TARGETS))

    def _restart_and_check(self, changing: dict[str, list[list[str]]]) -> None:
        # The client starts first, so it is there when the socket binds.
        client = Background(self.state / "agent.sock", self.agent.token, self._early_call,
                            timeout=30)
        self.agent = start_agent(self.state, wait_ready=False, extra=self.extra)
        early = client.join()
        if early.died is not None:
            raise InvariantBroken(f"from bind: {early.died}:\n{self.agent.log()[-4000:]}")
        broken = early.violations()
        if broken:
            raise InvariantBroken(f"{len(broken)} requests answered before ready were not "
                                  f"503 not-ready: {broken[:3]}")
        self.figures.early_answers += len(early.early())
        self.figures.requests += len(early.answers)
        for answer in early.answers:
            if answer.status not in OK_CODES:
                raise InvariantBroken(f"{answer.call.method} {answer.call.path}: "
                                      f"{answer.status} {answer.body}")
            if answer.call.method == "PUT" and answer.status == 200 and \
                    answer.call.path.startswith("/v1/claims/"):
                uid = answer.call.path.rsplit("/", 1)[1]
                self.acknowledged[uid] = [d["uuid"] for d in answer.body["devices"]]
                self.figures.acknowledged_prepares += 1
        # Ready means recovered: no open journal entry, no half-done claim on disk.
        journal = list((self.state / "mig" / "journal").glob("*.json"))
        if journal:
            raise InvariantBroken(f"open journal entries after ready: {journal}")
        on_disk = decode((self.state / "claims.checkpoint").read_bytes())
        half = [r.uid for r in on_disk.claims.values() if r.state != "prepare_completed"]
        if half:
            raise InvariantBroken(f"claims not completed after ready: {half}")
        self._latency()
        for gpu in GEOMETRY_GPUS:
            now = layout(self.agent, gpu)
            allowed = changing.get(gpu, [self.geometry[gpu]])
            if now not in allowed:
                raise InvariantBroken(f"GPU {gpu} shows {now}; allowed {allowed}")
            if gpu in changing:
                self.figures.outcomes["transition: new" if now == allowed[-1] and
                                      now != allowed[0] else "transition: old"] += 1
            self.geometry[gpu] = now
        claims = {c["uid"]: c for c in
                  self.agent.request("GET", "/v1/claims", token=None).body["claims"]}
        for uid, devices in self.acknowledged.items():
            if uid in self.unprepare_sent and uid not in claims:
                continue  # an unprepare in flight may have finished or been rolled forward
            claim = claims.get(uid)
            if claim is None or claim["state"] != "prepare_completed":
                raise InvariantBroken(f"acknowledged claim {uid} lost: {claim}")
            if [d["uuid"] for d in claim["devices"]] != devices:
                raise InvariantBroken(f"claim {uid} devices changed: {claim['devices']}")
            if not Path(claim["cdi_spec"]).exists():
                raise InvariantBroken(f"claim {uid} has no CDI spec file")
        if set(on_disk.claims) != set(claims):
            raise InvariantBroken(f"checkpoint {sorted(on_disk.claims)} != API {sorted(claims)}")
        specs = {p.name for p in (self.state / "cdi").glob("k8s.gpu.nodeagent.dev-claim_*")}
        if specs != {f"k8s.gpu.nodeagent.dev-claim_{uid}.json" for uid in claims}:
            raise InvariantBroken(f"spec files {sorted(specs)} != claims {sorted(claims)}")
        owned = {d["uuid"] for c in claims.values() for d in c["devices"]}
        sim = self.agent.request("GET", "/v1/sim").body
        for g in sim["gpus"]:
            if g["gpu_instances_without_ci"]:
                raise InvariantBroken(f"GPU {g['index']}: GIs without CI "
                                      f"{g['gpu_instances_without_ci']}")
            if str(g["index"]) in SLICE_GPUS:
                stray = {d["uuid"] for d in g["mig_devices"]} - owned
                if stray:
                    raise InvariantBroken(f"GPU {g['index']}: MIG devices nobody owns {stray}")
        self._check_mps(claims, sim)
        if any(t["state"] not in ("succeeded", "rolled_back", "aborted") for t in
               self.agent.request("GET", "/v1/transitions", token=None).body["transitions"]):
            raise InvariantBroken("a transition ended neither succeeded nor rolled back")
        self.acknowledged = {uid: [d["uuid"] for d in c["devices"]]
                             for uid, c in claims.items()}
        self.unprepare_sent.clear()
        # Keep the slice GPUs from filling up: release some claims now and then.
        if len(self.acknowledged) > 6:
            for uid in self.rng.sample(sorted(self.acknowledged), 3):
                self._unprepare(uid)

    def _check_mps(self, claims: dict[str, Any], sim: dict[str, Any]) -> None:
        """No daemon runs that no prepared claim owns; every prepared MPS claim's daemon runs
        (re-adopted); a full GPU is EXCLUSIVE_PROCESS exactly when a whole-GPU MPS claim
        holds it."""
        daemons = {d["pipe_directory"] for d in sim["mps_daemons"]}
        owned = {c["mps"]["pipe_directory"]: uid for uid, c in claims.items() if c["mps"]}
        if daemons - set(owned):
            raise InvariantBroken(f"MPS daemons no claim owns: {sorted(daemons - set(owned))}")
        for pipe, uid in owned.items():
            if pipe not in daemons or claims[uid]["mps"]["state"] != "running":
                raise InvariantBroken(f"claim {uid}: its MPS daemon is not running "
                                      f"({claims[uid]['mps']})")
        exclusive = {d["uuid"] for c in claims.values() for d in c["devices"]
                     if d["kind"] == "gpu" and d["sharing"] and d["sharing"]["strategy"] == "MPS"
                     and d["share"] is None}
        for g in sim["gpus"]:
            if (g["compute_mode"] == "EXCLUSIVE_PROCESS") != (g["uuid"] in exclusive):
                raise InvariantBroken(f"GPU {g['index']} is {g['compute_mode']}; whole-GPU MPS "
                                      f"claims hold {sorted(exclusive)}")
        self.figures.outcomes["mps daemons running"] += len(owned)

    def close(self) -> None:
        """Unprepare every claim (no daemon outlives the run), then kill the agent; daemons
        left by an agent that is already dead are found by their pipe directory and killed."""
        with contextlib.suppress(Exception):
            if self.agent.proc.poll() is None:
                for claim in self.agent.request("GET", "/v1/claims", token=None).body["claims"]:
                    self.agent.request("DELETE", f"/v1/claims/{claim['uid']}")
        self.agent.stop(signal.SIGKILL)
        kill_daemons_under(self.mps_root)


def kill_daemons_under(root: Path) -> None:
    """SIGKILL this user's processes whose CUDA_MPS_PIPE_DIRECTORY is under ``root``."""
    marker = f"CUDA_MPS_PIPE_DIRECTORY={root}/".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ:
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGKILL)


def run(trials: int, seed: int, workdir: Path) -> Figures:
    started = time.monotonic()
    # A short MPS root: pipe directories hold Unix sockets, whose paths have 107 bytes.
    mps_root = Path(tempfile.mkdtemp(prefix="mps-"))
    harness = Harness(workdir, seed, mps_root)
    try:
        for _ in range(trials):
            harness.trial()
    except BaseException:
        print(f"seed {seed}, trial {harness.figures.trials}; agent log:\n"
              f"{harness.agent.log()[-4000:]}")
        raise
    finally:
        harness.close()
        shutil.rmtree(mps_root, ignore_errors=True)
    harness.figures.seconds = time.monotonic() - started
    return harness.figures


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.crash")
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        f = run(args.trials, args.seed, Path(tmp))
    print(f"trials {f.trials} in {f.seconds:.0f} s (seed {args.seed}): {dict(f.kinds)}")
    print(f"CRASH faults injected {f.faults_injected}, SIGKILLs {f.kills}, "
          f"requests {f.requests}")
    print(f"acknowledged prepares {f.acknowledged_prepares}, unprepares "
          f"{f.acknowledged_unprepares}; outcomes {dict(f.outcomes)}")
    print(f"requests answered before ready (all 503 not-ready) {f.early_answers}")
    print("invariants held in every trial")


if __name__ == "__main__":
    main()
