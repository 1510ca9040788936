"""What the MPS host agrees to run: the configured binary with ``-d``, three MPS variables,
directories spelled below its root; everything else refused with the field at fault. And how
those directories are opened: one component at a time, never through a symlink."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.mpshost import directories
from agent.mpshost.policy import SYSTEM_PATH, LaunchPolicy, Malformed, Refused

BINARY = Path("/driver/usr/bin/nvidia-cuda-mps-control")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    mps = tmp_path / "mps"
    for sub in ("a/pipe", "a/log", "a/shm", "b/pipe", "b/log"):
        (mps / sub).mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (mps / "escape").symlink_to(tmp_path / "outside")
    return mps


def _env(root: Path, **changes: str | None) -> dict[str, str]:
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(root / "a/pipe"),
           "CUDA_MPS_LOG_DIRECTORY": str(root / "a/log")}
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value.replace("ROOT", str(root))
    return env


def test_an_allowed_launch_runs_the_binary_with_the_host_s_path_and_library_path(
        root: Path) -> None:
    """The plan runs ``<binary> -d`` with the three MPS variables (spelled from the resolved
    root), the host's PATH (the binary's directory first) instead of the caller's, and the
    host's library path; the directories are named by their components below the root."""
    policy = LaunchPolicy(mps_control=BINARY, mps_root=root, library_path="/driver/lib64")
    plan = policy.check([str(BINARY), "-d"], _env(
        root, CUDA_VISIBLE_DEVICES="GPU-1a2b,MIG-3c4d", PATH="/evil"))
    assert plan.argv == (str(BINARY), "-d")
    assert dict(plan.env) == {
        "CUDA_MPS_PIPE_DIRECTORY": str(root.resolve() / "a/pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(root.resolve() / "a/log"),
        "CUDA_VISIBLE_DEVICES": "GPU-1a2b,MIG-3c4d",
        "PATH": f"/driver/usr/bin:{SYSTEM_PATH}", "LD_LIBRARY_PATH": "/driver/lib64"}
    assert (plan.root, plan.pipe, plan.log, plan.shm) == (
        root.resolve(), ("a", "pipe"), ("a", "log"), ("a", "shm"))
    assert plan.private_shm is False


def test_a_root_configured_through_a_symlink_takes_either_spelling(
        root: Path, tmp_path: Path) -> None:
    """The agent spells paths from the same --mps-root as the host: through a symlinked root
    they are accepted, and the daemon gets them spelled from the resolved root."""
    (tmp_path / "link").symlink_to(root)
    policy = LaunchPolicy(mps_control=BINARY, mps_root=tmp_path / "link", private_shm=True)
    for spelled in (tmp_path / "link", root):
        plan = policy.check([str(BINARY), "-d"], {
            "CUDA_MPS_PIPE_DIRECTORY": str(spelled / "a/pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(spelled / "a/log")})
        assert plan.env["CUDA_MPS_PIPE_DIRECTORY"] == str(root.resolve() / "a/pipe")
        assert (plan.pipe, plan.shm, plan.private_shm) == (("a", "pipe"), ("a", "shm"), True)


@pytest.mark.parametrize(("argv", "env", "field", "why"), [
    (["/bin/sh", "-d"], {}, "argv", "only"),
    ([str(BINARY)], {}, "argv", "only"),
    ([str(BINARY), "-d", "-f"], {}, "argv", "only"),
    ([str(BINARY), "-f"], {}, "argv", "only"),
    ("nvidia-cuda-mps-control -d", {}, "argv", "list of strings"),
    ([str(BINARY), 1], {}, "argv", "list of strings"),
    ([str(BINARY), "-d"], {"LD_PRELOAD": "/tmp/x.so"}, "env.LD_PRELOAD", "not allowed"),
    ([str(BINARY), "-d"], {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "1"},
     "env.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "not allowed"),
    ([str(BINARY), "-d"], {"CUDA_MPS_PIPE_DIRECTORY": None}, "env.CUDA_MPS_PIPE_DIRECTORY",
     "missing"),
    ([str(BINARY), "-d"], {"CUDA_MPS_LOG_DIRECTORY": "/var/log"}, "env.CUDA_MPS_LOG_DIRECTORY",
     "not under the MPS root"),
    ([str(BINARY), "-d"], {"CUDA_MPS_PIPE_DIRECTORY": "ROOT"}, "env.CUDA_MPS_PIPE_DIRECTORY",
     "not under the MPS root"),
    ([str(BINARY), "-d"], {"CUDA_MPS_PIPE_DIRECTORY": "ROOT/a/../../x"},
     "env.CUDA_MPS_PIPE_DIRECTORY", "normalized"),
    ([str(BINARY), "-d"], {"CUDA_MPS_PIPE_DIRECTORY": "a/pipe"},
     "env.CUDA_MPS_PIPE_DIRECTORY", "absolute"),
    ([str(BINARY), "-d"], {"CUDA_MPS_PIPE_DIRECTORY": "ROOTx/a/pipe"},
     "env.CUDA_MPS_PIPE_DIRECTORY", "not under the MPS root"),
    ([str(BINARY), "-d"], {"CUDA_MPS_LOG_DIRECTORY": "ROOT/a/pipe"},
     "env.CUDA_MPS_LOG_DIRECTORY", "neither be the pipe directory"),
    ([str(BINARY), "-d"], {"CUDA_MPS_LOG_DIRECTORY": "ROOT/a/pipe/log"},
     "env.CUDA_MPS_LOG_DIRECTORY", "inside it"),
    ([str(BINARY), "-d"], {"CUDA_MPS_LOG_DIRECTORY": "ROOT/a"},
     "env.CUDA_MPS_LOG_DIRECTORY", "contain it"),
    ([str(BINARY), "-d"], {"CUDA_VISIBLE_DEVICES": "GPU-1;rm -rf /"},
     "env.CUDA_VISIBLE_DEVICES", "device UUIDs"),
    ([str(BINARY), "-d"], {"CUDA_VISIBLE_DEVICES": ""}, "env.CUDA_VISIBLE_DEVICES",
     "device UUIDs"),
    ([str(BINARY), "-d"], {"PATH": "/bin\0/x"}, "env.PATH", "NUL"),
], ids=lambda v: v if isinstance(v, str) and v.startswith(("env", "argv")) else None)
def test_everything_else_is_refused_naming_the_field(
        root: Path, argv: object, env: dict[str, str | None], field: str, why: str) -> None:
    """A launch outside the policy is refused; the refusal names the field and the reason."""
    policy = LaunchPolicy(mps_control=BINARY, mps_root=root)
    with pytest.raises(Refused) as refused:
        policy.check(argv, _env(root, **env))
    assert refused.value.field == field
    assert why in refused.value.reason


@pytest.mark.parametrize(("env", "field"), [
    ({"CUDA_MPS_PIPE_DIRECTORY": "ROOT/a/\ud800"}, "env.CUDA_MPS_PIPE_DIRECTORY"),
    ({"CUDA_MPS_LOG_DIRECTORY": "ROOT/a/" + "x" * 256}, "env.CUDA_MPS_LOG_DIRECTORY"),
    ({"PATH": "/bin:\udcff"}, "env.PATH"),
    ({"\ud800": "x"}, "env.\\ud800"),
], ids=["surrogate-pipe", "long-name", "surrogate-path", "surrogate-key"])
def test_what_is_no_text_or_no_file_name_is_malformed(
        root: Path, env: dict[str, str], field: str) -> None:
    """A value that is not text (a lone surrogate) or a component longer than a file name
    can be is Malformed (answered bad-request), naming the field."""
    policy = LaunchPolicy(mps_control=BINARY, mps_root=root)
    with pytest.raises(Malformed) as malformed:
        policy.check([str(BINARY), "-d"], _env(root, **env))
    assert (malformed.value.field, malformed.value.kind) == (field, "bad-request")


def _opened(root: Path, *, private_shm: bool = False, **env: str | None) -> object:
    policy = LaunchPolicy(mps_control=BINARY, mps_root=root, private_shm=private_shm)
    plan = policy.check([str(BINARY), "-d"], _env(root, **env))
    with directories.opened(plan) as opened:
        return {name: os.fstat(fd).st_ino if fd is not None else None
                for name, fd in vars(opened).items()}


def test_the_directories_opened_are_the_ones_named(root: Path) -> None:
    """Pipe, log and (when there) shm are opened as the directories the paths name."""
    assert _opened(root) == {"pipe": (root / "a/pipe").stat().st_ino,
                             "log": (root / "a/log").stat().st_ino,
                             "shm": (root / "a/shm").stat().st_ino}
    # Without --private-shm a missing shm directory is no reason to refuse (it is opened
    # only for its label).
    assert _opened(root, CUDA_MPS_PIPE_DIRECTORY="ROOT/b/pipe",
                   CUDA_MPS_LOG_DIRECTORY="ROOT/b/log")["shm"] is None  # type: ignore[index]


@pytest.mark.parametrize(("setup", "env", "field", "why"), [
    (None, {"CUDA_MPS_PIPE_DIRECTORY": "ROOT/escape/pipe"}, "env.CUDA_MPS_PIPE_DIRECTORY",
     "escape is a symlink"),
    (lambda r: (r / "alias").symlink_to(r / "a"), {"CUDA_MPS_LOG_DIRECTORY": "ROOT/alias/log"},
     "env.CUDA_MPS_LOG_DIRECTORY", "alias is a symlink"),
    (lambda r: (r / "b/link").symlink_to(r / "a/pipe"), {"CUDA_MPS_PIPE_DIRECTORY": "ROOT/b/link"},
     "env.CUDA_MPS_PIPE_DIRECTORY", "link is a symlink"),
    (lambda r: (r / "b/file").write_text(""), {"CUDA_MPS_LOG_DIRECTORY": "ROOT/b/file"},
     "env.CUDA_MPS_LOG_DIRECTORY", "not a directory"),
    (None, {"CUDA_MPS_PIPE_DIRECTORY": "ROOT/c/pipe"}, "env.CUDA_MPS_PIPE_DIRECTORY",
     "c does not exist"),
], ids=["symlink-out", "symlink-within", "symlink-leaf", "file", "missing"])
def test_a_symlink_anywhere_below_the_root_is_refused_not_followed(
        root: Path, setup: object, env: dict[str, str], field: str, why: str) -> None:
    """Each component is opened relative to its parent without following a symlink: a link
    below the root is refused even when it leads back inside, as are files and missing
    directories, naming the variable."""
    if callable(setup):
        setup(root)
    with pytest.raises(Refused) as refused:
        _opened(root, **env)
    assert (refused.value.field, refused.value.kind) == (field, "refused")
    assert why in refused.value.reason


def test_private_shm_needs_the_shm_directory_beside_the_pipe_directory(root: Path) -> None:
    """With --private-shm a daemon whose ``<root>/<id>/shm`` is missing (or a symlink) is
    refused rather than started with the host's own /dev/shm, which its clients would not
    share."""
    (root / "b/shm").symlink_to(root / "a/shm")
    with pytest.raises(Refused) as refused:
        _opened(root, private_shm=True, CUDA_MPS_PIPE_DIRECTORY="ROOT/b/pipe",
                CUDA_MPS_LOG_DIRECTORY="ROOT/b/log")
    assert refused.value.field == "env.CUDA_MPS_PIPE_DIRECTORY"
    assert "shm is a symlink" in refused.value.reason and "--private-shm" in refused.value.reason
