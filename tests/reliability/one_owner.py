"""One owner for each GPU (issue 12): a rig that drives GPU 0 of a real simulated agent through
claims, unprepares, geometry changes, NVML faults and SIGKILL restarts, and checks after every
step that

- **one-holder**: no device is held by two claims (by UUID), and a GPU claimed whole has no
  MIG claims;
- **held-device**: every acknowledged claim's device exists in NVML (the simulator) with the
  same UUID until the claim is unprepared (and the claim still reads ``prepare_completed``);
  a GPU claimed whole keeps MIG off;
- **transition**: every transition reaches a terminal state, and the geometry is the old or
  the new layout plus the instances claims hold (nothing leaked, nothing held destroyed);
- **ready-gate**: nothing is acknowledged (2xx on a mutation) before ``/readyz`` is 200;
  mutations before ready answer 503 ``not-ready`` with ``Retry-After``.

Two extra checks ride along: **agent-exit** (the agent died without being killed) and
**server-error** (a 500). The pytest driver (hypothesis) is
``tests/reliability/test_one_owner_stateful.py``; this module's runner is the long run:

    python -m tests.reliability.one_owner --cycles 1000 --seed 1

A cycle is one step (one action and the checks after it); it prints the figures
(``--story`` adds the steps before each violation shown, ``--actions`` runs a subset).

Readings of the specification the checks rest on: a whole-GPU claim needs MIG off (today's
409 otherwise), so MIG on under one is a changed device; a transition that ends ``failed``
(its rollback refused by NVML too: injected faults can do that) quarantines the GPU as
designed, so its layout is not judged, and the rig clears faults and quarantine as an
operator would; a rollback may bring back a slice that was unprepared while the plan kept it.
After a violation the model follows the agent, so that one defect is not counted every step.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.device_names import mig_device_name, parse_device_name
from tests.agent_process import Reply, start_agent
from tests.waiting import wait_for

GPU = "0"
MUTATING = ("nvmlDeviceCreateGpuInstanceWithPlacement", "nvmlGpuInstanceCreateComputeInstance",
            "nvmlComputeInstanceDestroy", "nvmlGpuInstanceDestroy", "nvmlDeviceSetMigMode")
#: Seconds per NVML call: long enough that claims land inside a transition.
LATENCY = {"nvmlDeviceCreateGpuInstanceWithPlacement": 0.02,
           "nvmlGpuInstanceCreateComputeInstance": 0.01, "nvmlComputeInstanceDestroy": 0.01,
           "nvmlGpuInstanceDestroy": 0.02, "nvmlDeviceSetMigMode": 0.02}
#: Geometries a step may ask for (most leave room for slices).
TARGETS: tuple[dict[str, Any], ...] = (
    {"mig_enabled": False},
    {"profiles": []},
    {"profiles": ["7g.80gb"]},
    {"profiles": ["3g.40gb"]},
    {"profiles": ["3g.40gb", "3g.40gb"]},
    {"profiles": ["3g.40gb", "2g.20gb", "1g.10gb"]},
    {"profiles": ["1g.10gb", "1g.10gb"]},
    {"profiles": ["2g.20gb", "1g.10gb"]},
    {"profiles": ["4g.40gb", "1g.10gb"]},
)
SLICE_PROFILES = ("1g.10gb", "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb")
NAME_FORMS = ("index", "uuid", "device-name")
UNPREPARE_KINDS = ("held", "held", "unknown", "again")
POLICIES = ("fail", "wait")
FAULT_ERRORS = ("NVML_ERROR_UNKNOWN", "NVML_ERROR_IN_USE", "NVML_ERROR_INSUFFICIENT_RESOURCES",
                "NVML_ERROR_TIMEOUT")
RESTART_MODES = ("idle", "mid-transition", "mid-claims", "crash-fault")
CLAIM_KINDS = ("whole", "mig", "mig", "slice", "slice")
INVARIANTS = ("one-holder", "held-device", "transition", "ready-gate")
EXTRA_CHECKS = ("agent-exit", "server-error")
TRANSITION_BOUND_S = 20.0
READY_BOUND_S = 60.0
EARLY_REQUESTS = 12
BOOTS = 4

Instance = tuple[str, int, int]  # profile, start, size


class AgentGone(Exception):
    """The agent does not come back up on its state directory."""


class Bag(Counter[Instance]):
    """A multiset of MIG instances."""

    def covers(self, other: Counter[Instance]) -> bool:
        return all(self[k] >= n for k, n in other.items())


@dataclass(frozen=True)
class Layout:
    """A GPU's MIG mode and instances."""

    mig_on: bool
    instances: tuple[Instance, ...] = ()

    @classmethod
    def of(cls, mig_on: bool, instances: Iterable[Instance]) -> Layout:
        return cls(mig_on, tuple(sorted(instances)) if mig_on else ())

    def __str__(self) -> str:
        if not self.mig_on:
            return "MIG off"
        return "[" + ", ".join(f"{p}@{s}:{n}" for p, s, n in self.instances) + "]"


def matching_base(actual: Layout, bases: Iterable[Layout], required: Counter[Instance],
                  optional: Counter[Instance]) -> Layout | None:
    """The first base layout that ``actual`` is: the base plus every ``required`` instance (on-
    demand slices claims hold), plus any of the ``optional`` ones (slices whose unprepare did
    not finish, whole or as a bare GPU instance)."""
    have = Bag(actual.instances)
    for base in bases:
        if base.mig_on != actual.mig_on:
            continue
        need = Bag(base.instances) + required
        if have.covers(need) and Bag(optional).covers(have - need):
            return base
    return None


