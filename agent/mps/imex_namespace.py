"""Start an IMEX daemon in a mount namespace of its own in which ``/etc/hosts`` is the domain's
hosts file (``docs/compute-domains.md``, "The node side").

The node list of a domain holds one fixed name per seat; the daemon resolves those names
through ``/etc/hosts`` (``nsswitch``: files first). This script gives the daemon a hosts file
of its own without touching the node's: ``unshare(CLONE_NEWNS)``, every mount made private
(nothing propagates back to the node), the hosts file opened without following a symlink and
bind-mounted over ``/etc/hosts`` through ``/proc/self/fd/N`` (the opened file itself, not a
path looked up again), read-only there; then every descriptor but the standard three is
closed and the daemon executed as ``imex -c config`` (the agent finds it by that argv). The
daemon's own children (``DAEMONIZE=1``) inherit the namespace.

The bind mount pins the file's inode: the agent rewrites it in place (never a rename) and
the daemon sees each change.

Standard library only: it runs as ``python -I imex_namespace.py SPEC`` (isolated mode), where
the agent package need not be importable, in the agent or in the MPS host alike.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import sys
from pathlib import Path

CLONE_NEWNS = 0x00020000
MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
#: The exit status when the namespace could not be made (the daemon never ran).
FAILED = 125
#: What the failure message starts with, so the launcher tells it from the daemon's own.
MARKER = "imex-namespace: "
ETC_HOSTS = "/etc/hosts"


def command(imex: str, config: str, hosts: str) -> tuple[str, ...]:
    """The command that runs ``imex -c config`` with ``hosts`` as its ``/etc/hosts``."""
    spec = {"imex": imex, "config": config, "hosts": hosts}
    return (sys.executable, "-I", str(Path(__file__).resolve()), json.dumps(spec))


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

    def mount(self, source: str | None, target: str, flags: int) -> None:
        if self._mount(None if source is None else os.fsencode(source), os.fsencode(target),
                       None, flags, None) != 0:
            _raise(f"mount {source or ''} on {target}")


def _raise(what: str) -> None:
    code = ctypes.get_errno()
    raise OSError(code, f"{what}: {os.strerror(code)}")


def enter(hosts: str, libc: _Libc) -> None:
    """Make this process's namespace: private mounts, ``hosts`` at ``/etc/hosts``."""
    libc.unshare(CLONE_NEWNS)
    libc.mount(None, "/", MS_REC | MS_PRIVATE)
    # Opened here, after the unshare: a mount can only be bound from this namespace's own.
    fd = os.open(hosts, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{hosts} is not a regular file")
        libc.mount(f"/proc/self/fd/{fd}", ETC_HOSTS, MS_BIND)
        # Read-only for the daemon; the agent still writes the file at its own path.
        libc.mount(None, ETC_HOSTS, MS_REMOUNT | MS_BIND | MS_RDONLY)
    finally:
        os.close(fd)


def main(args: list[str]) -> int:
    """Enter the namespace and execute the daemon (never returns then), or :data:`FAILED`
    with the reason on standard error."""
    try:
        spec = json.loads(args[0])
        imex, config, hosts = str(spec["imex"]), str(spec["config"]), str(spec["hosts"])
        enter(hosts, _Libc())
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        print(f"{MARKER}cannot give the IMEX daemon its own /etc/hosts: {err}",
              file=sys.stderr)
        return FAILED
    os.closerange(3, max(os.sysconf("SC_OPEN_MAX"), 1024))
    try:
        os.execve(imex, [imex, "-c", config], os.environ)
    except OSError as err:
        print(f"{MARKER}cannot run {imex}: {err.strerror or err}", file=sys.stderr)
    return FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
