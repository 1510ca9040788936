"""The directories of one daemon start, opened below the MPS root one component at a time,
each relative to its parent's descriptor and never through a symlink
(:func:`agent.mpshost.confine.open_below`).

What is open is what the daemon gets (:mod:`agent.mpshost.confine` binds these very
directories into its mount namespace), so there is no check whose answer a later lookup
could contradict: a directory swapped for a symlink at any moment is either refused here or
not seen by the daemon at all.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from agent.mpshost.confine import open_below
from agent.mpshost.imex import ImexPlan
from agent.mpshost.policy import LOG, PIPE, LaunchPlan, Parts, Refused

#: A file below the root: never through a symlink, never blocking (a FIFO), never a tty.
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


@dataclass(frozen=True)
class OpenedDirectories:
    """Descriptors of a plan's directories, valid inside :func:`opened`."""

    pipe: int
    log: int
    shm: int | None
    """The shm directory: always with ``private_shm``, else only when it exists (for its
    SELinux label)."""


@contextlib.contextmanager
def opened(plan: LaunchPlan) -> Iterator[OpenedDirectories]:
    """Open the plan's directories (closed on leaving); Refused naming the variable when one
    is missing, not a directory, or a symlink at any component."""
    with contextlib.ExitStack() as stack:
        root = os.open(plan.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        stack.callback(os.close, root)

        def below(parts: Parts, field: str) -> int:
            try:
                fd = open_below(root, parts)
            except OSError as err:
                raise Refused(field, _why(plan, err)) from None
            stack.callback(os.close, fd)
            return fd

        pipe = below(plan.pipe, f"env.{PIPE}")
        log = below(plan.log, f"env.{LOG}")
        shm = None
        if plan.private_shm:
            try:
                shm = below(plan.shm, f"env.{PIPE}")
            except Refused as err:
                raise Refused(err.field, f"{err.reason}: --private-shm gives the daemon the "
                                         "shm directory beside the pipe directory") from None
        else:
            with contextlib.suppress(Refused):  # only for its label: absent is fine
                shm = below(plan.shm, f"env.{PIPE}")
        yield OpenedDirectories(pipe=pipe, log=log, shm=shm)


@dataclass(frozen=True)
class OpenedFiles:
    """Descriptors of an IMEX plan's config and hosts files, valid inside
    :func:`opened_files`."""

    config: int
    hosts: int


@contextlib.contextmanager
def opened_files(plan: ImexPlan) -> Iterator[OpenedFiles]:
    """Open the plan's config and hosts files (closed on leaving): each directory component
    and the file itself without following a symlink; Refused naming the field when one is
    missing, a symlink, or not a regular file."""
    with contextlib.ExitStack() as stack:
        root = os.open(plan.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        stack.callback(os.close, root)

        def regular(parts: Parts, field: str) -> int:
            try:
                parent = open_below(root, parts[:-1])
            except OSError as err:
                raise Refused(field, _why_at(plan.root, "IMEX", err)) from None
            try:
                fd = os.open(parts[-1], _FILE, dir_fd=parent)
            except OSError as err:
                err.filename = "/".join(parts)
                raise Refused(field, _why_at(plan.root, "IMEX", err, what="a file")) from None
            finally:
                if parent != root:
                    os.close(parent)
            stack.callback(os.close, fd)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise Refused(field, f"{plan.root.joinpath(*parts)} is not a regular file")
            return fd

        yield OpenedFiles(config=regular(plan.config_parts, "config"),
                          hosts=regular(plan.hosts_parts, "hosts"))


def _why(plan: LaunchPlan, err: OSError) -> str:
    return _why_at(plan.root, "MPS", err)


def _why_at(root: Path, kind: str, err: OSError, *, what: str = "a directory") -> str:
    at = root / str(err.filename)
    if err.errno == errno.ENOENT:
        return f"{at} does not exist"
    if err.errno in (errno.ELOOP, errno.ENOTDIR):
        # O_NOFOLLOW: ELOOP for a symlink; ENOTDIR for anything else that is no directory.
        return f"{at} is a symlink or not {what} (no symlink is followed below the " \
               f"{kind} root)"
    return f"{at} cannot be opened: {err.strerror or err}"