def plan_instances(items: list[dict[str, Any]]) -> list[Instance]:
    """The instances of a plan's ``keep``, ``destroy`` or ``create`` list."""
    return [(i["profile"], i["placement"]["start"], i["placement"]["size"]) for i in items]


@dataclass
class Held:
    """An acknowledged claim of the model."""

    uid: str
    body: dict[str, Any]
    kind: str  # "gpu" (the whole GPU) or "mig"
    uuid: str
    instance: Instance | None
    on_demand: bool
    releasing: bool = False  # an unprepare was sent and not acknowledged


@dataclass
class Violation:
    invariant: str
    detail: str
    cycle: int

    def __str__(self) -> str:
        return f"[{self.invariant}] cycle {self.cycle}: {self.detail}"


@dataclass
class Figures:
    cycles: int = 0
    actions: Counter[str] = field(default_factory=Counter)
    restarts: Counter[str] = field(default_factory=Counter)
    faults_injected: int = 0
    prepares_acknowledged: int = 0
    unprepares_acknowledged: int = 0
    early_acknowledged: int = 0
    transitions: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    violations: Counter[str] = field(default_factory=Counter)
    first: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    leads: dict[str, list[list[str]]] = field(default_factory=dict)  # steps before examples
    seconds: float = 0.0

    def add(self, violation: Violation, log: list[str]) -> None:
        self.violations[violation.invariant] += 1
        self.first.setdefault(violation.invariant, violation.cycle)
        shown = self.examples.setdefault(violation.invariant, [])
        if len(shown) < 3:
            shown.append(str(violation))
            self.leads.setdefault(violation.invariant, []).append(log[-12:])

    def story(self) -> str:
        """The steps that led to each violation shown in the summary."""
        return "\n".join(f"{name} violation {n + 1}, after:\n  " + "\n  ".join(lines)
                         for name, leads in self.leads.items()
                         for n, lines in enumerate(leads))

    def summary(self) -> str:
        lines = [f"cycles {self.cycles} in {self.seconds:.0f}s; restarts "
                 f"{sum(self.restarts.values())} {dict(self.restarts)}; faults injected "
                 f"{self.faults_injected}",
                 f"acknowledged prepares {self.prepares_acknowledged} (before ready: "
                 f"{self.early_acknowledged}), unprepares {self.unprepares_acknowledged}",
                 f"transitions by final state {dict(sorted(self.transitions.items()))}",
                 f"actions {dict(sorted(self.actions.items()))}",
                 f"replies {dict(sorted(self.statuses.items()))}",
                 "invariant violations (count, first cycle):"]
        for name in INVARIANTS + EXTRA_CHECKS:
            first = self.first.get(name)
            lines.append(f"  {name:13} {self.violations[name]:5}"
                         + (f"  first at cycle {first}" if first is not None else ""))
            lines += [f"      {e[:400]}" for e in self.examples.get(name, [])]
        return "\n".join(lines)


