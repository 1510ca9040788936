"""A state path of the wrong type (issue 12, item 5) is the documented "unreadable" case, never
a traceback: it is kept aside where it can be renamed, and the caller gets exactly the problem
it gets for a corrupt file (``CheckpointCorrupt``, ``DurableMap.problem``, a corrupt journal
entry, ``SimulatorStateError``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.claims.checkpoint import CheckpointCorrupt, ClaimCheckpoint
from agent.dra.generation import PoolGeneration
from agent.durable import DurableMap
from agent.mig.journal import ALL_GPUS, TransitionJournal
from tests.agent_process import start_agent
from tests.integration.owner_steps import wait_readyz
from tests.service_node import open_services


def _kept(path: Path) -> list[Path]:
    return list(path.parent.glob(f"{path.name}.corrupt-*"))


def test_checkpoint_path_that_is_a_directory_is_corrupt_and_kept_aside(tmp_path: Path) -> None:
    path = tmp_path / "claims.checkpoint"
    (path / "junk").mkdir(parents=True)
    with pytest.raises(CheckpointCorrupt) as info:
        ClaimCheckpoint(path, "boot").load()
    assert "directory" in info.value.reason
    assert info.value.kept_at in _kept(path) and (info.value.kept_at / "junk").is_dir()
    assert ClaimCheckpoint(path, "boot").load() is None  # the path is free again


@pytest.mark.parametrize("name", ["quarantine.json", "desired.json"])
def test_durable_map_path_that_is_a_directory_is_a_problem(tmp_path: Path, name: str) -> None:
    path = tmp_path / "mig" / name
    path.mkdir(parents=True)
    store = DurableMap(path, format=f"gpu-agent-mig-{path.stem}")
    assert store.problem is not None and "directory" in store.problem
    assert store.items() == [] and len(_kept(path)) == 1


def test_pool_path_that_is_a_directory_restarts_above_any_earlier_generation(
        tmp_path: Path) -> None:
    path = tmp_path / "dra" / "pool.json"
    path.mkdir(parents=True)
    pool = PoolGeneration(path)
    assert pool.problem is not None and "directory" in pool.problem
    assert pool.generation >= int(time.time()) - 5


def test_journal_directory_that_is_a_file_is_one_corrupt_entry_for_every_gpu(
        tmp_path: Path) -> None:
    directory = tmp_path / "mig" / "journal"
    directory.parent.mkdir(parents=True)
    directory.write_bytes(b"not a directory")
    entries, corrupt = TransitionJournal(directory).open_entries()
    assert entries == [] and [c.gpu for c in corrupt] == [ALL_GPUS]
    assert corrupt[0].kept_at.read_bytes() == b"not a directory"
    assert "not a directory" in corrupt[0].reason
    assert TransitionJournal(directory).open_entries() == ([], [])  # moved out of the way


async def test_unreadable_journal_directory_quarantines_every_mig_capable_gpu(
        tmp_path: Path) -> None:
    """Which GPU had a transition in flight can no longer be known: all fail closed."""
    journal = tmp_path / "state" / "mig" / "journal"
    journal.parent.mkdir(parents=True)
    journal.write_bytes(b"")
    node = await open_services(tmp_path)  # start-up resolves the journal
    try:
        gpus = node.inventory.gpus
        assert len(gpus) == 8
        assert all("journal" in (node.mig.quarantined(g.uuid) or "") for g in gpus)
    finally:
        await node.close()


def test_agent_starts_when_the_checkpoint_path_is_a_directory(tmp_path: Path) -> None:
    """A real agent with a directory at claims.checkpoint starts (no traceback exit), keeps
    the directory aside, and says in /readyz that the checkpoint is unreadable."""
    state = tmp_path / "state"
    (state / "claims.checkpoint" / "junk").mkdir(parents=True)
    agent = start_agent(state, wait_ready=False)
    try:
        ready = wait_readyz(agent, "unreadable", 30)
        assert ready.status == 503 and "directory" in ready.body["reason"], ready.body
        assert agent.request("GET", "/v1/gpus", token=None).status == 200
        assert len(_kept(state / "claims.checkpoint")) == 1
        assert agent.proc.poll() is None
        assert "Traceback" not in agent.log()
    finally:
        agent.stop()
