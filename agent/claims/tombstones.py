"""Late retries refused: an unprepared claim's UID is remembered for a window, durably (in the
checkpoint, bounded in count, oldest dropped first) for claims that were prepared, in memory
only for UIDs this agent never prepared, so unpreparing unknown claims costs nothing durable.
A prepare stamped (``issued_at_ns``, CLOCK_BOOTTIME of this boot) after every unprepare of its
claim supersedes them; one stamped at or before, or unstamped, is a late retry."""

from __future__ import annotations

import time
from collections import OrderedDict

from agent.claims.checkpoint import ClaimCheckpoint
from agent.errors import ClaimUnprepared

MAX_TOMBSTONES = 4096

#: A claim's durable and in-memory tombstones (time, stamp), to put back when a prepare that
#: superseded them fails.
Saved = tuple[tuple[float, int] | None, tuple[float, int] | None]


class Tombstones:
    def __init__(self, checkpoint: ClaimCheckpoint, window_s: float) -> None:
        self._checkpoint = checkpoint
        self._window_s = window_s
        self._unknown: OrderedDict[str, float] = OrderedDict()
        self._unknown_stamps: dict[str, int] = {}

    def refuse_late_retry(self, uid: str, issued_at_ns: int | None) -> bool:
        """Raise :class:`ClaimUnprepared` for a late retry; True when the claim has tombstones
        that this prepare, stamped after all of them, supersedes (drop them with
        :meth:`drop` in the commit that makes the claim durable)."""
        self._checkpoint.prune_tombstones(self._window_s)
        cutoff = time.time() - self._window_s
        while self._unknown and next(iter(self._unknown.values())) < cutoff:
            old, _ = self._unknown.popitem(last=False)
            self._unknown_stamps.pop(old, None)
        data = self._checkpoint.data
        # (unprepared at, its stamp) from the durable tombstone and the in-memory one.
        found = [(at, stamps.get(uid)) for tombstones, stamps in (
            (data.tombstones, data.tombstone_stamps), (self._unknown, self._unknown_stamps))
            if (at := tombstones.get(uid)) is not None]
        if not found:
            return False
        unprepared_at = max(at for at, _ in found)
        stamps = [stamp for _, stamp in found]
        if issued_at_ns is not None and None not in stamps:
            newest = max(stamp for stamp in stamps if stamp is not None)
            if issued_at_ns > newest:
                return True
            raise ClaimUnprepared(
                f"claim {uid} was unprepared by a request stamped {newest} ns; this prepare, "
                f"stamped {issued_at_ns} ns, was issued before that: a late retry cannot "
                "bring it back", claim=uid)
        raise ClaimUnprepared(
            f"claim {uid} was unprepared {time.time() - unprepared_at:.0f} s ago; a late "
            "prepare retry cannot bring it back (a prepare stamped with issued_at_ns after "
            "a stamped unprepare can)", claim=uid)

    def save(self, uid: str) -> Saved:
        data = self._checkpoint.data
        durable = (data.tombstones[uid], data.tombstone_stamps[uid]) \
            if uid in data.tombstones and uid in data.tombstone_stamps else None
        memory = (self._unknown[uid], self._unknown_stamps[uid]) \
            if uid in self._unknown and uid in self._unknown_stamps else None
        return durable, memory

    def restore(self, uid: str, saved: Saved) -> None:
        durable, memory = saved
        data = self._checkpoint.data
        if durable is not None and uid not in data.tombstones:
            data.tombstones[uid], data.tombstone_stamps[uid] = durable
        if memory is not None and uid not in self._unknown:
            self._unknown[uid], self._unknown_stamps[uid] = memory

    def drop(self, uid: str) -> None:
        """The claim is prepared anew: its tombstones go (durably with the next commit)."""
        self._checkpoint.drop_tombstone(uid)
        self._unknown.pop(uid, None)
        self._unknown_stamps.pop(uid, None)

    def unprepared(self, uid: str, issued_at_ns: int | None) -> None:
        """A prepared claim is being unprepared: remembered durably with the next commit."""
        self._checkpoint.tombstone(uid, issued_at_ns)
        self._checkpoint.cap_tombstones(MAX_TOMBSTONES)

    def unprepared_unknown(self, uid: str, issued_at_ns: int | None) -> None:
        """A claim this agent does not hold was unprepared: remembered in memory only."""
        self._unknown.pop(uid, None)
        self._unknown[uid] = time.time()
        if issued_at_ns is None:
            self._unknown_stamps.pop(uid, None)
        else:
            self._unknown_stamps[uid] = max(issued_at_ns,
                                            self._unknown_stamps.get(uid, issued_at_ns))
        while len(self._unknown) > MAX_TOMBSTONES:
            old, _ = self._unknown.popitem(last=False)
            self._unknown_stamps.pop(old, None)
