"""Compatibility (issue 8, item 5): every schema version of every file the agent keeps loads;
files from a newer agent with extra fields load; truncated, zeroed and bit-flipped files are
detected, kept aside and reported, never loaded silently. Fixtures: ``tests/data/README.md``."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.claims.checkpoint import CheckpointCorrupt, ClaimCheckpoint
from agent.durable import DurableMap
from agent.gpu.sim.presets import PRESETS
from agent.gpu.sim.state import SimulatorStateError, StateFile
from agent.mig.journal import TransitionJournal

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


def _durable_map(path: Path) -> Any:
    dmap = DurableMap(path)
    if dmap.problem:
        raise Corrupt(dmap.problem)
    assert dmap.items(), "fixture is not empty"
    return dmap.items()


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
                                     "checkpoints/v2-newer-fields.checkpoint")),
    Kind("journal", _journal, ("journal/v1.json", "journal/v2-newer-fields.json")),
    Kind("mig-desired", _durable_map, ("mig/desired-v1-no-checksum.json", "mig/desired-v1.json",
                                       "mig/desired-v2-newer-fields.json")),
    Kind("mig-quarantine", _durable_map, ("mig/quarantine-v1-no-checksum.json",
                                          "mig/quarantine-v1.json",
                                          "mig/quarantine-v2-newer-fields.json")),
    Kind("sim-state", _sim_state, ("sim/v1-no-checksum.json", "sim/v1.json",
                                   "sim/v1-newer-fields.json")),
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
