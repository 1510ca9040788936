"""The metrics collector: a timer thread that reads every GPU and MIG GPU instance through
NVML, renders the DCGM families, and publishes the result as one immutable snapshot.

A scrape serves the latest snapshot and never calls NVML. Each GPU is read on a worker of
the collector's own pool (one per GPU), never the API's read pool, so a GPU whose NVML calls
hang delays neither the API nor the other GPUs: its round is abandoned after one interval
and it is skipped until that read returns. A round succeeds when at least one GPU answered
(a lost GPU answers too); ``/readyz`` turns unready when none succeeded for three intervals.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from agent.gpu.inventory import GpuInventory
from agent.gpu.session import NvmlSession
from agent.gpu.telemetry import GpuReading, GpuTelemetry
from agent.gpu.types import Gpu, GpuStatic
from agent.gpu.xid import XidEvent
from agent.metrics.agent import AgentMetrics
from agent.metrics.exposition import (
    EMPTY,
    CachedBlock,
    DeviceSeries,
    Value,
    XidSeries,
    labels_text,
    render,
)
from agent.metrics.fields import DRIVER_VERSION_LABEL, MIG_FIELDS
from agent.metrics.health import GpuHealth

log = logging.getLogger("agent.metrics.collector")

#: /readyz fails when no round succeeded for this many intervals.
STALE_INTERVALS = 3
# A wake-up (an XID) collects at once, but not sooner than this after the previous round.
_MIN_GAP_S = 0.25
_STOP_WAIT_S = 2.0
HOSTNAME_LABELS = ("Hostname", "hostname")

#: (GPU UUID, GPU instance id or None for the whole GPU) -> attribution labels (for claims,
#: ``agent.claims.attribution.claim_attribution`` makes them).
Attribution = Mapping[tuple[str, int | None], Mapping[str, str]]
#: The same key -> the label sets of every container holding the device, from kubelet's
#: PodResources API (``agent.podresources``): each gets a series of its own.
Holders = Mapping[tuple[str, int | None], Sequence[Mapping[str, str]]]


@dataclass(frozen=True)
class ShareSeries:
    """A claim's counted share of a GPU's memory, served as a series of the GPU of its own:
    the claim's attribution labels, the share, and the memory its MPS clients use (None: not
    readable). ``holder_match``: the PodResources labels that pick the claim's containers
    (``dra_claim_namespace``, ``dra_claim_name``); empty, none are merged in."""

    labels: Mapping[str, str]
    share_mib: int
    used_mib: int | None
    holder_match: Mapping[str, str] = field(default_factory=dict)


#: GPU UUID -> the counted shares of its memory (``agent.claims.attribution.share_attribution``).
Shares = Mapping[str, Sequence[ShareSeries]]
#: The framebuffer fields a share's series carries as its own (used, free of the share), and
#: the one it leaves out (the driver's reservation is no share's).
_FB_USED, _FB_FREE, _FB_RESERVED = ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
                                    "DCGM_FI_DEV_FB_RESERVED")


@dataclass(frozen=True)
class Snapshot:
    """One collection round. ``block`` is the rendered DCGM families (and their gzip)."""

    taken_at: float
    duration_s: float
    block: CachedBlock
    readings: Mapping[str, GpuReading] = field(default_factory=dict)
    series: int = 0


EMPTY_SNAPSHOT = Snapshot(taken_at=0.0, duration_s=0.0, block=EMPTY)


class Collector:
    """See the module docstring. ``start`` runs the first round before returning, so an
    agent that reports ready already has metrics."""

    def __init__(self, *, session: NvmlSession, inventory: GpuInventory, metrics: AgentMetrics,
                 health: GpuHealth, interval_s: float, hostname: str,
                 hostname_label: str = "Hostname",
                 attribution: Callable[[], Attribution] | None = None,
                 holders: Callable[[], Holders] | None = None,
                 shares: Callable[[], Shares] | None = None) -> None:
        if hostname_label not in HOSTNAME_LABELS:
            raise ValueError(f"hostname label must be one of {HOSTNAME_LABELS}")
        self._session = session
        self._inventory = inventory
        self._metrics = metrics
        self._health = health
        self.interval_s = interval_s
        self._hostname = (hostname_label, hostname)
        self._attribution = attribution
        self._holders = holders
        self._shares = shares
        self._readers: dict[str, GpuTelemetry] = {}
        self._inflight: dict[str, Future[GpuReading]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._started_at: float | None = None
        self._last_success: float | None = None
        self._last_round = 0.0
        self.snapshot = EMPTY_SNAPSHOT
        metrics.collection_interval.set(interval_s)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Run the first round (in a thread), then keep collecting on the timer thread."""
        if self._thread is not None:
            return
        self._started_at = time.monotonic()
        self._pool = ThreadPoolExecutor(max(1, len(self._inventory.gpus)),
                                        thread_name_prefix="collect")
        self._health.track(g.static for g in self._inventory.gpus)
        await asyncio.to_thread(self.collect)
        self._thread = threading.Thread(target=self._loop, name="collector", daemon=True)
        self._thread.start()
        log.info("metrics collector started", extra={"interval_s": self.interval_s,
                                                     "series": self.snapshot.series})

    def stop(self) -> None:
        """Stop the timer thread; reads still hung in NVML are abandoned, not joined."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            # A round in progress may wait up to an interval on a hung GPU; do not hold the
            # shutdown for it (the thread is a daemon and touches nothing durable).
            self._thread.join(_STOP_WAIT_S)
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for uuid, reader in self._readers.items():
            if uuid not in self._inflight:
                reader.close()

    def wake(self) -> None:
        """Collect now rather than at the next tick (e.g. after an XID)."""
        self._wake.set()

    def on_xid(self, event: XidEvent) -> None:
        """The XID watcher's callback: record the XID and show it without waiting a tick."""
        self._health.record_xid(event)
        self.wake()

    def reads_in_nvml(self) -> list[str]:
        """The UUIDs of the GPUs whose abandoned read is still in NVML (each skipped until
        its read returns)."""
        return [uuid for uuid, read in list(self._inflight.items()) if not read.done()]

    def stale_reason(self) -> str | None:
        """Why the metrics are stale (for /readyz), or None."""
        if self._started_at is None:
            return None
        since = self._last_success if self._last_success is not None else self._started_at
        age = time.monotonic() - since
        if age <= STALE_INTERVALS * self.interval_s:
            return None
        return (f"no successful metrics collection for {age:.1f}s (more than "
                f"{STALE_INTERVALS} collect intervals of {self.interval_s:g}s)")

    def _loop(self) -> None:
        next_at = time.monotonic() + self.interval_s
        while not self._stop.is_set():
            woken = self._wake.wait(max(0.0, next_at - time.monotonic()))
            if self._stop.is_set():
                return
            now = time.monotonic()
            if woken:
                self._wake.clear()
                gap = self._last_round + _MIN_GAP_S - now
                if gap > 0 and self._wake.wait(gap) and self._stop.is_set():
                    return
                self._wake.clear()
            else:
                next_at += self.interval_s
                if next_at < now:  # a slow round: skip ticks rather than run back to back
                    next_at = now + self.interval_s
            try:
                self.collect()
            except Exception:
                # Never let the timer die: a stale timestamp then tells the story.
                log.exception("metrics collection failed")

    # -- one round -------------------------------------------------------------------------

    def collect(self) -> Snapshot:
        """Read every GPU in parallel, render, publish; return the new snapshot."""
        started = time.perf_counter()
        self._last_round = time.monotonic()
        gpus = self._inventory.gpus
        readings = self._read_all(gpus)
        self._health.check()
        attribution = self._current_attribution()
        holders = self._holders() if self._holders is not None else {}
        shares = self._current_shares()
        devices, xids = self._series(gpus, readings, attribution, holders, shares)
        block = CachedBlock(render(devices, xids))
        duration = time.perf_counter() - started
        snapshot = Snapshot(taken_at=time.time(), duration_s=duration, block=block,
                            readings=readings,
                            series=sum(len(d.values) for d in devices) + len(xids))
        self.snapshot = snapshot
        self._metrics.collection_duration.observe(duration)
        if not gpus or any(r.error is None or r.lost for r in readings.values()):
            self._last_success = time.monotonic()
            self._metrics.last_collection.set(snapshot.taken_at)
        return snapshot

    def _read_all(self, gpus: Sequence[Gpu]) -> dict[str, GpuReading]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, len(gpus)), thread_name_prefix="collect")
        readings: dict[str, GpuReading] = {}
        started: dict[str, Future[GpuReading]] = {}
        for gpu in gpus:
            lost = self._session.lost_reason(gpu.uuid)
            if lost is not None:
                # Not read again: a lost GPU only comes back through a reset and an agent
                # restart (agent/metrics/health.py), and its calls can hang for seconds.
                readings[gpu.uuid] = GpuReading(error=f"GPU is lost: {lost}", lost=True)
                continue
            busy = self._inflight.get(gpu.uuid)
            if busy is not None and not busy.done():
                readings[gpu.uuid] = GpuReading(error="the previous NVML read of this GPU has "
                                                      "not returned")
                continue
            self._inflight.pop(gpu.uuid, None)
            started[gpu.uuid] = self._pool.submit(self._reader(gpu).read)
        wait(started.values(), timeout=self.interval_s)
        for uuid, future in started.items():
            if not future.done():
                self._inflight[uuid] = future
                readings[uuid] = GpuReading(
                    error=f"NVML read did not return within {self.interval_s:g}s")
                log.warning("gpu read timed out", extra={"gpu": uuid})
                continue
            try:
                readings[uuid] = future.result()
            except Exception as err:
                log.exception("gpu read failed", extra={"gpu": uuid})
                readings[uuid] = GpuReading(error=str(err))
        return readings

    def _reader(self, gpu: Gpu) -> GpuTelemetry:
        reader = self._readers.get(gpu.uuid)
        if reader is None:
            reader = GpuTelemetry(self._session, gpu.static, gpu.profiles)
            self._readers[gpu.uuid] = reader
        return reader

    def _current_attribution(self) -> Attribution:
        if self._attribution is None:
            return {}
        try:
            return self._attribution()
        except Exception:
            # Claims change on the event loop while this thread reads them; try next round.
            log.debug("attribution unavailable this round", exc_info=True)
            return {}

    def _current_shares(self) -> Shares:
        if self._shares is None:
            return {}
        try:
            return self._shares()
        except Exception:
            log.debug("share attribution unavailable this round", exc_info=True)
            return {}

    # -- rendering -------------------------------------------------------------------------

    def _series(self, gpus: Sequence[Gpu], readings: Mapping[str, GpuReading],
                attribution: Attribution, holders: Holders | None = None,
                shares: Shares | None = None) -> tuple[list[DeviceSeries], list[XidSeries]]:
        driver = self._inventory.driver.driver_version if self._inventory.loaded else ""
        tail = [self._hostname, (DRIVER_VERSION_LABEL, driver)]
        devices: list[DeviceSeries] = []
        xids: list[XidSeries] = []
        for gpu in gpus:
            head = _device_labels(gpu.static)
            last = self._health.last_xid(gpu.uuid)
            xid = (last.xid, last.message) if last else (0, "No Error")
            reading = readings.get(gpu.uuid)
            migs = reading.mig if reading is not None and reading.error is None else ()
            memory_shares = (shares or {}).get(gpu.uuid, ())
            if not migs and memory_shares:
                # A GPU shared by memory: a series per share, each with its claim's own
                # framebuffer use (its MPS clients'), so memory is attributed per claim.
                for share in memory_shares:
                    for attrs in _share_attributions(share, holders, (gpu.uuid, None)):
                        gpu_labels = labels_text([*head, *tail, *attrs])
                        xids.append(XidSeries(gpu_labels, *xid))
                        if reading is not None and reading.error is None:
                            devices.append(DeviceSeries(gpu_labels,
                                                        _share_values(reading.values, share)))
                continue
            if not migs:
                for attrs in _attributions(attribution, holders, (gpu.uuid, None)):
                    gpu_labels = labels_text([*head, *tail, *attrs])
                    xids.append(XidSeries(gpu_labels, *xid))
                    if reading is not None and reading.error is None:
                        devices.append(DeviceSeries(gpu_labels, reading.values))
                continue
            # dcgm-exporter's default ("flex") mode: a GPU with GPU instances is served as
            # its instances only, each repeating the whole-GPU readings DCGM takes from the
            # parent (power, temperatures, clocks, energy, errors) next to its own.
            assert reading is not None
            shared = {k: v for k, v in reading.values.items() if k not in MIG_FIELDS}
            for mig in migs:
                for mig_attrs in _attributions(attribution, holders, (gpu.uuid, mig.gi_id)):
                    labels = labels_text([*head, ("GPU_I_PROFILE", mig.profile),
                                          ("GPU_I_ID", str(mig.gi_id)), *tail, *mig_attrs])
                    xids.append(XidSeries(labels, *xid))
                    devices.append(DeviceSeries(labels, {**shared, **mig.values}))
        return devices, xids


