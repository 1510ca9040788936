"""The spec directory the runtimes read: atomic writes, idempotent removal, and the list of
files this agent owns (those of its own kinds), so stale ones can be cleaned up.

Writes are atomic (a runtime reads the old file or the new one, never a part) but not
fsync'd: every spec is derived state, rebuilt from the checkpoint and NVML before the agent
turns ready, and a power loss that could lose a write also reboots the node, which loses the
devices the specs name (``/var/run/cdi`` is a tmpfs on most hosts anyway). The checkpoint,
which is the record, is the one durable write of a prepare."""

from __future__ import annotations

import os
from pathlib import Path

from agent.durable import write_atomic
from cdi.names import spec_file_name, split_kind, transient_file_name
from cdi.spec import Spec
from cdi.version import minimum_version


class SpecStore:
    def __init__(self, directory: Path, kinds: tuple[str, ...]) -> None:
        self.directory = directory
        self.kinds = kinds
        self._prefixes = tuple(f"{v}-{c}" for v, c in (split_kind(k) for k in kinds))

    def write(self, spec: Spec, spec_id: str | None = None) -> Path:
        """Write ``spec`` (transient when ``spec_id`` is given) atomically; the declared
        ``cdiVersion`` must be the minimum its content needs."""
        needed = minimum_version(spec)
        if spec.cdi_version != needed:
            raise ValueError(f"spec declares cdiVersion {spec.cdi_version}, its content needs "
                             f"exactly {needed}")
        name = transient_file_name(spec.kind, spec_id) if spec_id else spec_file_name(spec.kind)
        path = self.directory / name
        write_atomic(path, spec.to_json(), mode=0o644, durable=False)
        return path

    def remove(self, path: Path) -> bool:
        """Remove one of our spec files; False when it was already gone."""
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True

    def owned(self) -> list[Path]:
        """Spec files of this agent's kinds in the directory (never anyone else's)."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in os.scandir(self.directory):
            name = entry.name
            if not entry.is_file() or not name.endswith(".json"):
                continue
            stem = name[: -len(".json")]
            if any(stem == p or stem.startswith(p + "_") for p in self._prefixes):
                found.append(Path(entry.path))
        return sorted(found)
