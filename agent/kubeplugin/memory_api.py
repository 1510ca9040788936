"""An in-memory API server for ResourceSlices and Nodes: a stateful fake of
:class:`agent.kubeplugin.kube.SliceApi`, as the GPU simulator is one of NVML.

It keeps what the publisher's correctness rests on: resourceVersions and UIDs, optimistic
concurrency on update, UID and resourceVersion preconditions on delete, the field selector,
a watch that resumes from a resourceVersion (and expires when compacted), and a server that
drops the fields a disabled feature gate guards. Faults: the server unavailable (every call
and open watch fails), a wipe of a node's slices by someone else (kubelet at its start).
Tests and benchmarks use it where a real kube-apiserver is too heavy.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from agent.kubeplugin.kube import (
    WATCH_TIMEOUT_S,
    KubeConflict,
    KubeExpired,
    KubeInvalid,
    KubeNotFound,
    KubeUnavailable,
    SliceList,
    WatchEvent,
)

Json = dict[str, Any]


@dataclass(frozen=True)
class _Event:
    resource_version: int
    type: str
    object: Json


def _strip(doc: Any, path: list[str]) -> None:
    """Remove the field at ``path`` (``[]`` steps into every list item) from ``doc``."""
    if not path:
        return
    head, rest = path[0], path[1:]
    if head.endswith("[]"):
        items = doc.get(head[:-2]) if isinstance(doc, dict) else None
        for item in items if isinstance(items, list) else ():
            _strip(item, rest)
        return
    if not isinstance(doc, dict) or head not in doc:
        return
    if rest:
        _strip(doc[head], rest)
    else:
        del doc[head]


class MemorySliceApi:
    """One cluster's ResourceSlices and Nodes in memory; ``drops`` are field paths the server
    removes from every written slice (``spec.devices[].consumesCounters`` for a 1.34 server
    with ``DRAPartitionableDevices`` off)."""

    def __init__(self, *, version: tuple[int, int] = (1, 35),
                 drops: Iterable[str] = ()) -> None:
        self.version = version
        self.drops = tuple(drops)
        self.available = True
        self.calls: dict[str, int] = {}
        self._slices: dict[str, Json] = {}
        self._nodes: dict[str, Json] = {}
        self._events: list[_Event] = []
        self._compacted = 0
        self._epoch = 0
        self._versions = itertools.count(1)
        self._last_version = 0
        self._changed = asyncio.Event()

    # --- the control surface (what a test does to the server) ---

    def add_node(self, name: str) -> str:
        """Create (or recreate, with a new UID) the Node; its UID."""
        uid = str(uuid.uuid4())
        self._nodes[name] = {"apiVersion": "v1", "kind": "Node",
                             "metadata": {"name": name, "uid": uid,
                                          "resourceVersion": str(self._bump())}}
        return uid

    def set_available(self, available: bool) -> None:
        """Take the server down (every call fails with :class:`KubeUnavailable`, open
        watches end) or bring it back."""
        self.available = available
        self._notify()

    def slices(self, *, driver: str | None = None, node: str | None = None) -> list[Json]:
        """Copies of the stored slices (of a driver and node when given), by name."""
        return [copy.deepcopy(s) for name, s in sorted(self._slices.items())
                if (driver is None or s["spec"].get("driver") == driver)
                and (node is None or s["spec"].get("nodeName") == node)]

    def wipe(self, node: str) -> int:
        """Delete every slice of the node, as kubelet does when it starts; how many."""
        names = [n for n, s in self._slices.items() if s["spec"].get("nodeName") == node]
        for name in names:
            self._remove(name)
        return len(names)

    def compact(self) -> None:
        """Forget the event history: open watches end with 410 Expired, and a watch from an
        older resourceVersion expires."""
        self._compacted = self._last_version
        self._epoch += 1
        self._events.clear()
        self._notify()

    # --- SliceApi ---

    async def server_version(self) -> tuple[int, int]:
        self._enter("version")
        return self.version

    async def get_node(self, name: str) -> Json:
        self._enter("get_node")
        node = self._nodes.get(name)
        if node is None:
            raise KubeNotFound(f'nodes "{name}" not found', status=404, reason="NotFound")
        return copy.deepcopy(node)

    async def list_resource_slices(self, *, driver: str, node: str) -> SliceList:
        self._enter("list")
        return SliceList(resource_version=str(self._last_version),
                         items=self.slices(driver=driver, node=node))

    async def watch_resource_slices(self, *, driver: str, node: str, resource_version: str,
                                    timeout_s: int = WATCH_TIMEOUT_S
                                    ) -> AsyncIterator[WatchEvent]:
        self._enter("watch")
        since = int(resource_version or 0)
        if since < self._compacted:
            raise KubeExpired(f"too old resource version: {since}", status=410,
                              reason="Expired")
        epoch = self._epoch
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            changed = self._changed
            pending = [e for e in self._events if e.resource_version > since]
            for event in pending:
                since = event.resource_version
                spec = event.object.get("spec", {})
                if spec.get("driver") == driver and spec.get("nodeName") == node:
                    yield WatchEvent(event.type, copy.deepcopy(event.object))
            if not self.available:
                raise KubeUnavailable("watch: connection reset")
            if epoch != self._epoch:
                raise KubeExpired("history compacted", status=410, reason="Expired")
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                return

    async def create_resource_slice(self, body: Json) -> Json:
        self._enter("create")
        name = self._validate(body)
        if name in self._slices:
            raise KubeConflict(f'resourceslices "{name}" already exists', status=409,
                               reason="AlreadyExists")
        stored = self._stored(body, uid=str(uuid.uuid4()))
        self._slices[name] = stored
        self._record("ADDED", stored)
        return copy.deepcopy(stored)

    async def update_resource_slice(self, body: Json) -> Json:
        self._enter("update")
        name = self._validate(body)
        current = self._slices.get(name)
        if current is None:
            raise KubeNotFound(f'resourceslices "{name}" not found', status=404,
                               reason="NotFound")
        sent = body.get("metadata", {}).get("resourceVersion")
        if sent and sent != current["metadata"]["resourceVersion"]:
            raise KubeConflict(f'resourceslices "{name}": the object has been modified',
                               status=409, reason="Conflict")
        stored = self._stored(body, uid=current["metadata"]["uid"])
        self._slices[name] = stored
        self._record("MODIFIED", stored)
        return copy.deepcopy(stored)

    async def delete_resource_slice(self, name: str, *, uid: str,
                                    resource_version: str) -> None:
        self._enter("delete")
        current = self._slices.get(name)
        if current is None:
            raise KubeNotFound(f'resourceslices "{name}" not found', status=404,
                               reason="NotFound")
        meta = current["metadata"]
        if (uid and uid != meta["uid"]) or (resource_version
                                             and resource_version != meta["resourceVersion"]):
            raise KubeConflict(f'resourceslices "{name}": precondition failed', status=409,
                               reason="Conflict")
        self._remove(name)

    # --- the server's inside ---

    def _enter(self, call: str) -> None:
        self.calls[call] = self.calls.get(call, 0) + 1
        if not self.available:
            raise KubeUnavailable(f"{call}: connection refused")

    def _validate(self, body: Json) -> str:
        name = body.get("metadata", {}).get("name")
        spec = body.get("spec", {})
        missing = [f for f in ("driver", "nodeName", "pool") if f not in spec]
        if not name or missing:
            raise KubeInvalid(f"ResourceSlice invalid: name {name!r}, missing {missing}",
                              status=422, reason="Invalid")
        return str(name)

    def _stored(self, body: Json, *, uid: str) -> Json:
        stored = copy.deepcopy(body)
        for path in self.drops:
            _strip(stored, path.split("."))
        meta = stored.setdefault("metadata", {})
        meta.update(uid=uid, resourceVersion=str(self._bump()))
        return stored

    def _remove(self, name: str) -> None:
        gone = self._slices.pop(name)
        gone["metadata"]["resourceVersion"] = str(self._bump())
        self._record("DELETED", gone)

    def _bump(self) -> int:
        self._last_version = next(self._versions)
        return self._last_version

    def _record(self, kind: str, obj: Json) -> None:
        self._events.append(_Event(int(obj["metadata"]["resourceVersion"]), kind,
                                   copy.deepcopy(obj)))
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