def _attributions(attribution: Attribution, holders: Holders | None,
                  key: tuple[str, int | None]) -> list[list[tuple[str, str]]]:
    """The sorted attribution labels of each series of one device: one per container kubelet
    says holds it (its pod labels over the claim's), else the one of the agent's claim (or
    none). A device two containers share thus has a series for each, so a dashboard
    filtered on either pod shows it (docs/metrics.md, "Pod attribution")."""
    own = attribution.get(key, {})
    held = holders.get(key, ()) if holders else ()
    if not held:
        return [sorted(own.items())]
    return [sorted({**own, **labels}.items()) for labels in held]


def _share_attributions(share: ShareSeries, holders: Holders | None,
                        key: tuple[str, int | None]) -> list[list[tuple[str, str]]]:
    """The sorted labels of each series of one share: one per container of its claim that
    kubelet says holds the GPU (picked by ``holder_match``), else the claim's own."""
    held = [h for h in (holders.get(key, ()) if holders and share.holder_match else ())
            if all(h.get(k) == v for k, v in share.holder_match.items())]
    if not held:
        return [sorted(share.labels.items())]
    return [sorted({**share.labels, **labels}.items()) for labels in held]


def _share_values(values: Mapping[str, Value], share: ShareSeries) -> dict[str, Value]:
    """The GPU's readings as one share's: framebuffer used is its clients', free what is left
    of its share; both left out when its use is unknown, and the reservation always."""
    own = {k: v for k, v in values.items() if k not in (_FB_USED, _FB_FREE, _FB_RESERVED)}
    if share.used_mib is not None:
        own[_FB_USED] = share.used_mib
        own[_FB_FREE] = max(0, share.share_mib - share.used_mib)
    return own


def _device_labels(static: GpuStatic) -> list[tuple[str, str]]:
    """dcgm-exporter's leading labels; ``gpu`` is the DCGM GPU id, which is NVML's index."""
    return [("gpu", str(static.index)), ("UUID", static.uuid),
            ("pci_bus_id", static.pci_bus_id), ("device", f"nvidia{static.index}"),
            ("modelName", static.name)]
