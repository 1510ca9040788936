"""What the MPS host agrees to run for IMEX: the configured ``nvidia-imex`` only, with a config
and a hosts file spelled below its ``--imex-root`` without ``..``; everything else refused with
the field at fault. And how the two files are opened: one component at a time, never through
a symlink, regular files only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.mpshost import directories
from agent.mpshost.imex import ImexPolicy
from agent.mpshost.policy import Malformed, Refused

BINARY = Path("/driver/usr/bin/nvidia-imex")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    imex = tmp_path / "imex"
    imex.mkdir()
    for name in ("config.cfg", "hosts", "nodes_config.cfg"):
        (imex / name).write_text("x\n")
    (imex / "sub").mkdir()
    (imex / "sub" / "config.cfg").write_text("x\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "config.cfg").write_text("x\n")
    (imex / "escape").symlink_to(tmp_path / "outside")
    (imex / "linked.cfg").symlink_to(imex / "config.cfg")
    (imex / "dir.cfg").mkdir()
    os.mkfifo(imex / "fifo.cfg")
    return imex


def _policy(root: Path) -> ImexPolicy:
    return ImexPolicy(imex=BINARY, imex_root=root)


def test_an_allowed_start_names_the_binary_and_both_files_as_the_agent_spelled_them(
        root: Path) -> None:
    """The plan keeps the agent's spelling of the config (the agent finds its daemon by
    ``-c <config>``) and names both files by their components below the resolved root."""
    plan = _policy(root).check(str(BINARY), str(root / "config.cfg"), str(root / "hosts"))
    assert (plan.imex, plan.config, plan.hosts) == (
        str(BINARY), str(root / "config.cfg"), str(root / "hosts"))
    assert (plan.root, plan.config_parts, plan.hosts_parts) == (
        root.resolve(), ("config.cfg",), ("hosts",))


def test_a_root_configured_through_a_symlink_takes_either_spelling(
        root: Path, tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(root)
    policy = ImexPolicy(imex=BINARY, imex_root=tmp_path / "link")
    for spelled in (tmp_path / "link", root.resolve()):
        plan = policy.check(str(BINARY), str(spelled / "sub/config.cfg"), str(spelled / "hosts"))
        assert plan.config == str(spelled / "sub/config.cfg")
        assert (plan.root, plan.config_parts) == (root.resolve(), ("sub", "config.cfg"))


@pytest.mark.parametrize(("request_", "field", "why"), [
    (("/bin/sh", "ROOT/config.cfg", "ROOT/hosts"), "imex", "only"),
    (("/driver/usr/bin/nvidia-imex-ctl", "ROOT/config.cfg", "ROOT/hosts"), "imex", "only"),
    (("/driver/usr/bin/../bin/nvidia-imex", "ROOT/config.cfg", "ROOT/hosts"), "imex", "only"),
    ((["/driver/usr/bin/nvidia-imex"], "ROOT/config.cfg", "ROOT/hosts"), "imex", "a string"),
    ((None, "ROOT/config.cfg", "ROOT/hosts"), "imex", "a string"),
    ((str(BINARY), None, "ROOT/hosts"), "config", "a string"),
    ((str(BINARY), "ROOT/config.cfg", 7), "hosts", "a string"),
    ((str(BINARY), "ROOT/../config.cfg", "ROOT/hosts"), "config", "'..'"),
    ((str(BINARY), "ROOT/sub/../config.cfg", "ROOT/hosts"), "config", "'..'"),
    ((str(BINARY), "ROOT/config.cfg", "ROOT/sub/../../x/hosts"), "hosts", "'..'"),
    ((str(BINARY), "config.cfg", "ROOT/hosts"), "config", "absolute, normalized"),
    ((str(BINARY), "ROOT//config.cfg", "ROOT/hosts"), "config", "absolute, normalized"),
    ((str(BINARY), "ROOT/./config.cfg", "ROOT/hosts"), "config", "absolute, normalized"),
    ((str(BINARY), "ROOT/config.cfg/", "ROOT/hosts"), "config", "absolute, normalized"),
    ((str(BINARY), "/etc/nvidia-imex/config.cfg", "ROOT/hosts"), "config", "not under"),
    ((str(BINARY), "ROOT/config.cfg", "/etc/hosts"), "hosts", "not under"),
    ((str(BINARY), "ROOT", "ROOT/hosts"), "config", "not under"),
    ((str(BINARY), "ROOTx/config.cfg", "ROOT/hosts"), "config", "not under"),
    ((str(BINARY), "ROOT/config.cfg\0", "ROOT/hosts"), "config", "NUL"),
    ((str(BINARY), "ROOT/" + "c" * 5000, "ROOT/hosts"), "config", "too long"),
    ((str(BINARY), "ROOT/hosts", "ROOT/hosts"), "hosts", "not be the config"),
])
def test_anything_else_is_refused_naming_the_field(
        root: Path, request_: tuple[object, object, object], field: str, why: str) -> None:
    """Each row: (imex, config, hosts) as received, the field at fault, part of the reason."""
    def spelled(value: object) -> object:
        return value.replace("ROOT", str(root)) if isinstance(value, str) else value
    with pytest.raises(Refused) as refused:
        _policy(root).check(*(spelled(value) for value in request_))
    assert refused.value.field == field
    assert why in refused.value.reason
    assert type(refused.value) is Refused


@pytest.mark.parametrize(("config", "why"), [
    ("ROOT/\udcff.cfg", "Unicode"),
    ("ROOT/" + "n" * 256 + "/config.cfg", "over 255 bytes"),
])
def test_a_path_that_is_no_path_is_a_bad_request(root: Path, config: str, why: str) -> None:
    with pytest.raises(Malformed) as refused:
        _policy(root).check(str(BINARY), config.replace("ROOT", str(root)), str(root / "hosts"))
    assert (refused.value.field, refused.value.kind) == ("config", "bad-request")
    assert why in refused.value.reason


def test_a_host_without_imex_refuses_every_imex_start(root: Path) -> None:
    for policy in (ImexPolicy(), ImexPolicy(imex=None, imex_root=root)):
        with pytest.raises(Refused) as refused:
            policy.check(str(BINARY), str(root / "config.cfg"), str(root / "hosts"))
        assert refused.value.field == "imex" and "--imex" in refused.value.reason
    assert ImexPolicy().describe() == {"imex": None, "imex_root": None}
    assert _policy(root).describe() == {"imex": str(BINARY), "imex_root": str(root)}


def test_the_files_are_opened_as_the_very_regular_files_below_the_root(root: Path) -> None:
    plan = _policy(root).check(str(BINARY), str(root / "sub/config.cfg"), str(root / "hosts"))
    with directories.opened_files(plan) as opened:
        assert os.path.samestat(os.fstat(opened.config), os.stat(root / "sub/config.cfg"))
        assert os.path.samestat(os.fstat(opened.hosts), os.stat(root / "hosts"))
    for fd in (opened.config, opened.hosts):
        with pytest.raises(OSError):
            os.fstat(fd)  # closed on leaving


@pytest.mark.parametrize(("config", "why"), [
    ("escape/config.cfg", "symlink"),
    ("linked.cfg", "symlink"),
    ("missing.cfg", "does not exist"),
    ("sub/missing/config.cfg", "does not exist"),
    ("hosts/config.cfg", "not a directory"),
    ("dir.cfg", "not a regular file"),
    ("fifo.cfg", "not a regular file"),
])
def test_a_symlink_or_anything_but_a_regular_file_is_refused_when_opened(
        root: Path, config: str, why: str) -> None:
    """A symlink anywhere below the root is refused, even one that leads back inside; so is
    a missing file, a directory and a FIFO (which is never opened for reading, so never
    waited on)."""
    plan = _policy(root).check(str(BINARY), str(root / config), str(root / "hosts"))
    with pytest.raises(Refused) as refused, directories.opened_files(plan):
        pass
    assert refused.value.field == "config"
    assert why in refused.value.reason


def test_the_hosts_file_is_checked_the_same_way(root: Path) -> None:
    plan = _policy(root).check(str(BINARY), str(root / "config.cfg"), str(root / "linked.cfg"))
    with pytest.raises(Refused) as refused, directories.opened_files(plan):
        pass
    assert refused.value.field == "hosts" and "symlink" in refused.value.reason
