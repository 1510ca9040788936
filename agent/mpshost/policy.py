"""What the MPS host agrees to run (pure checks: nothing here opens a directory).

The host runs as root outside the agent's container, so it accepts exactly one command, the
configured ``nvidia-cuda-mps-control`` with ``-d``, and an environment of the three MPS
variables whose directories are spelled below its ``--mps-root``. Anything else is refused
with a reason naming the offending field: a compromised agent gets no more than a daemon
start. The check is on the spelling only; the directories themselves are opened afterwards
without following a symlink (:mod:`agent.mpshost.directories`), and the daemon reaches only
the opened ones (:mod:`agent.mpshost.confine`).
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
#: The shm directory beside the pipe directory (``<root>/<id>/shm``, what the claim's
#: containers get at /dev/shm).
SHM = "shm"
_DEVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_:./-]{0,95}")
_MAX_VALUE = 4096
_MAX_NAME = 255  # NAME_MAX: the most bytes of one path component
_MAX_DEVICES = 64

Parts = tuple[str, ...]
"""A directory below the MPS root, as its path components (never empty, never ``..``)."""


class Refused(ValueError):
    """A launch the policy does not allow: ``field`` is the part of the request at fault."""

    kind = "refused"

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class Malformed(Refused):
    """A value that is no value of its kind at all (not text, not a file name): answered
    ``bad-request`` rather than ``refused``."""

    kind = "bad-request"


@dataclass(frozen=True)
class LaunchPlan:
    """One accepted start: what the daemon runs with which environment, and the directories
    below ``root`` it gets."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    root: Path
    """The MPS root with its symlinks resolved (the admin's path: trusted)."""
    pipe: Parts
    log: Parts
    shm: Parts
    """``<pipe's parent>/shm``: bound at /dev/shm for the daemon with ``private_shm``, and
    labelled with ``--selinux-context`` when it exists."""
    private_shm: bool


@dataclass(frozen=True)
class LaunchPolicy:
    """The host's configuration, and the check every launch goes through."""

    mps_control: Path
    mps_root: Path
    private_shm: bool = False
    library_path: str | None = None
    """LD_LIBRARY_PATH for daemons: the host's own (the driver root's libraries in a
    container), never the caller's."""

    def describe(self) -> dict[str, Any]:
        """What the host accepts, for ``ping``."""
        return {"mps_control": str(self.mps_control), "mps_root": str(self.mps_root),
                "private_shm": self.private_shm}

    def check(self, argv: Any, env: Any) -> LaunchPlan:
        """The plan for ``argv`` and ``env`` as received, or Refused (Malformed) naming the
        field."""
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise Refused("argv", "must be a list of strings")
        if argv != [str(self.mps_control), "-d"]:
            raise Refused("argv", f"only [{str(self.mps_control)!r}, '-d'] is run, not "
                                  f"{short(argv)}")
        if not isinstance(env, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise Refused("env", "must be an object of strings")
        for key, value in env.items():
            if not is_text(key) or not is_text(value):
                raise Malformed(f"env.{printable(key)}", "is not valid Unicode text (a lone "
                                                          "surrogate)")
        extra = sorted(set(env) - set(ALLOWED_ENV))
        if extra:
            raise Refused(f"env.{extra[0]}", f"not allowed (only {', '.join(ALLOWED_ENV)})")
        for key, value in env.items():
            if len(value) > _MAX_VALUE or "\0" in value:
                raise Refused(f"env.{key}", "too long or holds a NUL")
        # Resolved once here, for the spelling the daemon gets: the root is the admin's.
        root = Path(os.path.realpath(self.mps_root))
        pipe = self._below(env, PIPE, root)
        log = self._below(env, LOG, root)
        if _within(pipe, log) or _within(log, pipe):
            # Each is bound at its own path in the daemon's namespace; one inside the other
            # would be reached through the other's real directory, where links can be swapped.
            raise Refused(f"env.{LOG}", "must neither be the pipe directory nor lie inside "
                                        "it or contain it")
        out = {PIPE: str(root.joinpath(*pipe)), LOG: str(root.joinpath(*log)),
               "PATH": f"{self.mps_control.parent}:{SYSTEM_PATH}"}
        if VISIBLE in env:
            devices = env[VISIBLE].split(",")
            if len(devices) > _MAX_DEVICES or not all(_DEVICE.fullmatch(d) for d in devices):
                raise Refused(f"env.{VISIBLE}", "must be comma-separated device UUIDs or "
                                                "indices")
            out[VISIBLE] = env[VISIBLE]
        if self.library_path:
            out["LD_LIBRARY_PATH"] = self.library_path
        return LaunchPlan(argv=(str(self.mps_control), "-d"), env=out, root=root, pipe=pipe,
                          log=log, shm=(*pipe[:-1], SHM), private_shm=self.private_shm)

    def _below(self, env: Mapping[str, str], key: str, root: Path) -> Parts:
        """The components below the root of ``env[key]``, spelled from the root as
        configured or as resolved."""
        if key not in env:
            raise Refused(f"env.{key}", "missing")
        raw = env[key]
        if not os.path.isabs(raw) or os.path.normpath(raw) != raw.rstrip("/"):
            raise Refused(f"env.{key}", "must be an absolute, normalized path")
        path = os.path.normpath(raw)
        for spelling in {os.path.normpath(self.mps_root), str(root)}:
            prefix = spelling.rstrip("/") + "/"
            if path.startswith(prefix) and len(path) > len(prefix):
                parts = tuple(path[len(prefix):].split("/"))
                if any(len(os.fsencode(part)) > _MAX_NAME for part in parts):
                    raise Malformed(f"env.{key}", f"a component is over {_MAX_NAME} bytes")
                return parts
        raise Refused(f"env.{key}", f"{raw} is not under the MPS root {self.mps_root}")


def _within(inner: Parts, outer: Parts) -> bool:
    return inner[:len(outer)] == outer


def is_text(value: str) -> bool:
    """Whether ``value`` encodes as UTF-8 (JSON can carry lone surrogates, paths cannot)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def printable(value: str) -> str:
    """``value`` in ASCII, anything else escaped (for a reason that names it)."""
    return value.encode("ascii", "backslashreplace").decode("ascii")


def short(value: Any) -> str:
    """``value``'s repr, at most 200 characters (for a reason that quotes it)."""
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "…"
