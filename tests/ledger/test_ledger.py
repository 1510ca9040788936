"""The per-GPU ledger as a specification: one key space, holds that never overlap, shares
within capacity, the transition's ownership and marks, and one availability answer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.errors import Conflict, DeviceBusy, DeviceUnavailable
from agent.events import EventLog
from agent.gpu.types import Fabric, Gpu, GpuStatic, Health, MigDevice, MigMode, Placement
from agent.health.taints import Fault
from agent.ledger.keys import DeviceKey
from agent.ledger.ledger import Hold, NodeLedger, Share

A, B = "GPU-a", "GPU-b"


HEALTHY = Health(True)


def _gpu(uuid: str = A, *, index: int = 0, mig_capable: bool = True,
         health: Health = HEALTHY) -> Gpu:
    static = GpuStatic(index=index, minor=index, uuid=uuid, name="NVIDIA H100 80GB HBM3",
                       brand="nvidia", architecture="hopper", cuda_compute_capability="9.0",
                       pci_bus_id=f"00000000:0{index}:00.0", pci_device_id=0, pci_subsystem_id=0,
                       memory_total_mib=81559, numa_node=0, cpu_affinity="0-7",
                       mig_capable=mig_capable)
    return Gpu(static=static, mig_mode=MigMode(True, True), mig_devices=(), health=health)


def _device(start: int, size: int) -> MigDevice:
    return MigDevice(index=0, uuid=f"MIG-{start}", profile="1g.10gb", gi_id=9, ci_id=0,
                     placement=Placement(start, size), memory_mib=9856, multiprocessors=16)


def _ledger(tmp_path: Path, **kwargs: object) -> NodeLedger:
    return NodeLedger(quarantine_path=tmp_path / "quarantine.json", events=EventLog(),
                      **kwargs)  # type: ignore[arg-type]


WHOLE = None
CONFLICTS = [
    # (gpu, placement) x (gpu, placement) -> conflict?
    ((A, WHOLE), (A, WHOLE), True),
    ((A, WHOLE), (A, (0, 1)), True),  # the whole GPU overlaps everything on it
    ((A, (0, 4)), (A, (3, 1)), True),  # a 3g and a 1g inside it
    ((A, (0, 4)), (A, (4, 4)), False),  # adjacent halves
    ((A, (2, 2)), (A, (2, 2)), True),  # an existing MIG device and a slice at the same place
    ((A, WHOLE), (B, WHOLE), False),
    ((A, (0, 8)), (B, (0, 8)), False),
]


@pytest.mark.parametrize(("one", "other", "conflict"), CONFLICTS)
def test_keys_conflict_when_they_share_memory_slices(one: tuple, other: tuple,
                                                     conflict: bool) -> None:
    """Two keys conflict exactly when they are on one GPU and either is the whole GPU or
    their slices overlap (in both orders)."""
    def key(spec: tuple) -> DeviceKey:
        gpu, placement = spec
        return DeviceKey(gpu, None if placement is None else Placement(*placement))
    assert key(one).conflicts(key(other)) is conflict
    assert key(other).conflicts(key(one)) is conflict


def test_a_device_is_held_once_and_a_share_only_within_capacity(tmp_path: Path) -> None:
    """An exclusive hold refuses every overlapping hold of another claim, naming it; a
    repeat of the same hold is a no-op; shares of one device add up to its capacity."""
    ledger = _ledger(tmp_path)
    slot = DeviceKey(A, Placement(0, 2))
    ledger.take(Hold("c1", slot), name="gpu-0-mig")
    ledger.take(Hold("c1", slot), name="gpu-0-mig")
    with pytest.raises(DeviceBusy, match="c1") as caught:
        ledger.take(Hold("c2", DeviceKey(A)), name="gpu-0")
    assert list(caught.value.holders) == ["c1"]
    whole = DeviceKey(B)
    memory = {"memory_mib": 40000}
    ledger.take(Hold("s1", whole, shares=(Share("memory_mib", 20000),)), name="b", capacity=memory)
    ledger.take(Hold("s2", whole, shares=(Share("memory_mib", 20000),)), name="b", capacity=memory)
    with pytest.raises(DeviceBusy):
        ledger.take(Hold("s3", whole, shares=(Share("memory_mib", 1),)), name="b",
                    capacity=memory)
    with pytest.raises(DeviceBusy):  # an exclusive claim never joins shares
        ledger.take(Hold("x", whole), name="b")
    assert ledger.holders(DeviceKey(A)) == ("c1",)


@given(st.lists(st.tuples(st.sampled_from(["c1", "c2", "c3"]),
                          st.one_of(st.none(), st.tuples(st.integers(0, 7),
                                                         st.sampled_from([1, 2, 4, 8]))))))
def test_no_two_claims_ever_hold_overlapping_devices(takes: list) -> None:
    """Whatever order claims take devices in, the holds left never overlap between claims."""
    ledger = NodeLedger(quarantine_path=Path("/nonexistent/q.json"), events=EventLog())
    for holder, placement in takes:
        spec = None if placement is None else Placement(placement[0], min(placement[1],
                                                                          8 - placement[0]))
        with contextlib.suppress(DeviceBusy):
            ledger.take(Hold(holder, DeviceKey(A, spec)), name="d")
    holds = ledger.holds(A)
    for i, one in enumerate(holds):
        for other in holds[i + 1:]:
            assert one.holder == other.holder or not one.key.conflicts(other.key)


def test_releasing_holds_still_keep_others_off_but_no_longer_block_changes(
        tmp_path: Path) -> None:
    """A claim being unprepared keeps its device from others until it is gone, and stops
    counting among the holds a transition must keep or wait for."""
    ledger = _ledger(tmp_path)
    key = DeviceKey(A, Placement(4, 4))
    ledger.take(Hold("c1", key, profile="3g.40gb"), name="d")
    ledger.settle("c1")
    assert [h.state for h in ledger.holds(A)] == ["prepared"]
    ledger.settle("c1", "releasing")
    assert ledger.keeping(A) == []
    with pytest.raises(DeviceBusy):
        ledger.take(Hold("c2", key), name="d")
    ledger.release("c1")
    ledger.take(Hold("c2", key), name="d")


def test_availability_is_one_answer(tmp_path: Path) -> None:
    """Lost, unhealthy (the XID), quarantined and a transition's marks make a device
    unavailable, each with its reason; holders are reported beside them."""
    xids = {A: (Fault("xid", "XID 48: Double Bit ECC Error", 1.0, value="48"),),
            B: (Fault("gpu-lost", "GPU is lost: GPU_IS_LOST", 1.0),)}
    ledger = _ledger(tmp_path, faults=lambda g: xids.get(g, ()))
    gpu_a, gpu_b = _gpu(A), _gpu(B, index=1)
    assert ledger.availability(gpu_a).reasons == ("XID 48: Double Bit ECC Error",)
    assert ledger.availability(gpu_b).reasons == ("GPU is lost: GPU_IS_LOST",)
    with pytest.raises(DeviceUnavailable, match="XID 48"):
        ledger.check_usable(gpu_a)
    xids.clear()
    device = _device(2, 1)
    ledger.name_transition(A, "t1", drain=[device.placement])
    with pytest.raises(DeviceBusy, match="drained by MIG transition t1"):
        ledger.check_usable(gpu_a, device)
    ledger.name_transition(A, "t1", create=[device.placement])
    assert "being created by MIG transition t1" in ledger.availability(gpu_a, device).reasons[0]
    ledger.end_transition(A, changed=False)
    ledger.take(Hold("c1", DeviceKey(A, device.placement)), name="d")
    available = ledger.availability(gpu_a, device)
    assert available.reasons == () and available.holders == ("c1",) and not available.available


async def test_one_transition_owns_a_gpu_and_slices_wait_or_are_refused(tmp_path: Path) -> None:
    """While a transition owns a GPU a second one is a conflict and making a slice is
    refused; destroying one waits for the transition to end."""
    ledger = _ledger(tmp_path)
    changed: list[str] = []
    ledger.watchers.append(changed.append)
    await ledger.begin_transition(A)
    with pytest.raises(Conflict, match="being planned"):
        await ledger.begin_transition(A)
    ledger.name_transition(A, "t1")
    with pytest.raises(DeviceBusy, match="t1"):
        async with ledger.slice_change(A):
            pass
    done = asyncio.Event()

    async def destroy() -> None:
        async with ledger.slice_change(A, wait=True):
            done.set()
    waiting = asyncio.ensure_future(destroy())
    await asyncio.sleep(0)  # one turn: the new task runs until it waits for the GPU
    assert not done.is_set()
    ledger.end_transition(A, changed=True)
    await waiting
    assert done.is_set() and changed == [A, A]


async def test_unreadable_quarantine_state_quarantines_every_mig_gpu(tmp_path: Path) -> None:
    """Which GPUs were quarantined can no longer be known: every MIG-capable GPU is, durably,
    until an operator clears each; a GPU without MIG is not."""
    (tmp_path / "quarantine.json").write_bytes(b"{torn")
    ledger = _ledger(tmp_path)
    await ledger.register([_gpu(A), _gpu(B, index=1, mig_capable=False)])
    assert "unreadable" in (ledger.quarantined(A) or "")
    assert ledger.quarantined(B) is None
    again = _ledger(tmp_path)  # a restart reads the marks written at the first
    await again.register([_gpu(A), _gpu(B, index=1, mig_capable=False)])
    assert again.quarantined(A) is not None
    assert "unreadable" in await again.clear_quarantine(A)
    third = _ledger(tmp_path)
    await third.register([_gpu(A)])
    assert third.quarantined(A) is None


@given(st.lists(st.tuples(st.sampled_from(["c1", "c2", "c3", "m1", "m2"]),
                          st.one_of(st.none(), st.tuples(st.integers(0, 7),
                                                         st.sampled_from([1, 2, 4, 8]))))))
def test_admin_holds_are_never_refused_and_never_refuse(takes: list) -> None:
    """Claims m1/m2 take admin holds: every one of them is granted whatever else is held,
    none keeps an exclusive claim off its device, none counts as a holder or as a hold a
    geometry change must keep, and settling keeps their kind."""
    ledger = NodeLedger(quarantine_path=Path("/nonexistent/q.json"), events=EventLog())
    refused: list[tuple[str, DeviceKey]] = []
    for holder, placement in takes:
        spec = None if placement is None else Placement(placement[0], min(placement[1],
                                                                          8 - placement[0]))
        key = DeviceKey(A, spec)
        admin = holder.startswith("m")
        try:
            ledger.take(Hold(holder, key, admin=admin), name="d")
        except DeviceBusy:
            assert not admin, "an admin hold was refused"
            refused.append((holder, key))
    ledger.settle("m1")
    exclusive = [h for h in ledger.holds(A) if not h.admin]
    for holder, key in refused:  # refused only by an exclusive hold of another claim
        assert any(h.holder != holder and h.key.conflicts(key) for h in exclusive)
    assert {h.holder for h in ledger.holds(A) if h.admin} <= {"m1", "m2"}
    assert all(h.kind == "admin" for h in ledger.holds(A) if h.holder in ("m1", "m2"))
    assert not {"m1", "m2"} & set(ledger.holders(DeviceKey(A)))
    assert all(not h.admin for h in ledger.keeping(A))


HOLD_KINDS = [
    (Hold("c", DeviceKey(A)), "exclusive"),
    (Hold("c", DeviceKey(A), shares=(Share("memory_mib", 1),)), "share"),
    (Hold("c", DeviceKey(A), admin=True), "admin"),
]


@pytest.mark.parametrize(("hold", "kind"), HOLD_KINDS)
def test_each_hold_has_one_kind(hold: Hold, kind: str) -> None:
    """A hold is exclusive, a counted share, or an admin hold, and says which."""
    assert hold.kind == kind
    assert hold.exclusive == (kind == "exclusive")


def test_only_blocking_taints_make_a_device_unavailable(tmp_path: Path) -> None:
    """An informational fault (XID 31, unmonitored) taints the GPU with effect None and
    leaves it available; a MIG-scoped XID blocks its own instance only."""
    faults = {A: (Fault("xid", "XID 31: GPU memory page fault", 1.0, value="31"),
                  Fault("unmonitored", "no XID events", 2.0),
                  Fault("xid", "XID 48 on GI 9", 3.0, value="48", gi_id=9, ci_id=0))}
    ledger = _ledger(tmp_path, faults=lambda g: faults.get(g, ()))
    gpu = _gpu(A)
    assert [(t.key, t.effect) for t in ledger.taints(gpu)] == [
        ("gpu.nodeagent.dev/unmonitored", "None"), ("gpu.nodeagent.dev/xid", "None")]
    assert ledger.availability(gpu).available
    ledger.check_usable(gpu)
    on_gi9, on_gi2 = _device(0, 1), dataclasses.replace(_device(1, 1), gi_id=2)
    assert [(t.value, t.effect) for t in ledger.taints(gpu, on_gi9)
            if t.key.endswith("/xid")] == [("48", "NoSchedule")]
    assert ledger.availability(gpu, on_gi9).reasons == ("XID 48 on GI 9",)
    with pytest.raises(DeviceUnavailable, match="XID 48"):
        ledger.check_usable(gpu, on_gi9)
    ledger.check_usable(gpu, on_gi2)


def test_a_fabric_not_registered_makes_the_gpu_unavailable_until_it_is(tmp_path: Path) -> None:
    """The inventory's fabric as read is one of the GPU's faults: in progress blocks every
    claim (the taint's time stays while it lasts), completed again clears it, degraded
    bandwidth is informational; a GPU without fabric has no such fault."""
    ledger = _ledger(tmp_path)
    zero = "00000000-0000-0000-0000-000000000000"
    stuck = dataclasses.replace(_gpu(A), fabric=Fabric(zero, 0, 2, 0))
    (taint,) = ledger.taints(stuck)
    assert (taint.key, taint.value, taint.effect) == (
        "gpu.nodeagent.dev/fabric", "in_progress", "NoSchedule")
    with pytest.raises(DeviceUnavailable, match="NVLink fabric not registered: in_progress"):
        ledger.check_usable(stuck)
    assert ledger.taints(stuck) == (taint,)  # read again: the same taint, the same time
    healthy = dataclasses.replace(stuck, fabric=Fabric("9c6f5af3-0b6d", 7, 3, 0))
    assert ledger.taints(healthy) == ()
    ledger.check_usable(healthy)
    degraded = dataclasses.replace(healthy, fabric=Fabric("9c6f5af3-0b6d", 7, 3, 0,
                                                          health=("degraded_bandwidth",)))
    assert [(t.key, t.effect) for t in ledger.taints(degraded)] == [
        ("gpu.nodeagent.dev/fabric-health", "None")]
    ledger.check_usable(degraded)
    assert ledger.taints(_gpu(B, index=1)) == ()


async def test_a_drain_keeps_new_claims_off_held_ones_stay_and_it_is_durable(
        tmp_path: Path) -> None:
    """A drained GPU refuses new claims (a NoSchedule drain taint with the reason as its
    value) while a claim already held keeps its hold; the drain survives a new ledger (a
    restart); undraining lifts it, and undraining twice is a conflict."""
    ledger = _ledger(tmp_path)
    gpu = _gpu(A)
    await ledger.register([gpu])
    ledger.take(Hold("held", DeviceKey(A)), name="gpu-0")
    assert await ledger.drain(A, "swap the fan") is True
    assert await ledger.drain(A, "again") is False  # the first reason and time stay
    (taint,) = ledger.taints(gpu)
    assert (taint.key, taint.value, taint.effect) == ("gpu.nodeagent.dev/drain", "swap-the-fan",
                                                      "NoSchedule")
    with pytest.raises(DeviceUnavailable, match="drained: swap the fan"):
        ledger.check_usable(gpu)
    assert [h.holder for h in ledger.holds(A)] == ["held"]
    again = _ledger(tmp_path)
    await again.register([gpu])
    assert again.drained(A) == "swap the fan"
    assert again.taints(gpu)[0].time_added == taint.time_added
    assert await again.undrain(A) == "swap the fan"
    assert again.availability(gpu).available
    with pytest.raises(Conflict, match="not drained"):
        await again.undrain(A)
    third = _ledger(tmp_path)
    await third.register([gpu])
    assert third.drained(A) is None


async def test_unreadable_drain_state_drains_every_gpu(tmp_path: Path) -> None:
    """A drain file that cannot be trusted is kept aside and every GPU stays drained (new
    claims off) until an operator undrains it: which ones were meant cannot be known."""
    (tmp_path / "drain.json").write_text("{not json")
    ledger = _ledger(tmp_path)
    await ledger.register([_gpu(A), _gpu(B, index=1)])
    for uuid in (A, B):
        assert "drain state was unreadable" in (ledger.drained(uuid) or "")
    assert list(tmp_path.glob("drain.json.*"))  # noqa: ASYNC240 - kept aside for the operator
    await ledger.undrain(A)
    again = _ledger(tmp_path)
    await again.register([_gpu(A), _gpu(B, index=1)])
    assert again.drained(A) is None
    assert "unreadable" in (again.drained(B) or "")
