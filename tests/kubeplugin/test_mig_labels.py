"""mig-manager's node labels, the pure part: what the plugin does for a Node's labels, the
ConfigMap's content and what it last carried through; which state an agent's answer ends in;
and which flag combinations start."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest

from agent.kubeplugin.miglabels import (
    Apply,
    ConfigSource,
    Fail,
    Handled,
    Idle,
    Outcome,
    State,
    apply_outcome,
    config_map_ref,
    decide,
    dry_run_outcome,
    settings_problem,
)
from tests.kubeplugin.conftest import write_private

TEXT = "version: v1\nmig-configs:\n  all-disabled:\n    - devices: all\n      mig-enabled: false\n"
CONFIG = ConfigSource(TEXT)
EDITED = ConfigSource(TEXT + "  all-enabled:\n    - devices: all\n      mig-enabled: true\n")
MISSING = ConfigSource(None, "ConfigMap gpu-operator/default-mig-parted-config not found")
DONE = Handled("all-disabled", CONFIG.digest)



class Case(NamedTuple):
    """(label, state, config, handled) -> the kind of action, and its label when not Idle."""

    name: str
    label: str | None
    state: str | None
    config: ConfigSource
    handled: Handled | None
    kind: type
    applied: str


DECISIONS = [Case(*row) for row in [
    ("no label: nothing, whatever the state", None, "success", CONFIG, None, Idle, ""),
    ("empty label: nothing", "", None, CONFIG, DONE, Idle, ""),
    ("a label at start-up is applied (a no-op when already there)", "all-disabled",
     "success", CONFIG, None, Apply, "all-disabled"),
    ("a label just set is applied", "all-disabled", None, CONFIG, None, Apply,
     "all-disabled"),
    ("the label handled under this config: nothing", "all-disabled", "success", CONFIG, DONE,
     Idle, ""),
    ("handled and failed: nothing until something changes", "all-disabled", "failed", CONFIG,
     DONE, Idle, ""),
    ("a changed label is applied", "all-enabled", "success", EDITED,
     Handled("all-disabled", EDITED.digest), Apply, "all-enabled"),
    ("an edited ConfigMap applies the same label again", "all-disabled", "success", EDITED,
     DONE, Apply, "all-disabled"),
    ("the state label removed: applied again (the retry)", "all-disabled", None, CONFIG, DONE,
     Apply, "all-disabled"),
    ("no ConfigMap: failed without the agent", "all-disabled", None, MISSING, None, Fail,
     "all-disabled"),
    ("no ConfigMap, already reported: nothing", "all-disabled", "failed", MISSING,
     Handled("all-disabled", MISSING.digest), Idle, ""),
    ("the ConfigMap comes back: applied", "all-disabled", "failed", CONFIG,
     Handled("all-disabled", MISSING.digest), Apply, "all-disabled"),
]]


@pytest.mark.parametrize("case", DECISIONS, ids=[case.name for case in DECISIONS])
def test_decide(case: Case) -> None:
    """decide() applies a label when the label, the ConfigMap's content or the presence of the
    state label changed since it was last carried through, fails without a ConfigMap, and
    otherwise does nothing."""
    action = decide(label=case.label, state=case.state, config=case.config,
                    handled=case.handled)
    assert isinstance(action, case.kind), (case.name, action)
    if isinstance(action, Apply | Fail):
        assert action.label == case.applied
        assert action.handled == Handled(case.applied, case.config.digest)
    if isinstance(action, Apply):
        assert action.config == case.config.text


def _row(state: str, index: int = 0, **fields: Any) -> dict[str, Any]:
    return {"index": index, "state": state, "blockers": [], "error": None, **fields}


DRY_RUNS: list[tuple[str, dict[str, Any], Outcome | None]] = [
    ("every GPU unchanged: success without pending",
     {"transitions": [_row("unchanged"), _row("unchanged", 1)]},
     Outcome(State.SUCCESS, "already applied")),
    ("a node without MIG: success, saying what was skipped",
     {"transitions": [], "skipped": [{"index": 0}, {"index": 1}]},
     Outcome(State.SUCCESS, "already applied (2 GPU(s) without MIG skipped)")),
    ("something planned: the apply runs", {"transitions": [_row("unchanged"),
                                                           _row("planned", 1)]}, None),
    ("in use: failed, naming the holder",
     {"transitions": [_row("planned", 3, blockers=[{"instance": "1g.10gb@0:1",
                                                   "kind": "claim", "id": "uid-1"}])]},
     Outcome(State.FAILED, "instances the change destroys are in use: GPU 3: 1g.10gb@0:1 in "
             "use by claim uid-1")),
]


@pytest.mark.parametrize(("case", "answer", "expected"), DRY_RUNS,
                         ids=[row[0] for row in DRY_RUNS])
def test_dry_run_outcome(case: str, answer: dict[str, Any], expected: Outcome | None) -> None:
    """A dry run decides the state when nothing would change or something blocks it."""
    assert dry_run_outcome(answer) == expected


APPLIES: list[tuple[str, dict[str, Any], State | None, str]] = [
    ("running: no state yet", {"state": "running", "transitions": [_row("applying")]}, None,
     ""),
    ("succeeded", {"state": "succeeded", "transitions": [_row("succeeded"),
                                                         _row("unchanged", 1)]},
     State.SUCCESS, "applied to 1 GPU(s)"),
    ("partial is failed, naming the GPU and its error",
     {"apply_id": "a1", "state": "partial",
      "transitions": [_row("succeeded"), _row("rolled_back", 1, error="IN_USE")]},
     State.FAILED, "apply a1 ended partial: GPU 1: rolled_back: IN_USE"),
    ("an Ampere mode pending a reset is failed, never rebooting",
     {"apply_id": "a2", "state": "failed", "transitions": [_row("pending_reset")]},
     State.FAILED, "apply a2 ended failed: GPU 0: pending_reset: pending_reset"),
]


@pytest.mark.parametrize(("case", "answer", "state", "reason"), APPLIES,
                         ids=[row[0] for row in APPLIES])
def test_apply_outcome(case: str, answer: dict[str, Any], state: State | None,
                       reason: str) -> None:
    """An apply's answer ends in success only when it succeeded; partial and failed are
    failed with each failing GPU named; nothing is decided while it runs."""
    outcome = apply_outcome(answer)
    if state is None:
        assert outcome is None
    else:
        assert outcome == Outcome(state, reason)


@pytest.mark.parametrize(("text", "ok"), [
    ("gpu-operator/default-mig-parted-config", True), ("default-mig-parted-config", False),
    ("/name", False), ("ns/", False), ("a/b/c", False)])
def test_config_map_ref(text: str, ok: bool) -> None:
    """--mig-config-map is NAMESPACE/NAME and nothing else."""
    if ok:
        assert config_map_ref(text) == tuple(text.split("/"))
    else:
        with pytest.raises(ValueError, match="NAMESPACE/NAME"):
            config_map_ref(text)


def test_flags_need_each_other(tmp_path: Path) -> None:
    """The mode starts only with both --mig-config-map and a private --mig-token-file; with
    neither it is off."""
    token = tmp_path / "mig.token"
    write_private(token, "miglabels:secret:geometry\n")
    assert settings_problem(None, None) is None
    assert settings_problem("ns/cm", token) is None
    assert "needs --mig-token-file" in (settings_problem("ns/cm", None) or "")
    assert "needs --mig-config-map" in (settings_problem(None, token) or "")
    token.chmod(0o644)
    assert "group or others" in (settings_problem("ns/cm", token) or "")
