"""The spec directory the runtimes read: atomic writes, idempotent removal, and the list of
files this agent owns (those of its own kinds), so stale ones can be cleaned up.

Writes are atomic (a runtime reads the old file or the new one, never a part) but not
fsync'd: every spec is derived state, rebuilt from the checkpoint and NVML before the agent
turns ready, and a power loss that could lose a write also reboots the node, which loses the
devices the specs name (``/var/run/cdi`` is a tmpfs on most hosts anyway). The checkpoint,
which is the record, is the one durable write of a prepare.

The directory may be shared (two agents pointed at one ``/var/run/cdi``, or nvidia-ctk's specs
beside ours), so a store with an ``owner`` marks every spec it writes with a hidden file
beside it (``.<spec>.owner``, holding the owner's id; runtimes read only ``*.json`` and
``*.yaml``) and lists and removes only the specs that carry its own mark. A spec of our kinds
without a mark was written before marks existed and is adopted by whoever finds it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from agent.durable import write_atomic
from cdi.names import spec_file_name, split_kind, transient_file_name
from cdi.spec import Spec
from cdi.version import minimum_version

log = logging.getLogger("cdi.store")
#: An ownership mark holds one agent id (``gpu-agent-<16 hex>``); more is not a mark of ours.
_MARK_BYTES = 4096


class SpecStore:
    def __init__(self, directory: Path, kinds: tuple[str, ...], owner: str | None = None) -> None:
        self.directory = directory
        self.kinds = kinds
        self.owner = owner
        self._prefixes = tuple(f"{v}-{c}" for v, c in (split_kind(k) for k in kinds))

    def write(self, spec: Spec, spec_id: str | None = None) -> Path:
        """Write ``spec`` (transient when ``spec_id`` is given) atomically, with this store's
        ownership mark first; the declared ``cdiVersion`` must be the minimum its content
        needs."""
        needed = minimum_version(spec)
        if spec.cdi_version != needed:
            raise ValueError(f"spec declares cdiVersion {spec.cdi_version}, its content needs "
                             f"exactly {needed}")
        name = transient_file_name(spec.kind, spec_id) if spec_id else spec_file_name(spec.kind)
        path = self.directory / name
        if self.owner is not None:
            # The mark goes first: a spec is never on disk unmarked (then adopted by another).
            write_atomic(_mark_name(str(path)), f"{self.owner}\n".encode(), mode=0o644,
                         durable=False)
        write_atomic(path, spec.to_json(), mode=0o644, durable=False)
        return path

    def owner_of(self, path: Path) -> str | None:
        """The id in ``path``'s ownership mark; None when it has none."""
        try:
            fd = os.open(_mark_name(os.fspath(path)), os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            raw = os.read(fd, _MARK_BYTES)
        finally:
            os.close(fd)
        try:
            return raw.decode().strip() or None
        except UnicodeDecodeError:
            return None

    def is_ours(self, path: Path) -> bool:
        """Whether this store may remove ``path``: its mark is ours, or it has none."""
        if self.owner is None:
            return True
        mark = self.owner_of(path)
        return mark is None or mark == self.owner

    def remove(self, path: Path) -> bool:
        """Remove one of our spec files (and its mark); False when it was already gone or is
        another owner's, which is left alone."""
        if not self.is_ours(path):
            log.warning("not removing a CDI spec another agent owns",
                        extra={"path": str(path), "owner": self.owner_of(path)})
            return False
        name = os.fspath(path)
        try:
            os.unlink(name)
        except FileNotFoundError:
            removed = False
        else:
            removed = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_mark_name(name))
        return removed

    def owned(self) -> list[Path]:
        """Spec files of this agent's kinds in the directory that carry its mark (or none);
        never anyone else's."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in os.scandir(self.directory):
            name = entry.name
            if not entry.is_file() or not name.endswith(".json"):
                continue
            stem = name[: -len(".json")]
            if any(stem == p or stem.startswith(p + "_") for p in self._prefixes) \
                    and self.is_ours(Path(entry.path)):
                found.append(Path(entry.path))
        return sorted(found)


def mark_path(spec: Path) -> Path:
    """The ownership mark of a spec file: ``.<name>.owner`` beside it."""
    return spec.with_name(f".{spec.name}.owner")


def _mark_name(spec: str) -> str:
    """:func:`mark_path` on a path string (claim specs are written and removed on every
    prepare and unprepare; pathlib's parsing cost more than the file calls)."""
    directory, slash, name = spec.rpartition("/")
    return f"{directory}{slash}.{name}.owner"
