"""What a daemon started by the MPS host sees of the filesystem: its own directories at their
paths, nothing else under the MPS root, and never a directory other than the one the host
opened (agent/mpshost/confine.py run as the host runs it, as a real process)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from agent.mpshost import confine, directories
from agent.mpshost.policy import LaunchPolicy

BINARY = Path("/bin/sh")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    mps = tmp_path / "mps"
    for sub in ("a/pipe", "a/log", "a/shm", "other/pipe"):
        (mps / sub).mkdir(parents=True)
    (mps / "other/pipe/secret").write_text("another claim's")
    (tmp_path / "outside/a/pipe").mkdir(parents=True)
    return mps


def _confined(root: Path, script: str, *, private_shm: bool = False,
              before: object = None) -> subprocess.CompletedProcess[str]:
    """``/bin/sh -c script`` started as the host starts a daemon for ``<root>/a``; ``before``
    runs between the host's opening and the start."""
    policy = LaunchPolicy(mps_control=BINARY, mps_root=root, private_shm=private_shm)
    plan = policy.check([str(BINARY), "-d"], {"CUDA_MPS_PIPE_DIRECTORY": str(root / "a/pipe"),
                                              "CUDA_MPS_LOG_DIRECTORY": str(root / "a/log")})
    with directories.opened(plan) as opened:
        bound = [confine.Bound(plan.pipe, opened.pipe, plan.env["CUDA_MPS_PIPE_DIRECTORY"]),
                 confine.Bound(plan.log, opened.log, plan.env["CUDA_MPS_LOG_DIRECTORY"])]
        if private_shm:
            assert opened.shm is not None
            bound.append(confine.Bound(plan.shm, opened.shm, "/dev/shm"))
        if callable(before):
            before()
        argv = confine.command(root=str(plan.root), bound=bound,
                               argv=["/bin/sh", "-c", script, str(plan.root)], env={})
        return subprocess.run(argv, env={}, pass_fds=[b.fd for b in bound],
                              capture_output=True, text=True, timeout=60, check=False)


def test_the_daemon_sees_only_its_own_directories_under_the_root(root: Path) -> None:
    """Under the root the daemon finds only the path to its own pipe and log directories
    (another claim's are not there), what it writes lands in the real directories, and it
    holds no descriptor to the real tree."""
    done = _confined(root, 'ls -A "$0"; ls -A "$0/a"; echo hi > "$0/a/pipe/written"; '
                           'echo log > "$0/a/log/control.log"; ls /proc/self/fd')
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert lines[:3] == ["a", "log", "pipe"]
    assert sorted(lines[3:]) == ["0", "1", "2", "3"]  # stdio, and ls's own directory
    assert (root / "a/pipe/written").read_text() == "hi\n"
    assert (root / "a/log/control.log").read_text() == "log\n"


def test_private_shm_binds_the_opened_shm_directory_at_dev_shm(root: Path) -> None:
    """With --private-shm /dev/shm is the claim's shm directory."""
    done = _confined(root, 'echo x > /dev/shm/probe', private_shm=True)
    assert done.returncode == 0, done.stderr
    assert (root / "a/shm/probe").read_text() == "x\n"


def _replaced(root: Path, outside: Path) -> None:
    (root / "a/pipe").rename(root / "a/pipe.old")
    (root / "a/pipe").mkdir()


def _linked_out(root: Path, outside: Path) -> None:
    (root / "a").rename(root / "a.old")
    (root / "a").symlink_to(outside / "a")


@pytest.mark.parametrize(("swap", "said"), [
    (_replaced, "was replaced after the host opened it"),
    (_linked_out, "mps/a: Not a directory (no symlink is followed"),
], ids=["replaced", "linked-out"])
def test_a_directory_swapped_after_the_host_opened_it_is_never_started_on(
        root: Path, tmp_path: Path, swap: object, said: str) -> None:
    """The host opened ``a/pipe``; then it is swapped for another directory, or ``a`` for a
    symlink out of the root: the start fails (FAILED, saying why) before the daemon runs."""
    assert callable(swap)
    done = _confined(root, 'echo ran > "$0/a/pipe/ran"',
                     before=lambda: swap(root, tmp_path / "outside"))
    assert done.returncode == confine.FAILED, done
    assert said in done.stderr
    assert not os.listdir(tmp_path / "outside/a/pipe")
    assert not list(root.rglob("ran"))
