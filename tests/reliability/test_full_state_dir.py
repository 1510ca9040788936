"""A full state directory still lets the agent start (issue 12, item 5), on a real full
filesystem: a small tmpfs mounted as the state directory and filled to ENOSPC. Reads that need
no reconciliation are served, writes answer 507 ``insufficient-storage`` with nothing changed,
and when recovery itself needs a write, ``/readyz`` says so until space returns."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.claims.checkpoint import decode, encode
from agent.durable import write_atomic
from tests.agent_process import AgentProcess, Reply, start_agent
from tests.waiting import wait_for

READS = ["/v1/gpus", "/v1/topology", "/metrics", "/v1/events"]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs as the state directory (CI runs as root, where mounting works)."""
    mount = tmp_path / "state"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs",
                           str(mount)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"cannot mount a tmpfs in CI: {done.stderr}")
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    with filler.open("wb") as out:
        for _ in range(10_000):  # far more than 2 MiB in 64 KiB blocks
            try:
                out.write(bytes(65536))
                out.flush()
            except OSError:
                break
    with pytest.raises(OSError), (directory / "probe").open("wb") as probe:
        probe.write(bytes(65536))
        probe.flush()
    return filler


def _restart_on_full_disk(first: AgentProcess) -> AgentProcess:
    """Start again with the same arguments; listeners.json cannot be written, so it is
    reached on its Unix socket."""
    log_path = first.state_dir.parent / "full.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(first.args, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    agent = AgentProcess(proc, first.state_dir, log_path, token=first.token, args=first.args)
    def listening() -> bool:
        try:
            if agent.request("GET", "/healthz", unix=True).status == 200:
                return True
        except OSError:
            pass  # not yet: unless it exited
        assert proc.poll() is None, f"agent exited with {proc.returncode}:\n{agent.log()}"
        return False
    try:
        wait_for(listening, "the agent to listen", 30, every_s=0.05)
    except AssertionError:
        agent.stop(signal.SIGKILL)
        raise
    return agent


def _readyz_until(agent: AgentProcess, status: int, timeout: float = 45) -> Reply:
    def answered() -> Reply | None:
        reply = agent.request("GET", "/readyz", unix=True, token=None)
        return reply if reply.status == status else None
    found: Reply = wait_for(answered, f"/readyz to answer {status}", timeout, every_s=0.1)
    return found


def _prepared_agent(state: Path, tmp_path: Path) -> AgentProcess:
    agent = start_agent(state, extra=["--cdi-dir", str(tmp_path / "cdi")])
    body = {"devices": [{"kind": "gpu", "device": "0"}]}
    assert agent.request("PUT", "/v1/claims/c1", body).status == 200
    agent.stop()
    return agent


def test_agent_on_a_full_state_dir_serves_reads_and_refuses_writes_with_507(
        small_disk: Path, tmp_path: Path) -> None:
    """Nothing to recover: the agent starts and is ready; reads answer 200; every mutation
    answers 507 insufficient-storage and changes nothing."""
    first = _prepared_agent(small_disk, tmp_path)
    _fill(small_disk)
    agent = _restart_on_full_disk(first)
    try:
        _readyz_until(agent, 200)
        for path in READS:
            assert agent.request("GET", path, unix=True).status == 200, path
        for method, path, body in (
                ("PUT", "/v1/claims/c2", {"devices": [{"kind": "gpu", "device": "2"}]}),
                ("DELETE", "/v1/claims/c1", None)):
            refused = agent.request(method, path, body, unix=True)
            assert refused.status == 507, (method, path, refused.body)
            assert refused.body["type"].endswith("/insufficient-storage")
            assert "ENOSPC" in refused.body["detail"]
        claims = agent.request("GET", "/v1/claims", unix=True).body["claims"]
        assert [c["uid"] for c in claims] == ["c1"]
        assert "listeners.json not written" in agent.log()
        assert "Traceback" not in agent.log()
    finally:
        agent.stop()


def test_recovery_that_needs_a_write_waits_for_space_and_says_why(
        small_disk: Path, tmp_path: Path) -> None:
    """A half-done prepare must be rolled back (a checkpoint write): on a full disk the agent
    stays up, serves reads, /readyz says which write recovery waits for, and once space
    returns it recovers and becomes ready."""
    first = _prepared_agent(small_disk, tmp_path)
    path = small_disk / "claims.checkpoint"
    data = decode(path.read_bytes())
    data.claims["c1"].state = "prepare_started"  # as a crash mid-prepare leaves it
    write_atomic(path, encode(data), mode=0o600)
    filler = _fill(small_disk)
    agent = _restart_on_full_disk(first)
    try:
        def waits_for_space() -> Reply | None:
            reply = agent.request("GET", "/readyz", unix=True, token=None)
            return reply if "cannot make" in str(reply.body) else None
        ready = wait_for(waits_for_space, "/readyz to say which write recovery waits for", 30,
                         every_s=0.1)
        assert ready.status == 503
        assert "recovery needs a write it cannot make" in ready.body["reason"]
        assert "ENOSPC" in ready.body["reason"]
        for read in READS:
            assert agent.request("GET", read, unix=True).status == 200, read
        filler.unlink()
        _readyz_until(agent, 200)
        assert agent.request("GET", "/v1/claims", unix=True).body["claims"] == []
        assert agent.proc.poll() is None and "Traceback" not in agent.log()
    finally:
        agent.stop()