def _last_error(log: str) -> str:
    """The last exception line of an agent's log (its last line when there is none)."""
    lines = [line for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[A-Za-z_.]+(Error|Exception): ", line)]
    return (errors or lines or [""])[-1][:400]


def _serial(uid: str) -> int:
    """The order the rig made a claim uid in (``m12`` → 12)."""
    digits = re.sub(r"\D", "", uid)
    return int(digits) if digits else 0


def _problem_type(reply: Reply) -> str:
    body = reply.body if isinstance(reply.body, dict) else {}
    return str(body.get("type", "")).rsplit("/", 1)[-1]


def _calls(plan: dict[str, Any] | None) -> list[str]:
    """The mutating NVML functions a plan calls (a slice prepare creates a GPU instance)."""
    calls = ["nvmlDeviceCreateGpuInstanceWithPlacement"]
    if plan is not None:
        if plan["destroy"]:
            calls += ["nvmlComputeInstanceDestroy", "nvmlGpuInstanceDestroy"]
        if plan["create"]:
            calls.append("nvmlGpuInstanceCreateComputeInstance")
        if plan["mig_enabled_before"] != plan["mig_enabled_after"]:
            calls.append("nvmlDeviceSetMigMode")
    return calls


class Rig:
    """One simulated agent, GPU 0 of it, and the model of what it acknowledged."""

    def __init__(self, workdir: Path, figures: Figures | None = None) -> None:
        self.state = workdir / "state"
        self.figures = figures or Figures()
        self.cycle = 0
        self.log: list[str] = []
        self.held: dict[str, Held] = {}
        self.unprepared_order: list[str] = []
        self.unprepared: set[str] = set()
        self.uncertain: dict[str, dict[str, Any]] = {}  # uid -> body of a prepare unanswered
        self.pending: list[Violation] = []
        self.seen: set[tuple[str, str]] = set()
        self.serial = 0
        self.expect_exit = False
        self.agent = start_agent(self.state)
        self.gpu_uuid = str(self.agent.request("GET", f"/v1/gpus/{GPU}").body["uuid"])
        profiles = self.agent.request("GET", f"/v1/gpus/{GPU}/mig/profiles").body["profiles"]
        self.profile_by_id = {p["id"]: p["name"] for p in profiles}
        self.profile_id = {p["name"]: p["id"] for p in profiles}
        self.size = {p["name"]: p["placements"][0]["size"] for p in profiles}
        self._latency()
        actual, _ = self._hardware()
        self.bases: list[Layout] = [actual]
        self.released: Bag = Bag()  # on-demand instances unprepared during this step
        self.anything = False  # a transition failed (its rollback too): any layout will do

    # -- plumbing --------------------------------------------------------------------------

    def close(self) -> None:
        self.agent.stop(signal.SIGKILL)

    def note(self, text: str) -> None:
        self.log.append(f"{self.cycle}: {text}")
        del self.log[:-60]

    def violate(self, invariant: str, detail: str, key: str | None = None) -> None:
        if key is not None:
            if (invariant, key) in self.seen:
                return
            self.seen.add((invariant, key))
        violation = Violation(invariant, detail, self.cycle)
        self.pending.append(violation)
        self.figures.add(violation, self.log)
        self.note(f"VIOLATION {violation}")

    def send(self, method: str, path: str, body: Any = None) -> Reply | None:
        """One request; None when no answer came (connection refused or cut by a kill)."""
        try:
            reply = self.agent.request(method, path, body)
        except OSError:
            self.figures.statuses["no reply"] += 1
            return None
        self.figures.statuses[str(reply.status)] += 1
        if reply.status == 500:
            self.violate("server-error", f"{method} {path}: 500 {str(reply.body)[:300]}")
        return reply

    def _latency(self) -> None:
        self.send("PUT", "/v1/sim/latency", LATENCY)

    def _uid(self, prefix: str) -> str:
        self.serial += 1
        return f"{prefix}{self.serial}"

    def _hardware(self) -> tuple[Layout, dict[str, Instance]]:
        """GPU 0 as the simulator has it: layout and MIG UUID -> instance. A GPU instance
        without a compute instance counts as its instance (placed as a fresh NVML walk,
        ``GET /v1/gpus/0/mig``, sees it): it holds the slices all the same."""
        sim = self.agent.request("GET", "/v1/sim").body
        gpu = next(g for g in sim["gpus"] if g["uuid"] == self.gpu_uuid)
        devices = {d["uuid"]: (self.profile_by_id[d["gi_profile_id"]], d["placement"]["start"],
                               d["placement"]["size"]) for d in gpu["mig_devices"]}
        bare: list[Instance] = []
        if gpu["gpu_instances_without_ci"]:
            walk = self.agent.request("GET", f"/v1/gpus/{GPU}/mig").body
            placed = {i["gi_id"]: (i["profile"], i["placement"]["start"],
                                   i["placement"]["size"]) for i in walk.get("instances", [])}
            bare = [placed.get(gi, ("GPU instance without a placement", gi, 0))
                    for gi in gpu["gpu_instances_without_ci"]]
        return Layout.of(bool(gpu["mig_mode"]["current"]), [*devices.values(), *bare]), devices

    def _mig_devices(self) -> list[dict[str, Any]]:
        reply = self.send("GET", f"/v1/gpus/{GPU}")
        if reply is None or reply.status != 200:
            return []
        return list(reply.body["mig_devices"])

    def _instance(self, device_name: str) -> Instance | None:
        parsed = parse_device_name(device_name)
        if parsed is None or parsed.profile_id is None or parsed.start is None:
            return None
        profile = self.profile_by_id[parsed.profile_id]
        return (profile, parsed.start, self.size[profile])

    # -- requests (safe to run in threads: they only talk; results are applied later) -----

    def whole_body(self, form: str) -> dict[str, Any]:
        name = {"index": GPU, "uuid": self.gpu_uuid, "device-name": "gpu-0"}[form]
        return {"devices": [{"kind": "gpu", "device": name}]}

    def mig_body(self, pick: float, form: str) -> tuple[dict[str, Any], str | None]:
        """A claim of an existing MIG device (``pick`` in [0, 1) chooses which) and the UUID it
        names; one that is not there when GPU 0 has no MIG devices."""
        devices = sorted(self._mig_devices(), key=lambda d: d["index"])
        if not devices:
            return {"devices": [{"kind": "gpu", "device": "gpu-0-mig-1g10gb-19-6"}]}, None
        d = devices[int(pick * len(devices)) % len(devices)]
        name = {"index": f"{GPU}:{d['index']}", "uuid": d["uuid"],
                "device-name": mig_device_name(0, d["profile"], self.profile_id[d["profile"]],
                                               d["placement"]["start"])}[form]
        return {"devices": [{"kind": "gpu", "device": name}]}, d["uuid"]

    @staticmethod
    def slice_body(profile: str) -> dict[str, Any]:
        return {"devices": [{"kind": "slice", "profile": profile, "gpu": GPU}]}

    def claim_body(self, kind: str, rng: random.Random) -> tuple[dict[str, Any], str | None]:
        if kind == "whole":
            return self.whole_body(rng.choice(NAME_FORMS)), self.gpu_uuid
        if kind == "mig":
            return self.mig_body(rng.random(), rng.choice(NAME_FORMS))
        return self.slice_body(rng.choice(SLICE_PROFILES)), None

    # -- applying answers to the model ----------------------------------------------------

    def acknowledge(self, uid: str, body: dict[str, Any], reply: Reply | None,
                    expect: str | None) -> None:
        """Record a prepare's answer: 200 → the claim is held."""
        if reply is None:
            self.uncertain[uid] = body
            self.note(f"prepare {uid} {body['devices'][0]}: no reply")
            return
        self.note(f"prepare {uid} {body['devices'][0]}: {reply.status} "
                  f"{_problem_type(reply) if reply.status >= 400 else ''}")
        if reply.status != 200:
            return
        self.figures.prepares_acknowledged += 1
        self._adopt(uid, body, reply.body)
        got = reply.body["devices"][0]["uuid"]
        if expect is not None and got != expect:
            self.violate("held-device", f"claim {uid} asked for {expect} "
                         f"({body['devices'][0]['device']}) and was given {got}")

    def _adopt(self, uid: str, body: dict[str, Any], claim: dict[str, Any]) -> None:
        device = claim["devices"][0]
        self.held[uid] = Held(uid, body, device["kind"], device["uuid"],
                              self._instance(device["device_name"]) if device["kind"] == "mig"
                              else None, bool(device["on_demand"]))
        self.uncertain.pop(uid, None)

    def release(self, uid: str, reply: Reply | None) -> None:
        """Record an unprepare's answer: 204 → the claim and its on-demand slice are gone."""
        self.note(f"unprepare {uid}: {'no reply' if reply is None else reply.status}")
        held = self.held.get(uid)
        if reply is not None and reply.status == 204:
            self.figures.unprepares_acknowledged += 1
            self.uncertain.pop(uid, None)
            if uid not in self.unprepared:
                self.unprepared.add(uid)
                self.unprepared_order.append(uid)
            if held is not None:
                del self.held[uid]
                if held.on_demand and held.instance is not None:
                    self.released[held.instance] += 1
        elif held is not None and (reply is None or reply.status in (500, 502, 504)):
            held.releasing = True  # it may have got part of the way

    # -- actions ---------------------------------------------------------------------------

    def claim(self, body: dict[str, Any], expect: str | None, prefix: str = "c") -> None:
        uid = self._uid(prefix)
        self.acknowledge(uid, body, self.send("PUT", f"/v1/claims/{uid}", body), expect)

    def claim_whole(self, form: str) -> None:
        self.claim(self.whole_body(form), self.gpu_uuid, "w")

    def claim_mig(self, pick: float, form: str) -> None:
        body, expect = self.mig_body(pick, form)
        self.claim(body, expect, "m")

    def claim_slice(self, profile: str) -> None:
        self.claim(self.slice_body(profile), None, "s")

    def repeat_claim(self, pick: float) -> None:
        """A repeated prepare of a held claim answers the same device."""
        if not self.held:
            return
        held = sorted(self.held.values(), key=lambda h: h.uid)[int(pick * len(self.held))
                                                               % len(self.held)]
        reply = self.send("PUT", f"/v1/claims/{held.uid}", held.body)
        self.note(f"repeat {held.uid}: {None if reply is None else reply.status}")
        if reply is not None and reply.status == 200:
            got = reply.body["devices"][0]["uuid"]
            if got != held.uuid:
                self.violate("held-device", f"repeated prepare of {held.uid} answered {got}, "
                             f"first answered {held.uuid}")

    def unprepare_uid(self, kind: str, pick: float) -> str:
        if kind == "held" and self.held:
            uids = sorted(self.held)
            return uids[int(pick * len(uids)) % len(uids)]
        if kind == "again" and self.unprepared_order:
            return self.unprepared_order[int(pick * len(self.unprepared_order))
                                         % len(self.unprepared_order)]
        return self._uid("unknown")

    def unprepare(self, kind: str, pick: float) -> None:
        uid = self.unprepare_uid(kind, pick)
        self.release(uid, self.send("DELETE", f"/v1/claims/{uid}"))

    def inject_fault(self, function: str, error: str, skip: int) -> None:
        reply = self.send("POST", "/v1/sim/faults", {"function": function, "error": error,
                                                      "gpu": self.gpu_uuid, "skip": skip})
        if reply is not None and reply.status == 201:
            self.figures.faults_injected += 1
        self.note(f"fault {function} {error} skip {skip}")

    def _mig_body(self, target: int, policy: str, timeout_s: float) -> dict[str, Any]:
        return {**TARGETS[target], "drain": {"policy": policy, "timeout_s": timeout_s}}

    def change_geometry(self, target: int, policy: str, timeout_s: float) -> None:
        self.concurrently(target, policy, timeout_s, [], 0.0)

    def concurrently(self, target: int, policy: str, timeout_s: float,
                     claims: list[tuple[str, int]], delay_s: float, *,
                     unblock: float | None = None, fault: tuple[str, int] | None = None) -> None:
        """A geometry change with claims (kind, seed) sent while it runs; with ``unblock`` (a
        pick), an unprepare of a held claim too (a waiting drain may then go on); with
        ``fault`` (function, skip), an NVML_ERROR_UNKNOWN armed first (a rollback then)."""
        if fault is not None:
            self.inject_fault(fault[0], "NVML_ERROR_UNKNOWN", fault[1])
        body = self._mig_body(target, policy, timeout_s)
        dry = self.send("PUT", f"/v1/gpus/{GPU}/mig?dry_run=true", body)
        planned = dry.body["plan"] if dry is not None and dry.status == 200 else None
        victim = self.unprepare_uid("held", unblock) if unblock is not None and self.held \
            else None
        with ThreadPoolExecutor(max_workers=4) as pool:
            change = pool.submit(self.send, "PUT", f"/v1/gpus/{GPU}/mig", body)
            time.sleep(delay_s)
            sent = []
            for kind, seed in claims:
                rng = random.Random(seed)
                uid = self._uid(kind[0])

                def one(uid: str = uid, kind: str = kind, rng: random.Random = rng) -> Any:
                    claim, expect = self.claim_body(kind, rng)
                    # While the geometry changes, only a UUID names one device for sure (an
                    # index or placement may name a new instance by the time it is served).
                    if not str(claim["devices"][0].get("device", "")).startswith(("MIG-",
                                                                                   "GPU-")):
                        expect = None
                    return claim, expect, self.send("PUT", f"/v1/claims/{uid}", claim)
                sent.append((uid, pool.submit(one)))
            gone = pool.submit(self.send, "DELETE", f"/v1/claims/{victim}") if victim else None
            reply = change.result()
            results = [(uid, future.result()) for uid, future in sent]
            released = gone.result() if gone is not None else None
        for uid, (claim, expect, answer) in results:
            self.acknowledge(uid, claim, answer, expect)
        if victim is not None:
            self.release(victim, released)
        self.settle(reply, planned, body)

    def settle(self, reply: Reply | None, planned: dict[str, Any] | None,
               body: dict[str, Any]) -> None:
        """Follow a geometry change to its end and update the candidate layouts."""
        what = f"{body.get('profiles', body.get('mig_enabled'))} {body['drain']['policy']}"
        if reply is None:
            self.note(f"geometry {what}: no reply")
            self.figures.transitions["no reply"] += 1
            if planned is not None:
                self.bases.append(self._after(planned))
            return
        transition = reply.body.get("transition") if isinstance(reply.body, dict) else None
        if reply.status != 202 or transition is None:
            self.note(f"geometry {what}: {reply.status} {_problem_type(reply)}")
            self.figures.transitions[f"not started ({reply.status})"] += 1
            return
        new = self._after(transition["plan"])
        state = self.follow(transition["id"])
        self.note(f"geometry {what}: transition {transition['id']} {state}")
        self.figures.transitions[state] += 1
        if state == "succeeded":
            self.bases = [new]
        elif state == "rolled_back":
            # The old layout may come back with a slice that was unprepared meanwhile (the
            # plan kept it): old geometry, not a leak, by one reading of "restore the old".
            old = Bag(plan_instances(transition["plan"]["keep"]))
            back = Bag(self.released) & old
            if back:
                self.bases += [Layout.of(b.mig_on, (Bag(b.instances) + back).elements())
                               for b in self.bases]
        elif state == "failed":
            # A rollback that NVML refused too (injected faults can do that): the GPU is
            # quarantined as designed, and its layout is whatever the failure left. An
            # operator clears the faults and the quarantine, so that the run goes on.
            self.anything = True
            self.send("DELETE", "/v1/sim/faults")
            self.send("POST", f"/v1/admin/gpus/{GPU}/clear-quarantine")
        elif state in ("unknown", "pending_reset", "not terminal"):
            self.bases.append(new)

    def follow(self, transition_id: str) -> str:
        """The final state of a transition; ``not terminal`` past the bound is a violation."""
        def ended() -> str | None:
            reply = self.send("GET", f"/v1/transitions/{transition_id}")
            if reply is None or reply.status != 200:
                return "unknown"
            return str(reply.body["state"]) if reply.body["terminal"] else None
        try:
            return wait_for(ended, f"transition {transition_id} to end", TRANSITION_BOUND_S,
                            every_s=0.01)
        except AssertionError:
            self.violate("transition", f"transition {transition_id} not terminal after "
                         f"{TRANSITION_BOUND_S:.0f}s")
            return "not terminal"

    def _after(self, plan: dict[str, Any]) -> Layout:
        """The layout a plan leaves, less the on-demand slices it keeps: claims account for
        those, and one unprepared meanwhile is gone."""
        slices = Bag(h.instance for h in self.held.values() if h.on_demand and h.instance)
        kept = Bag(plan_instances(plan["keep"])) - slices - self.released
        return Layout.of(plan["mig_enabled_after"],
                         [*kept.elements(), *plan_instances(plan["create"])])

    # -- restarts --------------------------------------------------------------------------

    def restart(self, mode: str, target: int, delay_s: float, seed: int) -> None:
        """SIGKILL (at rest, in a transition, among claims, or at an NVML call through the
        simulator's CRASH fault), then a restart on the same state directory with requests
        sent from the moment the listener binds."""
        rng = random.Random(seed)
        self.figures.restarts[mode] += 1
        body = self._mig_body(target, rng.choice(POLICIES), 0.5)
        dry = self.send("PUT", f"/v1/gpus/{GPU}/mig?dry_run=true", body)
        planned = dry.body["plan"] if dry is not None and dry.status == 200 else None
        claims = [(self._uid(k[0]), self.claim_body(k, rng)[0]) for k in ("slice", "mig")] \
            if mode in ("mid-claims", "crash-fault") else []
        victim = self.unprepare_uid("held", rng.random()) \
            if mode in ("mid-claims", "crash-fault") and self.held else None
        if mode == "crash-fault":
            self.send("POST", "/v1/sim/faults", {
                "function": rng.choice(_calls(planned)), "error": "CRASH",
                "gpu": self.gpu_uuid, "skip": rng.randrange(2)})
            self.figures.faults_injected += 1
        with ThreadPoolExecutor(max_workers=4) as pool:
            change = pool.submit(self.send, "PUT", f"/v1/gpus/{GPU}/mig", body) \
                if mode in ("mid-transition", "crash-fault") else None
            sent = [(uid, claim, pool.submit(self.send, "PUT", f"/v1/claims/{uid}", claim))
                    for uid, claim in claims]
            gone = pool.submit(self.send, "DELETE", f"/v1/claims/{victim}") if victim else None
            if mode == "crash-fault":
                self._await_exit(3.0)
            else:
                time.sleep(delay_s)
            self.expect_exit = True
            self.agent.stop(signal.SIGKILL)
            if change is not None:
                self._killed_transition(change.result(), planned, body)
            for uid, claim, future in sent:
                self.acknowledge(uid, claim, future.result(), None)
            if victim is not None and gone is not None:
                self.release(victim, gone.result())
        self.note(f"killed ({mode})")
        self.boot()

    def _killed_transition(self, reply: Reply | None, planned: dict[str, Any] | None,
                           body: dict[str, Any]) -> None:
        plan = planned
        if reply is not None and reply.status == 202 and reply.body.get("transition"):
            plan = reply.body["transition"]["plan"]
        elif reply is not None:
            plan = None  # refused: nothing changes
        if plan is not None:
            self.bases.append(self._after(plan))
            self.figures.transitions["killed"] += 1
        self.note(f"geometry {body.get('profiles', body.get('mig_enabled'))} killed: "
                  f"{None if reply is None else reply.status}")

    def _await_exit(self, seconds: float) -> None:
        with contextlib.suppress(AssertionError):  # still running: the caller kills it
            wait_for(lambda: self.agent.proc.poll() is not None, "the agent to exit", seconds,
                     every_s=0.01)

    def boot(self) -> None:
        """Start the agent again and send mutations until it is ready; an agent that dies on
        the way is an ``agent-exit``, and is started again (a bounded number of times, as a
        supervisor would)."""
        for _ in range(BOOTS):
            self.expect_exit = False
            try:
                self.agent = start_agent(self.state, wait_ready=False)
            except AssertionError as err:  # it died before it listened
                self.violate("agent-exit", f"the agent died starting: {_last_error(str(err))}")
                continue
            if self._until_ready():
                self._latency()
                self._resolve_uncertain()
                return
            if self.agent.proc.poll() is None:
                self.violate("ready-gate", f"not ready {READY_BOUND_S:.0f}s after a restart")
                self.agent.stop(signal.SIGKILL)
            else:
                self.violate("agent-exit", f"the agent exited with {self.agent.proc.returncode}"
                             f" before it was ready: {_last_error(self.agent.log())}")
        raise AgentGone(f"the agent did not come back in {BOOTS} starts")

    def _until_ready(self) -> bool:
        rng = random.Random(self.serial)
        started = time.monotonic()
        for _ in range(EARLY_REQUESTS):  # back to back from the moment it listens
            if self.agent.proc.poll() is not None:
                return False
            self._early(rng)
            if self._ready():
                return True

        def settled() -> str | None:
            if self.agent.proc.poll() is not None:
                return "exited"
            return "ready" if self._ready() else None
        try:
            return wait_for(settled, "the agent to be ready",
                            max(0.0, READY_BOUND_S - (time.monotonic() - started))) == "ready"
        except AssertionError:
            return False

    def _ready(self) -> bool:
        try:
            return self.agent.request("GET", "/readyz", token=None).status == 200
        except OSError:
            return False

    def _early(self, rng: random.Random) -> None:
        """One mutation while the agent may not be ready, judged by a /readyz after it."""
        choice = rng.random()
        uid = ""
        body: dict[str, Any] | None = None
        if choice < 0.2 and self.held:
            uid = self.unprepare_uid("held", rng.random())
            method, path = "DELETE", f"/v1/claims/{uid}"
        elif choice < 0.3:
            body = self._mig_body(rng.randrange(len(TARGETS)), "fail", 0)
            method, path = "PUT", f"/v1/gpus/{GPU}/mig"
        else:
            uid = self._uid("e")
            known = [h.uuid for h in self.held.values() if h.kind == "mig"]
            kind = rng.choice(("whole", "slice", "slice", "mig"))
            if kind == "whole":
                body = self.whole_body(rng.choice(NAME_FORMS))
            elif kind == "mig" and known:  # by UUID: a read of the inventory is not needed
                body = {"devices": [{"kind": "gpu", "device": rng.choice(known)}]}
            else:
                body = self.slice_body(rng.choice(SLICE_PROFILES))
            method, path = "PUT", f"/v1/claims/{uid}"
        reply = self.send(method, path, body)
        after = self._ready() if reply is not None else False
        if reply is not None and not after:
            self._judge_early(method, path, reply)
            if 200 <= reply.status < 300:
                self.figures.early_acknowledged += 1
        if method == "DELETE":
            self.release(uid, reply)
        elif uid:
            self.acknowledge(uid, body or {}, reply, None)
        elif reply is not None:
            self.settle_early(reply, body or {})

    def _judge_early(self, method: str, path: str, reply: Reply) -> None:
        """A mutation answered while /readyz (asked after the answer) still said 503."""
        kind = _problem_type(reply)
        if 200 <= reply.status < 300:
            self.violate("ready-gate", f"{method} {path} answered {reply.status} while "
                         "/readyz still answered 503")
        elif reply.status != 503:
            self.violate("ready-gate", f"{method} {path} answered {reply.status} {kind} "
                         "before ready, not 503 not-ready", key=f"{method} {reply.status} {kind}")
        elif kind != "not-ready" or "retry-after" not in reply.headers:
            self.violate("ready-gate", f"{method} {path} answered 503 type {kind!r} "
                         f"Retry-After {reply.headers.get('retry-after')!r} before ready",
                         key=f"503 {kind}")

    def settle_early(self, reply: Reply, body: dict[str, Any]) -> None:
        """An early geometry change: its outcome is known once the agent is ready."""
        transition = reply.body.get("transition") if isinstance(reply.body, dict) else None
        if reply.status == 202 and transition is not None:
            self.bases.append(self._after(transition["plan"]))
            self.figures.transitions["sent before ready"] += 1
            self.note(f"geometry {body.get('profiles', body.get('mig_enabled'))} before "
                      f"ready: transition {transition['id']}")

    def _resolve_uncertain(self) -> None:
        """Prepares and unprepares cut off by the kill: the agent's records say how they
        ended."""
        for uid, body in list(self.uncertain.items()):
            reply = self.send("GET", f"/v1/claims/{uid}")
            self.uncertain.pop(uid)
            if reply is not None and reply.status == 200 and \
                    reply.body["state"] == "prepare_completed":
                self._adopt(uid, body, reply.body)
                self.note(f"claim {uid}, unanswered before the kill, is prepared")
        for held in [h for h in self.held.values() if h.releasing]:
            reply = self.send("GET", f"/v1/claims/{held.uid}")
            if reply is not None and reply.status == 404:
                del self.held[held.uid]
                if held.on_demand and held.instance is not None:
                    self.released[held.instance] += 1
            elif reply is not None and reply.status == 200 and \
                    reply.body["state"] == "prepare_completed":
                held.releasing = False

    # -- invariants ------------------------------------------------------------------------

    def check(self) -> list[Violation]:
        """Every invariant now; the violations found (also counted in the figures)."""
        if self.agent.proc.poll() is not None:
            if not self.expect_exit:
                self.violate("agent-exit", f"the agent exited with {self.agent.proc.returncode}"
                             f": {_last_error(self.agent.log())}")
            self.figures.restarts["after exit"] += 1
            self.boot()
        for transition in self._transitions():
            if not transition["terminal"]:
                self.follow(transition["id"])
        actual, devices = self._hardware()
        claims = self._claims()
        self._one_holder(claims)
        orphans = self._held_devices(claims, actual, devices)
        self._geometry(actual, orphans, self._unmodelled_slices(claims))
        found, self.pending = self.pending, []
        self.released = Bag()
        return found

    def _transitions(self) -> list[dict[str, Any]]:
        reply = self.send("GET", "/v1/transitions")
        return list(reply.body["transitions"]) if reply is not None and reply.status == 200 \
            else []

    def _claims(self) -> dict[str, dict[str, Any]]:
        reply = self.send("GET", "/v1/claims")
        if reply is None or reply.status != 200:
            return {}
        return {c["uid"]: c for c in reply.body["claims"]}

    def _one_holder(self, claims: dict[str, dict[str, Any]]) -> None:
        owners: dict[str, set[str]] = {}
        whole: set[str] = set()
        mig: set[str] = set()
        for uid, claim in claims.items():
            if claim["state"] == "lost":
                continue
            for d in claim["devices"]:
                if d["uuid"] is None:
                    continue
                owners.setdefault(str(d["uuid"]), set()).add(uid)
                (whole if d["kind"] == "gpu" else mig).add(uid)
        for held in self.held.values():
            owners.setdefault(held.uuid, set()).add(held.uid)
            (whole if held.kind == "gpu" else mig).add(held.uid)
        for uuid, uids in sorted(owners.items()):
            if len(uids) > 1:
                self.violate("one-holder", f"{uuid} held by {sorted(uids)}",
                             key=f"{uuid} {sorted(uids)}")
                # The first claim keeps the device in the model; the later ones were wrong
                # answers, and what happens to them next is this one defect again.
                for uid in sorted(uids, key=_serial)[1:]:
                    self.held.pop(uid, None)
        if whole and mig:
            self.violate("one-holder", f"GPU {GPU} is held whole by {sorted(whole)} and its "
                         f"MIG devices by {sorted(mig)}", key=f"{sorted(whole)} {sorted(mig)}")

    def _unmodelled_slices(self, claims: dict[str, dict[str, Any]]) -> Bag:
        """Slices the agent's records hold that the model does not (a claim it resurrected):
        their instances are explained, even if no acknowledged claim holds them."""
        modelled = {h.uid for h in self.held.values() if not h.releasing}
        return Bag(instance for uid, claim in claims.items()
                   if uid not in modelled and claim["state"] != "lost"
                   for d in claim["devices"] if d["on_demand"]
                   and (instance := self._instance(d["device_name"])) is not None)

    def _held_devices(self, claims: dict[str, dict[str, Any]], actual: Layout,
                      devices: dict[str, Instance]) -> Bag:
        """Check every acknowledged claim; the instances of on-demand claims the agent lost
        (a leak, reported here once, then part of the geometry)."""
        orphans = Bag()
        for uid in sorted(self.unprepared & claims.keys()):
            if claims[uid]["state"] == "prepare_completed":
                self.violate("held-device", f"claim {uid}'s unprepare was acknowledged, yet "
                             "the agent has it prepared again", key=uid)
        for held in sorted(self.held.values(), key=lambda h: h.uid):
            record = claims.get(held.uid)
            broken = None
            if held.releasing:
                continue
            if record is None or record["state"] != "prepare_completed":
                broken = (f"acknowledged claim {held.uid} reads "
                          f"{'missing' if record is None else record['state']} "
                          f"{'' if record is None else record.get('lost_reason') or ''}")
            elif held.kind == "mig" and held.uuid not in devices:
                broken = (f"claim {held.uid}'s {held.uuid} ({held.instance}) is gone from "
                          f"NVML; GPU 0 is {actual}")
            elif held.kind == "mig" and held.instance is not None and \
                    devices[held.uuid] != held.instance:
                broken = f"claim {held.uid}'s {held.uuid} moved to {devices[held.uuid]}"
            elif held.kind == "gpu" and actual.mig_on:
                broken = f"GPU {GPU} is claimed whole by {held.uid} and has MIG on: {actual}"
            if broken is not None:
                self.violate("held-device", broken)
                # The model follows the agent from here, so that one defect is counted once.
                if held.kind == "mig" or record is None or record["state"] != \
                        "prepare_completed":
                    del self.held[held.uid]
                    if held.on_demand and held.instance is not None and \
                            devices.get(held.uuid) == held.instance:
                        orphans[held.instance] += 1
                else:
                    held.releasing = True
        return orphans

    def _geometry(self, actual: Layout, orphans: Bag, unmodelled: Bag) -> None:
        """The layout is a candidate base plus held slices; ``orphans`` (slices of claims the
        agent lost) join the base for good, ``unmodelled`` ones (held by claims only the
        agent has) are allowed while they are held."""
        required = Bag(h.instance for h in self.held.values()
                       if h.on_demand and h.instance and not h.releasing)
        optional = Bag(h.instance for h in self.held.values()
                       if h.on_demand and h.instance and h.releasing) + orphans + unmodelled
        base = None if self.anything else matching_base(actual, self.bases, required, optional)
        if base is not None:
            left = Bag(actual.instances) - Bag(base.instances) - required - unmodelled
            base = Layout.of(base.mig_on, (Bag(base.instances) + (left & orphans)).elements())
        else:
            expected = " or ".join(str(b) for b in self.bases)
            if not self.anything:
                self.violate("transition", f"GPU {GPU} is {actual}; expected {expected} plus "
                             f"claimed slices {sorted(required.elements())}")
            releasing = optional - orphans - unmodelled
            base = Layout.of(actual.mig_on, (Bag(actual.instances) - required - unmodelled
                                             - releasing).elements())
        self.bases = [base]
        self.anything = False


# -- the long run ----------------------------------------------------------------------------

ACTIONS: tuple[tuple[str, float], ...] = (
    ("claim_whole", 2), ("claim_mig", 4), ("claim_slice", 4), ("repeat_claim", 1),
    ("unprepare", 4), ("change_geometry", 3), ("concurrently", 3), ("inject_fault", 2),
    ("restart", 1.2))


def random_step(rig: Rig, rng: random.Random, only: frozenset[str] | None = None) -> str:
    """One action (of ``only``, if given) with parameters drawn from ``rng`` (the same tables
    hypothesis draws from)."""
    names, weights = zip(*[(n, w) for n, w in ACTIONS if only is None or n in only],
                         strict=True)
    action = rng.choices(names, weights)[0]
    steps: dict[str, Callable[[], None]] = {
        "claim_whole": lambda: rig.claim_whole(rng.choice(NAME_FORMS)),
        "claim_mig": lambda: rig.claim_mig(rng.random(), rng.choice(NAME_FORMS)),
        "claim_slice": lambda: rig.claim_slice(rng.choice(SLICE_PROFILES)),
        "repeat_claim": lambda: rig.repeat_claim(rng.random()),
        "unprepare": lambda: rig.unprepare(rng.choice(UNPREPARE_KINDS), rng.random()),
        "change_geometry": lambda: rig.change_geometry(
            rng.randrange(len(TARGETS)), rng.choice(POLICIES), rng.choice((0.0, 0.2, 0.5))),
        "concurrently": lambda: rig.concurrently(
            rng.randrange(len(TARGETS)), rng.choice(POLICIES), rng.choice((0.2, 0.5)),
            [(rng.choice(CLAIM_KINDS), rng.randrange(1 << 30))
             for _ in range(rng.randrange(1, 4))],
            rng.uniform(0, 0.08), unblock=rng.random() if rng.random() < 0.4 else None,
            fault=(rng.choice(MUTATING[:2]), rng.randrange(3)) if rng.random() < 0.3 else None),
        "inject_fault": lambda: rig.inject_fault(rng.choice(MUTATING), rng.choice(FAULT_ERRORS),
                                                 rng.randrange(4)),
        "restart": lambda: rig.restart(rng.choice(RESTART_MODES), rng.randrange(len(TARGETS)),
                                       rng.uniform(0, 0.1), rng.randrange(1 << 30)),
    }
    steps[action]()
    return action


def run(cycles: int, seed: int, workdir: Path, *, cycles_per_agent: int = 250,
        only: frozenset[str] | None = None,
        progress: Callable[[Figures], None] | None = None) -> Figures:
    """``cycles`` random steps (of the ``only`` actions, if given), a fresh agent every
    ``cycles_per_agent``; the figures."""
    figures = Figures()
    rng = random.Random(seed)
    started = time.monotonic()
    rig: Rig | None = None
    try:
        for cycle in range(1, cycles + 1):
            if rig is None or (cycle - 1) % cycles_per_agent == 0:
                if rig is not None:
                    rig.close()
                rig = Rig(workdir / f"node{cycle}", figures)
            rig.cycle = cycle
            try:
                figures.actions[random_step(rig, rng, only)] += 1
                rig.check()
            except AgentGone:
                figures.restarts["fresh node (agent gone)"] += 1
                rig.close()
                rig = Rig(workdir / f"node{cycle}-fresh", figures)
            figures.cycles = cycle
            figures.seconds = time.monotonic() - started
            if progress is not None and cycle % 50 == 0:
                progress(figures)
    finally:
        if rig is not None:
            rig.close()
    figures.seconds = time.monotonic() - started
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cycles-per-agent", type=int, default=250)
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="work in DIR and keep it (agent logs, state) for a post-mortem")
    parser.add_argument("--story", action="store_true",
                        help="also print the steps before each invariant's first violation")
    parser.add_argument("--actions", help="only these actions, comma-separated (of: "
                        + ", ".join(name for name, _ in ACTIONS) + ")")
    args = parser.parse_args(argv)
    only = frozenset(args.actions.split(",")) if args.actions else None
    if only is not None and not only <= {name for name, _ in ACTIONS}:
        parser.error(f"--actions: unknown {sorted(only - {name for name, _ in ACTIONS})}")
    def progress(f: Figures) -> None:
        print(f"... cycle {f.cycles}, {f.seconds:.0f}s, violations {dict(f.violations)}",
              flush=True)

    with tempfile.TemporaryDirectory(prefix="one-owner-") as tmp:
        workdir = args.keep or Path(tmp)
        figures = run(args.cycles, args.seed, workdir, cycles_per_agent=args.cycles_per_agent,
                      only=only, progress=progress)
    print(figures.summary())
    if args.story:
        print(figures.story())
    return 1 if figures.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
