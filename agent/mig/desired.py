"""The geometry last applied to each GPU, remembered durably (``<state>/mig/desired.json``) with
the boot and the GPU's energy counter it was applied at: re-applied at start-up after a reboot
(the boot id changed) or a driver reload (NVML's energy counter, which restarts from zero with
the driver, is below what was recorded; the boot id stays) emptied the GPU, and reported as
drift (event, metric, ``GET /v1/gpus/{gpu}/mig``) when the hardware shows something else,
which is never overwritten. The claims' slices made on demand are not part of it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agent.durable import DurableMap
from agent.errors import CheckpointUnusable, Conflict, GeometryNotPlaceable
from agent.events import EventLog, Severity
from agent.gpu.inventory import GpuInventory
from agent.gpu.types import Gpu
from agent.host import boot_id
from agent.ledger.ledger import NodeLedger
from agent.metrics.agent import AgentMetrics
from agent.mig.devices import MigDevices, layout
from agent.mig.geometry import DesiredInstances, Geometry

log = logging.getLogger("agent.mig")

#: Re-applies a remembered layout: ``request(gpu, desired)`` (the transitions' own door).
Reapply = Callable[[Gpu, DesiredInstances], Awaitable[object]]


class DesiredGeometry:
    """What each GPU should show, and whether it does."""

    def __init__(self, *, path: Path, devices: MigDevices, inventory: GpuInventory,
                 ledger: NodeLedger, events: EventLog, metrics: AgentMetrics,
                 proc_root: Path, reapply: bool) -> None:
        self._devices = devices
        self._inventory = inventory
        self._ledger = ledger
        self._events = events
        self._metrics = metrics
        self._proc_root = proc_root
        self._reapply = reapply
        self.records = DurableMap(path, format="gpu-agent-mig-desired")
        self._drift: dict[str, str] = {}
        if self.records.problem:
            events.append("mig.state_unreadable", self.records.problem, severity=Severity.ERROR)

    def get(self, gpu: str) -> dict[str, Any] | None:
        """The remembered record of ``gpu`` (``geometry``, ``boot_id``), or None."""
        record: dict[str, Any] | None = self.records.get(gpu)
        return record

    def drift(self, gpu: str) -> str | None:
        """How the hardware differs from what the agent last applied, or None."""
        return self._drift.get(gpu)

    async def remember(self, gpu: str, target: Geometry) -> None:
        """``target`` (without the claims' slices) is now what ``gpu`` should show."""
        record: dict[str, Any] = {"geometry": self.static(gpu, target).to_dict(),
                                  "boot_id": boot_id(self._proc_root)}
        found = next((g for g in self._inventory.gpus if g.uuid == gpu), None)
        energy = await self._devices.energy_mj(found) if found is not None else None
        if energy is not None:
            record["energy_mj"] = energy
        await self.records.set(gpu, record)
        self._clear(gpu)

    def static(self, gpu: str, geometry: Geometry) -> Geometry:
        """The geometry without the claims' on-demand slices."""
        dynamic = self._ledger.on_demand(gpu)
        if not dynamic:
            return geometry
        return Geometry(mig_enabled=geometry.mig_enabled, instances=tuple(
            i for i in geometry.instances if (i.profile, i.placement) not in dynamic))

    async def reconcile(self, request: Reapply, *, reset: frozenset[str] = frozenset()) -> None:
        """At start-up: re-apply after a reboot or driver reload emptied a GPU; report (never
        overwrite) a change made behind the agent's back. ``reset``: GPUs the agent knows were
        just reset (the simulator's reset), emptied as by a reload."""
        for gpu in self._inventory.gpus:
            record = self.records.get(gpu.uuid)
            if not gpu.static.mig_capable or record is None or \
                    self._ledger.quarantined(gpu.uuid):
                continue
            want, actual = await self._compare(gpu, record)
            if actual is None:
                continue
            rebooted = record.get("boot_id") != boot_id(self._proc_root) or \
                gpu.uuid in reset or await self._reloaded(gpu, record)
            if rebooted and not actual.instances and self._reapply:
                self._events.append("mig.reapply", f"GPU {gpu.index}: the node rebooted or "
                                    f"the driver reloaded; re-applying {layout(want)}",
                                    gpu=gpu.uuid)
                try:
                    await request(gpu, DesiredInstances(tuple((i.profile, i.placement)
                                                              for i in want.instances)))
                except (Conflict, GeometryNotPlaceable, CheckpointUnusable) as err:
                    self._set(gpu, f"re-applying failed: {err.detail}")
                continue
            self._set(gpu, f"hardware shows {layout(actual)}, the agent last applied "
                           f"{layout(want)}; left as it is")

    async def _reloaded(self, gpu: Gpu, record: dict[str, Any]) -> bool:
        """Whether the driver was reloaded since ``record`` was written: the GPU's energy
        counter only grows while one driver stays loaded. Unknown (no counter, or a record
        from before it was kept) is not a reload: the change is reported, never re-applied."""
        recorded = record.get("energy_mj")
        if not isinstance(recorded, int) or isinstance(recorded, bool):
            return False
        now = await self._devices.energy_mj(gpu)
        return now is not None and now < recorded

    async def check_drift(self) -> None:
        """The periodic part of :meth:`reconcile`: report GPUs changed behind our back."""
        for gpu in self._inventory.gpus:
            record = self.records.get(gpu.uuid)
            if record is None or self._ledger.busy(gpu.uuid) or not gpu.static.mig_capable:
                continue
            want, actual = await self._compare(gpu, record)
            if actual is not None:
                self._set(gpu, f"hardware shows {layout(actual)}, the agent last applied "
                               f"{layout(want)}; left as it is")

    async def _compare(self, gpu: Gpu, record: dict[str, Any]) -> tuple[Geometry,
                                                                         Geometry | None]:
        """What the GPU should show, and what it shows when that differs (None: it matches,
        and any drift mark is cleared)."""
        want = Geometry.from_dict(record["geometry"])
        actual = self.static(gpu.uuid, (await self._devices.current(gpu))[0])
        if actual.mig_enabled == want.mig_enabled and actual.same_layout(want):
            self._clear(gpu.uuid)
            return want, None
        return want, actual

    def _set(self, gpu: Gpu, reason: str) -> None:
        self._metrics.mig_geometry_drift.labels(gpu.uuid).set(1)
        if self._drift.get(gpu.uuid) != reason:
            self._drift[gpu.uuid] = reason
            self._events.append("mig.drift", f"GPU {gpu.index}: MIG geometry changed behind "
                                f"the agent's back: {reason}", severity=Severity.WARNING,
                                gpu=gpu.uuid)

    def _clear(self, gpu: str) -> None:
        self._metrics.mig_geometry_drift.labels(gpu).set(0)
        self._drift.pop(gpu, None)
