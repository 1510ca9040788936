"""What the MPS host agrees to run (pure checks; the filesystem is only read).

The host runs as root outside the agent's container, so it accepts exactly one command, the
configured ``nvidia-cuda-mps-control`` with ``-d``, and an environment of the three MPS
variables whose directories lie under its ``--mps-root``. Anything else is refused with a
reason naming the offending field: a compromised agent gets no more than a daemon start.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PIPE = "CUDA_MPS_PIPE_DIRECTORY"
LOG = "CUDA_MPS_LOG_DIRECTORY"
VISIBLE = "CUDA_VISIBLE_DEVICES"
#: The keys a launch may carry. PATH is accepted and replaced by the host's own.
ALLOWED_ENV = (PIPE, LOG, VISIBLE, "PATH")
#: The search path daemons get (the binary's directory first, where the driver keeps
#: nvidia-cuda-mps-server beside the control binary).
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_DEVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_:./-]{0,95}")
_MAX_VALUE = 4096
_MAX_DEVICES = 64


class Refused(ValueError):
    """A launch the policy does not allow: ``field`` is the part of the request at fault."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class LaunchPlan:
    """One accepted start: what runs, with which environment, for which directories."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    pipe: Path
    log: Path
    shm: Path | None
    """The directory bind-mounted at ``/dev/shm`` for the daemon (``--private-shm``)."""


@dataclass(frozen=True)
class LaunchPolicy:
    """The host's configuration, and the check every launch goes through."""

    mps_control: Path
    mps_root: Path
    private_shm: bool = False
    unshare: str = "/usr/bin/unshare"
    mount: str = "/usr/bin/mount"
    library_path: str | None = None
    """LD_LIBRARY_PATH for daemons: the host's own (the driver root's libraries in a
    container), never the caller's."""

    def describe(self) -> dict[str, Any]:
        """What the host accepts, for ``ping``."""
        return {"mps_control": str(self.mps_control), "mps_root": str(self.mps_root),
                "private_shm": self.private_shm}

    def check(self, argv: Any, env: Any) -> LaunchPlan:
        """The plan for ``argv`` and ``env`` as received, or Refused naming the field."""
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise Refused("argv", "must be a list of strings")
        if argv != [str(self.mps_control), "-d"]:
            raise Refused("argv", f"only [{str(self.mps_control)!r}, '-d'] is run, not "
                                  f"{_short(argv)}")
        if not isinstance(env, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise Refused("env", "must be an object of strings")
        extra = sorted(set(env) - set(ALLOWED_ENV))
        if extra:
            raise Refused(f"env.{extra[0]}", f"not allowed (only {', '.join(ALLOWED_ENV)})")
        for key, value in env.items():
            if len(value) > _MAX_VALUE or "\0" in value:
                raise Refused(f"env.{key}", "too long or holds a NUL")
        pipe = self._directory(env, PIPE)
        log = self._directory(env, LOG)
        # The resolved paths, checked above: a symlink swapped in after the check cannot
        # redirect the daemon (its clients name the directory their own way anyway: the CDI
        # spec mounts it at /tmp/nvidia-mps in containers).
        out = {PIPE: str(pipe), LOG: str(log),
               "PATH": f"{self.mps_control.parent}:{SYSTEM_PATH}"}
        if VISIBLE in env:
            devices = env[VISIBLE].split(",")
            if len(devices) > _MAX_DEVICES or not all(_DEVICE.fullmatch(d) for d in devices):
                raise Refused(f"env.{VISIBLE}", "must be comma-separated device UUIDs or "
                                                "indices")
            out[VISIBLE] = env[VISIBLE]
        if self.library_path:
            out["LD_LIBRARY_PATH"] = self.library_path
        shm = None
        command: tuple[str, ...] = (str(self.mps_control), "-d")
        if self.private_shm:
            # <root>/<id>/pipe -> <root>/<id>/shm: the directory the claim's containers get
            # at /dev/shm. The daemon gets it there too, in a mount namespace of its own.
            shm = self._inside(pipe.parent / "shm", f"env.{PIPE}",
                               "has no shm directory beside it (--private-shm)")
            command = (self.unshare, "--mount", "--propagation", "private", "--", "/bin/sh",
                       "-c", '"$3" --bind "$1" /dev/shm && exec "$2" -d', "mps-host",
                       str(shm), str(self.mps_control), self.mount)
        return LaunchPlan(argv=command, env=out, pipe=pipe, log=log, shm=shm)

    def _directory(self, env: Mapping[str, str], key: str) -> Path:
        if key not in env:
            raise Refused(f"env.{key}", "missing")
        raw = env[key]
        if not os.path.isabs(raw) or os.path.normpath(raw) != raw.rstrip("/"):
            raise Refused(f"env.{key}", "must be an absolute, normalized path")
        return self._inside(Path(raw), f"env.{key}", "is not a directory")

    def _inside(self, path: Path, field: str, missing: str) -> Path:
        """``path`` with its symlinks resolved, when that is a directory strictly below the
        MPS root (an intermediate symlink cannot lead out of it)."""
        root = Path(os.path.realpath(self.mps_root))
        real = Path(os.path.realpath(path))
        if real == root or root not in real.parents:
            raise Refused(field, f"{path} is not under the MPS root {self.mps_root}")
        if not real.is_dir():
            raise Refused(field, f"{path} {missing}")
        return real


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "…"
