"""Issue 12, measured defect 1 (served before recovery), against real agent processes: a
restarted agent answers every mutation and every read of reconciled state sent from the moment
its socket binds with 503 ``not-ready`` until it is ready, and recovery keeps what was
acknowledged before the restart."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.agent_process import AgentProcess, start_agent
from tests.from_bind import Background, Call, FromBind, unix_request
from tests.integration.owner_steps import (
    MUTATING,
    RECOVERY_LATENCY,
    assert_claims_intact,
    claims,
    gpu_request,
    layout,
    mig_devices,
    prepare,
    set_geometry,
    settled_transitions,
    slice_request,
)

BALANCED = ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
OLD, TARGET = ["7g.80gb@0:8"], ["1g.10gb@2:1", "1g.10gb@3:1", "2g.20gb@0:2", "3g.40gb@4:4"]
NEW = {"profiles": ["1g.10gb"] * 7}


def prepared_node(state: Path) -> tuple[str, dict[str, dict[str, Any]]]:
    """A node with three prepared claims (whole GPU 2, the 3g MIG device of GPU 5, a slice on
    GPU 6), killed with SIGKILL: its token and the claims as the API showed them."""
    agent = start_agent(state)
    try:
        set_geometry(agent, "5", {"profiles": ["3g.40gb"]})
        set_geometry(agent, "6", {"profiles": []})
        mig = mig_devices(agent, "5")[0]["uuid"]
        for uid, device in (("whole", gpu_request("gpu-2")), ("mig", gpu_request(mig)),
                            ("slice", slice_request(gpu="6"))):
            assert prepare(agent, uid, device).status == 200, uid
        assert agent.token is not None
        return agent.token, claims(agent)
    finally:
        agent.stop(signal.SIGKILL)


def restart_from_bind(state: Path, token: str,
                      calls: list[Call] | Callable[[int], Call]) -> tuple[AgentProcess, FromBind]:
    """Restart the agent on ``state`` while a client sends ``calls`` from the socket's first
    accept until ready; the first thing it sends makes NVML slow, so recovery takes a while
    (under the readiness gate that may be refused; recovery is then just fast)."""
    sock = state / "agent.sock"

    def slow_nvml() -> None:
        unix_request(sock, "PUT", "/v1/sim/latency", RECOVERY_LATENCY, token=token)

    client = Background(sock, token, calls, on_first_accept=slow_nvml)
    agent = start_agent(state, wait_ready=False)
    result = client.join()
    assert result.died is None, f"{result.died}\n{agent.log()[-3000:]}"
    agent.wait_ready()
    agent.request("PUT", "/v1/sim/latency", {})
    return agent, result


def _claim_calls(mig_uuid: str) -> Callable[[int], Call]:
    """Prepares of held and free devices, an unprepare, claim and CDI reads, a dry run."""
    def nth(n: int) -> Call:
        uid = f"early-{n}"
        return [
            Call("PUT", f"/v1/claims/{uid}", {"devices": [gpu_request("gpu-2")]}),
            Call("PUT", f"/v1/claims/{uid}", {"devices": [gpu_request(mig_uuid)]}),
            Call("PUT", f"/v1/claims/{uid}", {"devices": [slice_request(gpu="6")]}),
            Call("PUT", f"/v1/claims/{uid}", {"devices": [gpu_request("0")]}),
            Call("GET", "/v1/claims"),
            Call("DELETE", f"/v1/claims/{uid}-gone"),
            Call("GET", "/v1/cdi"),
            Call("PUT", "/v1/gpus/3/mig?dry_run=true", {"profiles": ["7g.80gb"]}),
        ][n % 8]
    return nth


def _prepares_from_bind(tmp_path: Path, restarts: int) -> None:
    """``restarts`` restarts in which requests were answered before ready. A restart whose
    recovery finished before the first request (the client slows NVML only once the socket
    accepts, and a loaded machine may run the agent first) is checked all the same, and
    another one is made in its stead, up to three times as many as asked."""
    state = tmp_path / "state"
    token, before = prepared_node(state)
    mig_uuid = before["mig"]["devices"][0]["uuid"]
    exercised = made = 0
    while exercised < restarts:
        assert made < 3 * restarts, \
            f"only {exercised} of {made} restarts had a request answered before ready"
        made += 1
        agent, result = restart_from_bind(state, token, _claim_calls(mig_uuid))
        try:
            exercised += bool(result.early())
            assert result.violations() == []
            assert_claims_intact(agent, before)
            before = claims(agent)
        finally:
            agent.stop(signal.SIGKILL)


def test_prepares_sent_from_bind_are_not_acknowledged_before_ready(tmp_path: Path) -> None:
    """Defect 1 (prepares acknowledged before /readyz, then dropped by reconciliation): every
    claim request answered before ready is 503 not-ready and every earlier claim survives."""
    _prepares_from_bind(tmp_path, restarts=3)


@pytest.mark.slow
def test_prepares_sent_from_bind_over_twenty_restarts(tmp_path: Path) -> None:
    """Defect 1 as measured (13 of 20 restarts acknowledged early): over 20 restarts nothing
    is acknowledged before ready and every earlier claim survives."""
    _prepares_from_bind(tmp_path, restarts=20)


def test_early_prepares_with_slice_claims_do_not_crash_the_agent(tmp_path: Path) -> None:
    """Defect 1 (slice claims in the checkpoint plus early prepares crash the agent with
    'dictionary changed size during iteration'): the agent stays up, becomes ready, answers
    early requests 503 not-ready and keeps every slice claim."""
    state = tmp_path / "state"
    agent = start_agent(state)
    try:
        for gpu in ("6", "7"):
            set_geometry(agent, gpu, {"profiles": []})
        for n, gpu in enumerate(("6", "6", "6", "7", "7")):
            assert prepare(agent, f"slice-{n}", slice_request(gpu=gpu)).status == 200
        token, before = agent.token, claims(agent)
        assert token is not None
    finally:
        agent.stop(signal.SIGKILL)

    def nth(n: int) -> Call:
        uid = f"early-{n}"
        if n % 3 == 2:
            return Call("DELETE", f"/v1/claims/slice-{n % 5}")
        pinned = {"gpu": ("6", "7")[n % 2]} if n % 3 else {}
        return Call("PUT", f"/v1/claims/{uid}",
                    {"devices": [{"kind": "slice", "profile": "1g.10gb", **pinned}]})

    for _ in range(3):
        again, result = restart_from_bind(state, token, nth)
        try:
            assert again.proc.poll() is None
            assert "RuntimeError" not in again.log()
            assert result.violations() == []
            after = claims(again)
            # An unprepare answered after ready may legitimately remove its claim.
            deleted = {a.call.path.rsplit("/", 1)[1] for a in result.acknowledged("DELETE")}
            assert_claims_intact(again, {u: c for u, c in before.items() if u not in deleted})
            before = after
        finally:
            again.stop(signal.SIGKILL)


def _crash_mid_transition(state: Path) -> str:
    """Take GPU 0 to 7g.80gb, then kill the agent (the simulator's CRASH fault) at the second
    GPU-instance create of the change to the balanced layout: an open journal entry."""
    agent = start_agent(state)
    try:
        set_geometry(agent, "0", {"profiles": ["7g.80gb"]})
        agent.request("PUT", "/v1/sim/latency", dict.fromkeys(MUTATING, 0.02))
        uuid = agent.request("GET", "/v1/gpus/0", token=None).body["uuid"]
        agent.request("POST", "/v1/sim/faults", {
            "function": "nvmlDeviceCreateGpuInstanceWithPlacement", "error": "CRASH",
            "gpu": uuid, "skip": 1})
        assert agent.request("PUT", "/v1/gpus/0/mig", {"profiles": BALANCED}).status == 202
        assert agent.proc.wait(30) == -signal.SIGKILL
        assert list((state / "mig" / "journal").glob("*.json")), "no open journal entry"
        assert agent.token is not None
        return agent.token
    finally:
        agent.stop(signal.SIGKILL)


_GEOMETRY_CALLS = [Call("PUT", "/v1/gpus/0/mig", NEW), Call("GET", "/v1/gpus/0/mig"),
                   Call("GET", "/v1/transitions")]


def _geometry_from_bind(tmp_path: Path, restarts: int) -> None:
    state = tmp_path / "state"
    for _ in range(restarts):
        token = _crash_mid_transition(state)
        agent, result = restart_from_bind(state, token, _GEOMETRY_CALLS)
        try:
            violations = result.violations()
            accepted = [a for a in result.answers if a.call.method == "PUT" and a.status == 202]
            transitions = settled_transitions(agent)
            assert all(t["terminal"] for t in transitions), transitions
            now = layout(agent, "0")
            allowed = [OLD, TARGET] + ([sorted(["1g.10gb@" + f"{i}:1" for i in range(7)])]
                                       if accepted else [])
            assert now in allowed, f"GPU 0 shows {now}; allowed {allowed}"
            assert violations == []
            assert not list((state / "mig" / "journal").glob("*.json"))
        finally:
            agent.stop(signal.SIGKILL)


def test_geometry_puts_from_bind_wait_for_journal_recovery(tmp_path: Path) -> None:
    """Defect 1 (geometry PUTs before ready run concurrently with journal recovery and leave
    a layout that is neither old, target nor new): PUTs answered before ready are 503
    not-ready, and after ready the layout is the old or the interrupted target one."""
    _geometry_from_bind(tmp_path, restarts=2)


@pytest.mark.slow
def test_geometry_puts_from_bind_over_twenty_restarts(tmp_path: Path) -> None:
    """Defect 1 as measured (5 of 20 restarts ended in a mixed layout): over 20 restarts with
    an open journal entry, no early PUT is served and the layout is always old or target."""
    _geometry_from_bind(tmp_path, restarts=20)


def test_reads_of_reconciled_state_wait_for_ready(tmp_path: Path) -> None:
    """Defect 1 (the API serves before recovery): claims, CDI, geometry, transitions and
    ResourceSlices read from bind are 503 not-ready until ready; inventory reads are served."""
    state = tmp_path / "state"
    token, _ = prepared_node(state)
    reads = [Call("GET", p) for p in ("/v1/claims", "/v1/claims/whole", "/v1/cdi",
                                      "/v1/gpus/5/mig", "/v1/transitions",
                                      "/v1/resourceslices", "/v1/gpus", "/healthz")]
    reads.append(Call("POST", "/v1/topology/select", {"count": 2}))
    agent, result = restart_from_bind(state, token, reads)
    try:
        assert result.violations() == []
        served = {a.call.path for a in result.answers if a.before_ready and a.status == 200}
        assert "/healthz" in served
    finally:
        agent.stop(signal.SIGKILL)
