"""What the MPS host agrees to run for IMEX (pure checks: nothing here opens a file).

Besides MPS control daemons the host starts the node's IMEX daemon, so that it too lives in
the host's cgroup and outlives the agent's container or unit. It runs exactly one thing: the
configured ``nvidia-imex`` (``--imex``) with ``-c <config>``, in a mount namespace of its own
where ``/etc/hosts`` is the agent's hosts file. Config and hosts must be spelled as
absolute, normalized paths strictly below ``--imex-root`` (the agent's ``<state>/imex``),
without ``..``; :func:`agent.mpshost.directories.opened_files` then opens them one component
at a time without following a symlink and requires regular files. So a compromised agent
gets at most a start of the configured ``nvidia-imex`` with a config file from below the
IMEX root (the daemon reads it by path: the agent finds its daemon by ``-c <config>``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.mpshost.policy import Malformed, Parts, Refused, is_text, printable, short

_MAX_PATH = 4096
_MAX_NAME = 255  # NAME_MAX: the most bytes of one path component


@dataclass(frozen=True)
class ImexPlan:
    """One accepted IMEX start: the binary, and the two files as the agent spelled them and
    as components below the (resolved) root."""

    imex: str
    config: str
    hosts: str
    root: Path
    """The IMEX root with its symlinks resolved (the admin's path: trusted)."""
    config_parts: Parts
    hosts_parts: Parts


@dataclass(frozen=True)
class ImexPolicy:
    """The host's IMEX configuration (``--imex``, ``--imex-root``; both or neither), and the
    check every ``launch-imex`` goes through."""

    imex: Path | None = None
    imex_root: Path | None = None

    def describe(self) -> dict[str, Any]:
        """What the host accepts, for ``ping`` (nulls: it runs no IMEX daemon)."""
        return {"imex": str(self.imex) if self.imex is not None else None,
                "imex_root": str(self.imex_root) if self.imex_root is not None else None}

    def check(self, imex: Any, config: Any, hosts: Any) -> ImexPlan:
        """The plan for the request's fields as received, or Refused (Malformed) naming the
        field."""
        if self.imex is None or self.imex_root is None:
            raise Refused("imex", "this host runs no IMEX daemon (it was started without "
                                  "--imex and --imex-root)")
        if not isinstance(imex, str):
            raise Refused("imex", "must be a string")
        if imex != str(self.imex):
            raise Refused("imex", f"only {str(self.imex)!r} is run, not {short(imex)}")
        # Resolved once here; the root is the admin's.
        root = Path(os.path.realpath(self.imex_root))
        config_parts = self._below("config", config, root)
        hosts_parts = self._below("hosts", hosts, root)
        if config_parts == hosts_parts:
            raise Refused("hosts", "must not be the config file")
        return ImexPlan(imex=imex, config=config, hosts=hosts, root=root,
                        config_parts=config_parts, hosts_parts=hosts_parts)

    def _below(self, field: str, raw: Any, root: Path) -> Parts:
        """The components below the root of the path ``raw``, spelled from the root as
        configured or as resolved."""
        assert self.imex_root is not None
        if not isinstance(raw, str):
            raise Refused(field, "must be a string")
        if not is_text(raw):
            raise Malformed(field, f"{printable(raw)[:80]} is not valid Unicode text (a lone "
                                   "surrogate)")
        if len(raw) > _MAX_PATH or "\0" in raw:
            raise Refused(field, "too long or holds a NUL")
        if ".." in raw.split("/"):
            raise Refused(field, f"{short(raw)} must not contain '..'")
        if not os.path.isabs(raw) or os.path.normpath(raw) != raw:
            raise Refused(field, f"{short(raw)} must be an absolute, normalized path")
        for spelling in {os.path.normpath(self.imex_root), str(root)}:
            prefix = spelling.rstrip("/") + "/"
            if raw.startswith(prefix) and len(raw) > len(prefix):
                parts = tuple(raw[len(prefix):].split("/"))
                if any(len(os.fsencode(part)) > _MAX_NAME for part in parts):
                    raise Malformed(field, f"a component is over {_MAX_NAME} bytes")
                return parts
        raise Refused(field, f"{short(raw)} is not under the IMEX root {self.imex_root}")
