"""Compatibility (issue 8 item 5, issue 12 item 6): every format of every file the agent keeps
loads — the formats from before the durable envelope and the envelope itself; files from a
newer agent (higher version, unknown header and payload fields) load; truncated, zeroed and
bit-flipped files are detected, kept aside and reported, never loaded silently. Fixtures:
``tests/data/README.md``."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from agent.claims.checkpoint import CheckpointCorrupt, CheckpointData, ClaimCheckpoint
from agent.dra.generation import PoolGeneration
from agent.durable import DurableMap
from agent.gpu.sim.presets import PRESETS
from agent.gpu.sim.state import HardwareState, SimulatorStateError, StateFile
from agent.mig.journal import JournalEntry, TransitionJournal

DATA = Path(__file__).resolve().parents[1] / "data"


def _checkpoint(path: Path) -> Any:
    cp = ClaimCheckpoint(path, "boot")
    try:
        cp.load()
    except CheckpointCorrupt as err:
        raise Corrupt(str(err)) from err
    return cp.snapshot()["claims"]


def _journal(path: Path) -> Any:
    target = path.parent / "GPU-fixture.json"
    path.rename(target)
    entries, corrupt = TransitionJournal(path.parent).open_entries()
    if corrupt:
        raise Corrupt(corrupt[0].reason)
    assert len(entries) == 1
    return entries[0].model_dump()


def _durable_map(format_name: str, path: Path) -> Any:
    dmap = DurableMap(path, format=format_name)
    if dmap.problem:
        raise Corrupt(dmap.problem)
    assert dmap.items(), "fixture is not empty"
    return dmap.items()


def _pool(path: Path) -> Any:
    pool = PoolGeneration(path)
    if pool.problem:
        raise Corrupt(pool.problem)
    return pool.generation


def _sim_state(path: Path) -> Any:
    try:
        state = StateFile(path).load(PRESETS["dgx-h100"])
    except SimulatorStateError as err:
        raise Corrupt(err.detail) from err
    assert state is not None
    return state.to_json()


class Corrupt(Exception):
    """The loader detected the damage."""


@dataclass(frozen=True)
class Kind:
    name: str
    load: Callable[[Path], Any]
    fixtures: tuple[str, ...]


KINDS = [
    Kind("checkpoint", _checkpoint, ("checkpoints/v1.checkpoint",
                                     "checkpoints/v1-compact.checkpoint",
                                     "checkpoints/v2-newer-fields.checkpoint",
                                     "checkpoints/envelope-v1.checkpoint",
                                     "checkpoints/envelope-v2-newer-fields.checkpoint")),
    Kind("journal", _journal, ("journal/v1.json", "journal/v2-newer-fields.json",
                               "journal/envelope-v1.json",
                               "journal/envelope-v2-newer-fields.json")),
    Kind("mig-desired", partial(_durable_map, "gpu-agent-mig-desired"), (
        "mig/desired-v1-no-checksum.json", "mig/desired-v1.json",
        "mig/desired-v2-newer-fields.json", "mig/desired-envelope-v1.json",
        "mig/desired-envelope-v2-newer-fields.json")),
    Kind("mig-quarantine", partial(_durable_map, "gpu-agent-mig-quarantine"), (
        "mig/quarantine-v1-no-checksum.json", "mig/quarantine-v1.json",
        "mig/quarantine-v2-newer-fields.json", "mig/quarantine-envelope-v1.json",
        "mig/quarantine-envelope-v2-newer-fields.json")),
    Kind("dra-pool", _pool, ("dra/pool-v1.json", "dra/pool-envelope-v1.json",
                             "dra/pool-envelope-v2-newer-fields.json")),
    Kind("sim-state", _sim_state, ("sim/v1-no-checksum.json", "sim/v1.json",
                                   "sim/v1-newer-fields.json", "sim/envelope-v1.json",
                                   "sim/envelope-v2-newer-fields.json")),
]
CASES = [(k, f) for k in KINDS for f in k.fixtures]
IDS = [f for _, f in CASES]


def _copy(tmp_path: Path, fixture: str) -> Path:
    target = tmp_path / Path(fixture).name
    shutil.copy(DATA / fixture, target)
    return target


@pytest.mark.parametrize(("kind", "fixture"), CASES, ids=IDS)
def test_every_version_loads(tmp_path: Path, kind: Kind, fixture: str) -> None:
    assert kind.load(_copy(tmp_path, fixture))


def _truncated(raw: bytes) -> list[bytes]:
    return [raw[: len(raw) // 2], raw[:-3], b""][: 3 if raw else 0]


def _zeroed(raw: bytes) -> list[bytes]:
    half = len(raw) // 2
    return [bytes(len(raw)), raw[:half] + bytes(len(raw) - half)]


def _flipped(raw: bytes) -> list[bytes]:
    out = []
    for frac in (0.1, 0.3, 0.5, 0.7, 0.9):
        pos = int(len(raw) * frac)
        for bit in (0, 3, 6):
            out.append(raw[:pos] + bytes([raw[pos] ^ (1 << bit)]) + raw[pos + 1:])
    return out


DAMAGE = {"truncated": _truncated, "zeroed": _zeroed, "bit-flipped": _flipped}


# Files written before the checksum existed cannot show a bit flip (the next write adds the
# checksum), so they are checked for truncation and zeroing only.
DAMAGE_CASES = [pytest.param(kind, fixture, damage, id=f"{case_id}-{damage}")
                for (kind, fixture), case_id in zip(CASES, IDS, strict=True)
                for damage in DAMAGE
                if not (damage == "bit-flipped" and "no-checksum" in fixture)]


@pytest.mark.parametrize(("kind", "fixture", "damage"), DAMAGE_CASES)
def test_damage_is_detected_and_kept_aside(tmp_path: Path, kind: Kind, fixture: str,
                                           damage: str) -> None:
    raw = (DATA / fixture).read_bytes()
    (tmp_path / "intact").mkdir()
    intact = kind.load(_copy(tmp_path / "intact", fixture))
    for i, bad in enumerate(DAMAGE[damage](raw)):
        if bad == raw:
            continue
        case = tmp_path / str(i)
        case.mkdir()
        path = case / Path(fixture).name
        path.write_bytes(bad)
        try:
            loaded = kind.load(path)
        except Corrupt as err:
            assert str(err), "reported with a reason"
            kept = [p for p in case.iterdir() if ".corrupt-" in p.name]
            assert len(kept) == 1, f"damaged file not kept aside: {list(case.iterdir())}"
            assert kept[0].read_bytes() == bad
            continue
        # A flip that left the content intact (in whitespace or a key the checksum does not
        # need) may load, but only as exactly the original data: never silently different.
        assert damage == "bit-flipped" and loaded == intact, f"case {i} loaded silently"


async def _writers(directory: Path) -> dict[str, Path]:
    """Each kind of state file as this agent writes it."""
    written = {}
    cp = ClaimCheckpoint(directory / "claims.checkpoint", "boot")
    await cp.commit()
    written["gpu-agent-claims-checkpoint"] = cp.path
    journal = TransitionJournal(directory / "journal")
    doc = json.loads((DATA / "journal/v1.json").read_text())
    journal.write(JournalEntry.model_validate(doc["entry"]))
    written["gpu-agent-mig-journal"] = next(journal.directory.glob("*.json"))
    for name in ("desired", "quarantine"):
        dmap = DurableMap(directory / f"{name}.json", format=f"gpu-agent-mig-{name}")
        await dmap.set("GPU-x", {"reason": "test", "since": 1.0})
        written[f"gpu-agent-mig-{name}"] = dmap.path
    await PoolGeneration(directory / "pool.json").for_content("x")
    written["gpu-agent-dra-pool"] = directory / "pool.json"
    StateFile(directory / "hardware.json").save(HardwareState.new(PRESETS["dgx-h100"]))
    written["gpu-agent-sim-hardware"] = directory / "hardware.json"
    return written


def _header(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_bytes().partition(b"\n")[0]))


async def test_every_state_file_is_written_in_one_envelope(tmp_path: Path) -> None:
    """Every writer writes the same envelope: a header line naming its own format, a version
    and the SHA-256 of the payload bytes that follow, then a JSON payload."""
    for name, path in (await _writers(tmp_path)).items():
        raw = path.read_bytes()
        header, payload = _header(path), raw.partition(b"\n")[2]
        assert header["format"] == name and header["version"] == 1, name
        assert header["sha256"] == hashlib.sha256(payload).hexdigest(), name
        json.loads(payload)


async def test_todays_checkpoint_reader_reads_the_new_checkpoint(tmp_path: Path) -> None:
    """Downgrade: the reader of agents before the envelope (header ``format`` equal to the
    magic, ``sha256`` over the payload, the payload a CheckpointData; nothing else looked at)
    accepts a checkpoint written now."""
    path = (await _writers(tmp_path))["gpu-agent-claims-checkpoint"]
    header_line, _, payload = path.read_bytes().partition(b"\n")
    header = json.loads(header_line)
    assert header["format"] == "gpu-agent-claims-checkpoint"
    assert header["sha256"] == hashlib.sha256(payload).hexdigest()
    assert CheckpointData.model_validate_json(payload).boot_id == "boot"


ENVELOPE_TWINS = [(k, f.replace("envelope-", ""), f) for k in KINDS for f in k.fixtures
                  if "envelope-v1" in f and (DATA / f.replace("envelope-", "")).exists()]


@pytest.mark.parametrize(("kind", "legacy", "envelope"), ENVELOPE_TWINS,
                         ids=[e for _, _, e in ENVELOPE_TWINS])
def test_envelope_fixture_holds_what_its_legacy_twin_holds(tmp_path: Path, kind: Kind,
                                                           legacy: str, envelope: str) -> None:
    """An upgrade changes the format, never the content: the same records either way."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert kind.load(_copy(tmp_path / "a", legacy)) == kind.load(_copy(tmp_path / "b", envelope))
