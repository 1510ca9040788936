"""What the MPS host agrees to run: the configured binary with ``-d``, three MPS variables,
directories under its root; everything else refused with the field at fault."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.mpshost.policy import SYSTEM_PATH, LaunchPolicy, Refused

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
    """The plan runs ``<binary> -d`` with the three MPS variables (directories resolved), the
    host's PATH (the binary's directory first) instead of the caller's, and the host's library
    path."""
    policy = LaunchPolicy(mps_control=BINARY, mps_root=root, library_path="/driver/lib64")
    plan = policy.check([str(BINARY), "-d"], _env(
        root, CUDA_VISIBLE_DEVICES="GPU-1a2b,MIG-3c4d", PATH="/evil"))
    assert plan.argv == (str(BINARY), "-d")
    assert dict(plan.env) == {
        "CUDA_MPS_PIPE_DIRECTORY": str((root / "a/pipe").resolve()),
        "CUDA_MPS_LOG_DIRECTORY": str((root / "a/log").resolve()),
        "CUDA_VISIBLE_DEVICES": "GPU-1a2b,MIG-3c4d",
        "PATH": f"/driver/usr/bin:{SYSTEM_PATH}", "LD_LIBRARY_PATH": "/driver/lib64"}
    assert plan.shm is None


def test_private_shm_wraps_the_start_in_a_mount_namespace_with_the_claim_s_shm(
        root: Path) -> None:
    """With --private-shm the start runs under unshare with ``<root>/<id>/shm`` bound at
    /dev/shm, passed as arguments (never spliced into the shell text)."""
    policy = LaunchPolicy(mps_control=BINARY, mps_root=root, private_shm=True,
                          unshare="/usr/bin/unshare", mount="/usr/bin/mount")
    plan = policy.check([str(BINARY), "-d"], _env(root))
    assert plan.shm == (root / "a/shm").resolve()
    assert plan.argv[:5] == ("/usr/bin/unshare", "--mount", "--propagation", "private", "--")
    assert plan.argv[-3:] == (str(plan.shm), str(BINARY), "/usr/bin/mount")
    assert str(root) not in plan.argv[7]


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
    ([str(BINARY), "-d"], {"CUDA_MPS_PIPE_DIRECTORY": "ROOT/escape"},
     "env.CUDA_MPS_PIPE_DIRECTORY", "not under the MPS root"),
    ([str(BINARY), "-d"], {"CUDA_MPS_PIPE_DIRECTORY": "ROOT/c/pipe"},
     "env.CUDA_MPS_PIPE_DIRECTORY", "not a directory"),
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


def test_private_shm_needs_the_shm_directory_beside_the_pipe_directory(root: Path) -> None:
    """With --private-shm a daemon whose ``<root>/<id>/shm`` is missing is refused rather
    than started with the host's own /dev/shm, which its clients would not share."""
    policy = LaunchPolicy(mps_control=BINARY, mps_root=root, private_shm=True)
    with pytest.raises(Refused) as refused:
        policy.check([str(BINARY), "-d"], _env(
            root, CUDA_MPS_PIPE_DIRECTORY="ROOT/b/pipe", CUDA_MPS_LOG_DIRECTORY="ROOT/b/log"))
    assert refused.value.field == "env.CUDA_MPS_PIPE_DIRECTORY"
    assert "shm" in refused.value.reason


def test_a_symlink_inside_the_root_is_resolved_for_the_daemon(root: Path) -> None:
    """A pipe directory reached through a symlink that stays below the root is accepted, and
    the daemon gets the resolved directory, so a link swapped after the check redirects
    nothing."""
    (root / "alias").symlink_to(root / "a")
    policy = LaunchPolicy(mps_control=BINARY, mps_root=root)
    plan = policy.check([str(BINARY), "-d"], _env(root, CUDA_MPS_PIPE_DIRECTORY="ROOT/alias/pipe"))
    assert plan.env["CUDA_MPS_PIPE_DIRECTORY"] == str((root / "a/pipe").resolve())
