"""Issue 12, measured defect 5 (damaged state fails open or silently), against real agent
processes: unreadable quarantine or claims state freezes what it guards until an operator
acts, a lost GPU does not keep the node unready, and a full state directory still serves
reads."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.gpu.sim.node import SimulatedNode
from tests.agent_process import AgentProcess, Reply, start_agent
from tests.from_bind import Background, Call, unix_request
from tests.integration.owner_steps import (
    claims,
    gpu_request,
    prepare,
    problem,
    set_geometry,
    slice_request,
    wait_readyz,
    wait_transition,
)
from tests.waiting import wait_for

CLAIM_SPECS = "k8s.gpu.nodeagent.dev-claim_*.json"


def _claims_frozen(agent: AgentProcess, uid: str) -> list[str]:
    """What breaks 'claims are frozen as for a corrupt checkpoint' (empty when frozen)."""
    found = []
    for method, path, body in (("GET", "/v1/claims", None), ("GET", f"/v1/claims/{uid}", None),
                               ("PUT", "/v1/claims/thief", {"devices": [gpu_request("2")]}),
                               ("DELETE", f"/v1/claims/{uid}", None)):
        reply = agent.request(method, path, body)
        if reply.status != 503 or problem(reply) != "checkpoint-corrupt":
            found.append(f"{method} {path}: {reply.status} {problem(reply)} "
                         f"{str(reply.body)[:160]}")
    return found


def test_corrupt_quarantine_file_quarantines_every_mig_gpu(tmp_path: Path) -> None:
    """Defect 5 (a corrupt quarantine.json lifts the quarantine): at start-up every
    MIG-capable GPU is quarantined, geometry changes and MIG claims are 409 naming the
    quarantine, the node is ready, and an operator clears each GPU."""
    state = tmp_path / "state"
    agent = start_agent(state)
    try:
        set_geometry(agent, "0", {"profiles": ["3g.40gb"]})
        agent.request("POST", "/v1/sim/faults", {
            "function": "nvmlDeviceCreateGpuInstanceWithPlacement",
            "error": "NVML_ERROR_UNKNOWN", "times": 100})
        reply = agent.request("PUT", "/v1/gpus/0/mig", {"profiles": ["7g.80gb"]})
        assert wait_transition(agent, reply.headers["location"])["state"] == "failed"
    finally:
        agent.stop()
    quarantine = state / "mig" / "quarantine.json"
    assert quarantine.exists()
    quarantine.write_bytes(quarantine.read_bytes()[:7])  # torn
    again = start_agent(state)  # ready: damaged quarantine state does not hold the node back
    try:
        failures = []
        for gpu in range(8):
            change = again.request("PUT", f"/v1/gpus/{gpu}/mig", {"profiles": ["1g.10gb"]})
            if change.status != 409 or "quarantine" not in change.body.get("detail", ""):
                failures.append(f"PUT /v1/gpus/{gpu}/mig: {change.status} {change.body}")
        sliced = prepare(again, "slice", slice_request(gpu="0"))
        if sliced.status != 409 or "quarantine" not in sliced.body.get("detail", ""):
            failures.append(f"slice on GPU 0: {sliced.status} {sliced.body}")
        assert not failures, "\n".join(failures)
        cleared = again.request("POST", "/v1/admin/gpus/1/clear-quarantine")
        assert cleared.status == 200, cleared.body
        assert again.request("PUT", "/v1/gpus/1/mig", {"profiles": ["1g.10gb"]}).status == 202
        still = again.request("PUT", "/v1/gpus/2/mig", {"profiles": ["1g.10gb"]})
        assert still.status == 409 and "quarantine" in still.body["detail"]
    finally:
        again.stop(signal.SIGKILL)


@pytest.mark.parametrize("evidence", ["claim CDI specs", "on-demand instance on the hardware"])
def test_deleted_checkpoint_with_evidence_of_claims_freezes_claims(tmp_path: Path,
                                                                   evidence: str) -> None:
    """Defect 5 (a deleted checkpoint starts with 0 claims, deletes the claims' CDI specs and
    hands their GPUs out again): with evidence of claims left, claims are frozen (503
    checkpoint-corrupt), no spec is deleted, /readyz says why, and accept-empty unfreezes."""
    state = tmp_path / "state"
    agent = start_agent(state)
    try:
        set_geometry(agent, "6", {"profiles": []})
        assert prepare(agent, "whole", gpu_request("gpu-2")).status == 200
        assert prepare(agent, "slice", slice_request(gpu="6")).status == 200
    finally:
        agent.stop(signal.SIGKILL)
    (state / "claims.checkpoint").unlink()
    specs = sorted((state / "cdi").glob(CLAIM_SPECS))
    assert len(specs) == 2
    if evidence != "claim CDI specs":
        for spec in specs:
            spec.unlink()
    again = start_agent(state, wait_ready=False)
    try:
        ready = wait_readyz(again, "checkpoint")
        assert ready.status == 503 and "checkpoint" in ready.body.get("reason", ""), ready.body
        failures = _claims_frozen(again, "whole")
        assert not failures, "\n".join(failures)
        if evidence == "claim CDI specs":
            assert sorted((state / "cdi").glob(CLAIM_SPECS)) == specs
        accepted = again.request("POST", "/v1/admin/claims-checkpoint",
                                 {"action": "accept-empty"})
        assert accepted.status == 200, accepted.body
        assert again.request("GET", "/v1/claims", token=None).status == 200
    finally:
        again.stop(signal.SIGKILL)


def test_corrupt_checkpoint_claim_reads_are_503(tmp_path: Path) -> None:
    """Defect 5 (with a corrupt checkpoint GET /v1/claims is 200 with an empty list and
    GET /v1/claims/{uid} 404): claim reads are 503 checkpoint-corrupt, like the mutations."""
    state = tmp_path / "state"
    agent = start_agent(state)
    try:
        assert prepare(agent, "c1", gpu_request("0")).status == 200
    finally:
        agent.stop()
    path = state / "claims.checkpoint"
    path.write_bytes(path.read_bytes()[:-20])  # torn
    again = start_agent(state, wait_ready=False)
    try:
        assert "checkpoint" in (wait_readyz(again, "checkpoint").body.get("reason") or "")
        failures = _claims_frozen(again, "c1")
        assert not failures, "\n".join(failures)
    finally:
        again.stop(signal.SIGKILL)


def test_lost_gpu_under_a_slice_claim_does_not_keep_the_node_unready(tmp_path: Path) -> None:
    """Defect 5 (a GPU lost while a slice claim holds it keeps the restarted agent unready
    forever, while prepares on other GPUs are accepted): with a prepared and a half-made
    slice on a GPU lost while the agent was down, the node becomes ready with that GPU
    unavailable and both claims reported, and nothing is acknowledged before ready."""
    state = tmp_path / "state"
    agent = start_agent(state)
    try:
        set_geometry(agent, "6", {"profiles": []})
        assert prepare(agent, "held", slice_request(gpu="6")).status == 200
        assert prepare(agent, "whole", gpu_request("1")).status == 200
        uuid = agent.request("GET", "/v1/gpus/6", token=None).body["uuid"]
        # The next slice dies between its GPU instance and its compute instance.
        agent.request("POST", "/v1/sim/faults", {
            "function": "nvmlGpuInstanceCreateComputeInstance", "error": "CRASH", "gpu": uuid})
        with contextlib.suppress(OSError):
            prepare(agent, "half", slice_request(gpu="6"))
        assert agent.proc.wait(30) == -signal.SIGKILL
        token = agent.token
    finally:
        agent.stop(signal.SIGKILL)
    with SimulatedNode("dgx-h100", state, state / "proc") as node:
        node.inject_xid(uuid, 79)  # fallen off the bus while the agent was down
    calls = [Call("PUT", f"/v1/claims/early-{n}", {"devices": [gpu_request(str(n))]})
             for n in (0, 3, 4)]
    client = Background(state / "agent.sock", token, calls, timeout=20)
    again = start_agent(state, wait_ready=False)
    try:
        result = client.join()
        assert result.violations() == []
        assert result.died is None, f"{result.died}; /readyz: " \
            f"{again.request('GET', '/readyz', token=None).body}"
        gpu = again.request("GET", "/v1/gpus/6", token=None).body
        assert (gpu.get("availability") or {}).get("state") == "unavailable", gpu
        for uid in ("held", "half"):
            reported = again.request("GET", f"/v1/claims/{uid}", token=None)
            assert reported.status == 200, (uid, reported.body)
        assert claims(again)["whole"]["state"] == "prepare_completed"
        assert prepare(again, "after", gpu_request("5")).status == 200
    finally:
        again.stop(signal.SIGKILL)


def test_checkpoint_path_that_is_a_directory_freezes_claims(tmp_path: Path) -> None:
    """Defect 5 (a checkpoint path that is a directory exits with a raw traceback): the agent
    starts, claims are frozen as for a corrupt checkpoint, and the detail names the path as
    unreadable."""
    state = tmp_path / "state"
    (state / "claims.checkpoint").mkdir(parents=True)
    agent = start_agent(state, wait_ready=False)
    try:
        ready = wait_readyz(agent, "checkpoint")  # answered: the agent did not exit
        assert ready.status == 503, ready.body
        failures = _claims_frozen(agent, "c1")
        assert not failures, "\n".join(failures)
        detail = agent.request("GET", "/v1/claims", token=None).body["detail"]
        assert "claims.checkpoint" in detail and "unreadable" in detail, detail
        assert "Traceback" not in agent.log()
    finally:
        agent.stop(signal.SIGKILL)


@contextlib.contextmanager
def _small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        message = f"cannot mount a tmpfs here: {mounted.stderr.strip()}"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI must run this as root, or in a mount namespace)")
        pytest.skip(message)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(directory: Path) -> None:
    chunk = b"\0" * 65536
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, chunk)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 512)
    finally:
        os.close(fd)
    probe = directory / "probe"
    try:
        probe.write_bytes(b"x" * 4096)
    except OSError as err:
        assert err.errno == errno.ENOSPC
    else:
        raise AssertionError("the state directory is not full")


def test_full_state_directory_still_serves_reads(tmp_path: Path) -> None:
    """Defect 5 (with the state directory full the agent cannot start even to serve reads):
    it starts, inventory, topology, metrics and events answer 200, mutations answer 507
    insufficient-storage, and /readyz says why when it is not ready."""
    state = tmp_path / "state"
    # Only the state directory is full: the CDI directory and the simulator's proc root are
    # elsewhere, as /var/run/cdi and /proc are on a real node.
    elsewhere = ["--cdi-dir", str(tmp_path / "cdi"), "--proc-root", str(tmp_path / "proc")]
    with _small_tmpfs(state, "16m"):
        agent = start_agent(state, extra=elsewhere)
        try:
            assert prepare(agent, "c1", gpu_request("0")).status == 200
            token = agent.token
        finally:
            agent.stop()
        _fill(state)
        sock = state / "agent.sock"  # a socket takes an inode, no blocks: it binds when full
        log = (tmp_path / "full.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "serve", "--state-dir", str(state),
             "--listen", f"unix:{sock}", "--simulate", "dgx-h100", *elsewhere],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            def serves_inventory() -> bool:
                assert proc.poll() is None, (tmp_path / "full.log").read_text()[-3000:]
                try:
                    return unix_request(sock, "GET", "/v1/gpus", token=token).status == 200
                except OSError:
                    return False  # not listening yet
            wait_for(serves_inventory, "the inventory to be served", 20, every_s=0.1)
            for path in ("/v1/gpus", "/v1/topology", "/metrics", "/v1/events"):
                # Topology is discovered after the inventory is served (503 "not discovered
                # yet" until then); the full disk must not keep any of them from answering.
                wait_for(lambda path=path: unix_request(sock, "GET", path,
                                                        token=token).status == 200,
                         f"{path} to answer 200 with the state directory full", 20,
                         every_s=0.1)
            # Until recovery has met the full disk it is only "not ready" (503); from then on
            # a mutation names the cause (507).
            def past_not_ready() -> Reply | None:
                refused = unix_request(sock, "PUT", "/v1/claims/c2",
                                       {"devices": [gpu_request("3")]}, token=token)
                if refused.status != 503:
                    return refused
                assert problem(refused) == "not-ready", refused.body
                return None
            refused = wait_for(past_not_ready, "recovery to meet the full disk", 20,
                               every_s=0.1)
            assert refused.status == 507, refused.body
            assert problem(refused) == "insufficient-storage"
            ready = unix_request(sock, "GET", "/readyz")
            assert ready.status == 200 or ready.body.get("reason"), ready.body
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            log.close()
