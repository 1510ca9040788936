"""Start one daemon in a mount namespace of its own in which its directory paths lead only to
the directories the host opened (``docs/sharing.md``, "The MPS host's contract").

The host opens the pipe, log and shm directories below the MPS root without following a
symlink (:func:`open_below`, :mod:`agent.mpshost.directories`) and runs this file as a
script, passing those descriptors on. Here, after ``unshare(CLONE_NEWNS)`` and making every
mount private, each directory is opened again the same way (a mount can only be bound from
this namespace's own mounts) and must be the very directory the host opened (device and
inode); then a fresh tmpfs is mounted over the MPS root, the daemon's directory paths are
made in it, each directory is bind-mounted at its path through ``/proc/self/fd/N`` (the
kernel resolves that to the open directory itself, not to a path), and with
``--private-shm`` the shm directory at ``/dev/shm``. Then every descriptor is closed and the
daemon is executed with the very path strings the agent uses. No one else can reach the
tmpfs, so whatever happens under the MPS root afterwards, in the daemon's namespace those
paths lead to the opened directories and nowhere else: nothing the daemon or its servers
write there can land outside the root.

Standard library only: it runs as ``python -I confine.py SPEC`` (isolated mode, with an
empty environment), where the agent package is not importable.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNS = 0x00020000
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
#: The exit status when the daemon could not be confined (it never ran).
FAILED = 125
#: Each component opened as a directory, never through a symlink.
_BELOW = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_below(root: int, parts: Sequence[str]) -> int:
    """The directory ``parts`` below the directory ``root`` (a descriptor), each component
    opened relative to its parent's descriptor with ``O_NOFOLLOW``: a symlink anywhere is
    ELOOP (or ENOTDIR), never followed. OSError names the components up to the failing one."""
    fd = root
    try:
        for depth, part in enumerate(parts):
            try:
                child = os.open(part, _BELOW, dir_fd=fd)
            except OSError as err:
                raise OSError(err.errno, err.strerror, "/".join(parts[:depth + 1])) from None
            if fd != root:
                os.close(fd)
            fd = child
    except BaseException:
        if fd != root:
            os.close(fd)
        raise
    return fd


@dataclass(frozen=True)
class Bound:
    """One directory the daemon gets: ``parts`` below the root, opened by the host as
    ``fd``, mounted at ``at`` (its own path below the root, or /dev/shm)."""

    parts: tuple[str, ...]
    fd: int
    at: str


def command(*, root: str, bound: Sequence[Bound], argv: Sequence[str],
            env: Mapping[str, str]) -> tuple[str, ...]:
    """The command that runs ``argv`` with ``env`` confined: ``root`` covered by a tmpfs and
    each of ``bound`` mounted at its place. The caller passes the descriptors on
    (``pass_fds``) and runs it with an empty environment."""
    spec = {"root": root, "bound": [[list(b.parts), b.fd, b.at] for b in bound],
            "argv": list(argv), "env": dict(env)}
    return (sys.executable, "-I", str(Path(__file__).resolve()), json.dumps(spec))


def probe_command() -> tuple[str, ...]:
    """The command that only makes a private mount namespace and exits 0 (or FAILED): whether
    this host can confine daemons at all."""
    return (sys.executable, "-I", str(Path(__file__).resolve()), "--probe")


class _Libc:
    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._unshare = libc.unshare
        self._unshare.argtypes = [ctypes.c_int]
        self._mount = libc.mount
        self._mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                ctypes.c_ulong, ctypes.c_char_p]

    def unshare(self, flags: int) -> None:
        if self._unshare(flags) != 0:
            _raise("unshare(CLONE_NEWNS)")

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int,
              data: str | None = None) -> None:
        if self._mount(_bytes(source), os.fsencode(target), _bytes(fstype), flags,
                       _bytes(data)) != 0:
            _raise(f"mount {source or ''} on {target}")


def _bytes(value: str | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def _raise(what: str) -> None:
    code = ctypes.get_errno()
    raise OSError(code, f"{what}: {os.strerror(code)}")


def private_namespace(libc: _Libc) -> None:
    """A mount namespace of this process's own whose mounts propagate nowhere."""
    libc.unshare(CLONE_NEWNS)
    libc.mount(None, "/", None, MS_REC | MS_PRIVATE)


def confine(root: str, bound: Sequence[Bound], libc: _Libc) -> None:
    """Make the namespace described at :func:`command` (this process's from now on)."""
    private_namespace(libc)
    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    mine = []
    for each in bound:
        try:
            fd = open_below(top, each.parts)
        except OSError as err:
            raise OSError(f"{root}/{err.filename}: {err.strerror} (no symlink is followed "
                          "below the MPS root)") from None
        here, host = os.fstat(fd), os.fstat(each.fd)
        if (here.st_dev, here.st_ino) != (host.st_dev, host.st_ino):
            raise OSError(f"{'/'.join(each.parts)} below {root} was replaced after the host "
                          "opened it")
        mine.append((fd, each.at))
    libc.mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=64k")
    for fd, at in mine:
        if at != "/dev/shm":
            os.makedirs(at, mode=0o755, exist_ok=True)  # in the fresh tmpfs: nothing to race
        libc.mount(f"/proc/self/fd/{fd}", at, None, MS_BIND)


def main(args: list[str]) -> int:
    """Confine and execute the daemon (never returns then), or FAILED with the reason on
    standard error."""
    try:
        libc = _Libc()
        if args == ["--probe"]:
            private_namespace(libc)
            return 0
        spec = json.loads(args[0])
        bound = [Bound(tuple(str(p) for p in parts), int(fd), str(at))
                 for parts, fd, at in spec["bound"]]
        argv = [str(a) for a in spec["argv"]]
        env = {str(k): str(v) for k, v in spec["env"].items()}
        confine(str(spec["root"]), bound, libc)
        for each in bound:  # the daemon and its servers keep no way back to the real tree
            os.close(each.fd)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        print(f"mps-host: cannot confine the daemon to its directories: {err}",
              file=sys.stderr)
        return FAILED
    try:
        os.execve(argv[0], argv, env)
    except OSError as err:
        print(f"mps-host: cannot run {argv[0]}: {err.strerror or err}", file=sys.stderr)
    return FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
