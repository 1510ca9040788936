"""Claims in-process over a simulated node: idempotence, exclusivity, tombstones, on-demand
slices, the checkpoint's durability rules and start-up reconciliation."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.claims.checkpoint import ClaimCheckpoint, decode
from agent.claims.requests import DeviceRequest
from agent.errors import (
    CheckpointUnusable,
    ClaimUnprepared,
    Conflict,
    DeviceBusy,
    DeviceUnavailable,
    InvalidRequest,
    NoSliceRoom,
)
from agent.gpu.inventory import GpuInventory
from agent.mig.geometry import DesiredDisabled, DesiredProfiles
from agent.mig.transition import DrainPolicy, TransitionState
from tests.service_node import ServiceNode, open_services
from tests.waiting import until

DATA = Path(__file__).resolve().parents[1] / "data"


def gpu(ref: str, name: str = "gpu") -> DeviceRequest:
    return DeviceRequest(request=name, kind="gpu", device=ref)


def slice_(profile: str, gpu_ref: str | None = None, start: int | None = None) -> DeviceRequest:
    return DeviceRequest(request="slice", kind="slice", profile=profile, gpu=gpu_ref, start=start)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[ServiceNode]:
    opened = await open_services(tmp_path)
    yield opened
    await opened.close()


async def test_prepare_is_idempotent_and_exclusive(node: ServiceNode) -> None:
    first = await node.claims.prepare("c1", [gpu("0")], {"namespace": "ns"})
    again = await node.claims.prepare("c1", [gpu("0")], {"namespace": "ns"})
    assert again is first
    assert first.devices[0].device_name == "gpu-0"
    assert first.devices[0].cdi_device == "k8s.gpu.nodeagent.dev/claim=c1-gpu-0"
    with pytest.raises(DeviceBusy, match="held by claim c1"):
        await node.claims.prepare("c2", [gpu((await node.gpu(0)).uuid)], {})
    with pytest.raises(Conflict, match="other devices"):
        await node.claims.prepare("c1", [gpu("1")], {})
    assert (node.cdi_dir / "k8s.gpu.nodeagent.dev-claim_c1.json").exists()


async def test_concurrent_prepares_of_one_device_one_wins(node: ServiceNode) -> None:
    results = await asyncio.gather(*(node.claims.prepare(f"c{i}", [gpu("gpu-3")], {})
                                     for i in range(8)), return_exceptions=True)
    assert sum(not isinstance(r, BaseException) for r in results) == 1
    assert all(isinstance(r, DeviceBusy) for r in results if isinstance(r, BaseException))


async def test_unprepare_unknown_is_fine_and_stale_retry_is_refused(node: ServiceNode) -> None:
    await node.claims.unprepare("never-prepared")
    await node.claims.prepare("c1", [gpu("1")], {})
    await node.claims.unprepare("c1")
    await node.claims.unprepare("c1")
    assert not (node.cdi_dir / "k8s.gpu.nodeagent.dev-claim_c1.json").exists()
    with pytest.raises(ClaimUnprepared):
        await node.claims.prepare("c1", [gpu("1")], {})
    # The device itself is free again for other claims.
    await node.claims.prepare("c2", [gpu("1")], {})


async def test_tombstones_expire(tmp_path: Path) -> None:
    node = await open_services(tmp_path, tombstone_s=0.0)
    try:
        await node.claims.prepare("c1", [gpu("1")], {})
        await node.claims.unprepare("c1")
        unprepared = time.time()
        # A 0 s window: the tombstone is past it once the clock has moved on.
        await until(lambda: time.time() > unprepared, "the clock to pass the unprepare")
        await node.claims.prepare("c1", [gpu("1")], {})
    finally:
        await node.close()


async def test_unknown_devices_and_profiles_are_invalid(node: ServiceNode) -> None:
    for request in (gpu("9"), gpu("MIG-nope"), gpu("gpu-0-mig-1g10gb-19-0"), slice_("9g.9gb")):
        with pytest.raises(InvalidRequest):
            await node.claims.prepare("c1", [request], {})
    assert node.claims.claims() == []


async def test_on_demand_slice_is_made_recorded_and_destroyed(node: ServiceNode) -> None:
    await node.mig_to(2, [])  # MIG on, no instances
    with pytest.raises(DeviceBusy, match="MIG enabled"):
        await node.claims.prepare("c0", [gpu("2")], {})
    record = await node.claims.prepare("c1", [slice_("3g.40gb", "2")], {"pod": "p"})
    device = record.devices[0]
    assert device.slice is not None and device.uuid and device.uuid.startswith("MIG-")
    assert device.device_name == f"gpu-2-mig-3g40gb-9-{device.slice.start}"
    gpu2 = await node.gpu(2)
    assert [d.uuid for d in gpu2.mig_devices] == [device.uuid]
    # A geometry change that would destroy the claimed slice is blocked like a held instance.
    with pytest.raises(Conflict, match="claim c1"):
        await node.mig.request(gpu2, DesiredDisabled(), DrainPolicy(), explicit_mode=True)
    # The slice is no part of the remembered geometry: no drift is reported for it.
    await node.mig.check_drift()
    assert node.mig.drift(gpu2.uuid) is None
    await node.claims.unprepare("c1")
    assert (await node.gpu(2)).mig_devices == ()


async def test_slices_pack_to_keep_room_for_large_profiles(node: ServiceNode) -> None:
    await node.mig_to(0, [])
    placed = []
    for i in range(3):
        record = await node.claims.prepare(f"s{i}", [slice_("1g.10gb", "0")], {})
        assert record.devices[0].slice is not None
        placed.append(record.devices[0].slice.start)
    # Packed into one half, so a 3g.40gb (or 4g.40gb) still fits in the other.
    assert len({p // 4 for p in placed}) == 1
    big = await node.claims.prepare("big", [slice_("3g.40gb", "0")], {})
    assert big.devices[0].slice is not None


async def test_existing_mig_device_by_every_name(node: ServiceNode) -> None:
    await node.mig_to(4, ["3g.40gb", "2g.20gb"])
    g = await node.gpu(4)
    device = next(d for d in g.mig_devices if d.profile == "3g.40gb")
    name = f"gpu-{g.static.minor}-mig-3g40gb-9-{device.placement.start}"
    for i, ref in enumerate((device.uuid, f"4:{device.index}", name)):
        record = await node.claims.prepare(f"m{i}", [gpu(ref)], {})
        assert record.devices[0].uuid == device.uuid
        assert record.devices[0].device_name == name
        await node.claims.unprepare(f"m{i}")


async def test_draining_and_unhealthy_devices_are_refused(node: ServiceNode) -> None:
    await node.mig_to(5, ["7g.80gb"])
    g5 = await node.gpu(5)
    device = g5.mig_devices[0]
    node.sim.add_process(device.uuid, pid=777)
    outcome = await node.mig.request(g5, DesiredProfiles.of(["3g.40gb"]),
                                     DrainPolicy("wait", 30))
    transition = outcome.transition
    assert transition is not None
    await until(lambda: transition.state == TransitionState.DRAINING, "the transition to drain")
    with pytest.raises(DeviceBusy, match="drained"):
        await node.claims.prepare("d1", [gpu(device.uuid)], {})
    await node.mig.cancel(outcome.transition.id)
    node.sim.inject_xid((await node.gpu(6)).uuid, 79)
    with pytest.raises(DeviceUnavailable, match=r"XID 79"):
        await node.claims.prepare("d2", [gpu("6")], {})


async def test_group_commit_needs_fewer_fsyncs_than_prepares(node: ServiceNode) -> None:
    """56 concurrent prepares (every 1g.10gb MIG device of the node) share checkpoint writes,
    and every acknowledged claim is on disk."""
    await node.mig_all(["1g.10gb"] * 7)  # the 8 GPUs at once: each has its own NVML thread
    devices = [d.uuid for g in await node.inventory.refresh() for d in g.mig_devices]
    assert len(devices) == 56
    before = node.claims.checkpoint.fsyncs
    await asyncio.gather(*(node.claims.prepare(f"g{i}", [gpu(uuid)], {})
                           for i, uuid in enumerate(devices)))
    assert node.claims.checkpoint.fsyncs - before < 56 // 2
    on_disk = decode((node.state / "claims.checkpoint").read_bytes())
    assert sorted(on_disk.claims) == sorted(f"g{i}" for i in range(56))


async def test_restart_rolls_back_half_done_prepares(tmp_path: Path) -> None:
    node = await open_services(tmp_path)
    await node.mig_to(1, [])
    node.sim.add_fault("nvmlGpuInstanceCreateComputeInstance", "NVML_ERROR_UNKNOWN")
    with pytest.raises(Exception, match="NVML_ERROR_UNKNOWN"):
        await node.claims.prepare("half", [slice_("2g.20gb", "1")], {})
    assert (await node.gpu(1)).mig_devices == ()
    assert node.claims.claims() == []
    # A crash after the record but before the GI: the record is there, the slice is not.
    record = await node.claims.prepare("done", [gpu("0")], {})
    record.state = "prepare_started"
    await node.claims.checkpoint.commit()
    (node.cdi_dir / "k8s.gpu.nodeagent.dev-claim_orphan.json").write_text("{}")
    await node.close()
    node = await open_services(tmp_path)
    try:
        assert node.claims.claims() == []
        assert sorted(p.name for p in node.cdi_dir.iterdir()
                      if not p.name.startswith(".")) == ["nodeagent.dev-gpu.json"]
        assert any(e.kind == "claim.recovered" for e in node.events.since(0))
    finally:
        await node.close()


async def test_a_reboot_marks_claims_lost(tmp_path: Path) -> None:
    node = await open_services(tmp_path)
    await node.claims.prepare("c1", [gpu("0")], {})
    node.sim.reboot()  # a new boot id
    await node.close()
    node = await open_services(tmp_path)
    try:
        assert node.claims.claim("c1").state == "lost"
        assert "rebooted" in (node.claims.claim("c1").lost_reason or "")
        # kubelet prepares it afresh after the reboot.
        assert (await node.claims.prepare("c1", [gpu("0")], {})).state == "prepare_completed"
    finally:
        await node.close()


async def test_corrupt_checkpoint_is_kept_and_freezes_claims(tmp_path: Path) -> None:
    node = await open_services(tmp_path)
    await node.claims.prepare("c1", [gpu("0")], {})
    await node.close()
    path = tmp_path / "state" / "claims.checkpoint"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x20
    path.write_bytes(bytes(data))
    node = await open_services(tmp_path)
    try:
        kept = list(path.parent.glob("claims.checkpoint.corrupt-*"))
        assert len(kept) == 1 and kept[0].read_bytes() == bytes(data)
        with pytest.raises(CheckpointUnusable, match="kept aside"):
            await node.claims.prepare("c2", [gpu("1")], {})
        assert any(e.kind == "claims.checkpoint_corrupt" for e in node.events.since(0))
    finally:
        await node.close()


def test_every_checkpoint_schema_version_loads(tmp_path: Path) -> None:
    """Fixtures of each schema version that existed, plus one from a newer agent with fields
    this one does not know: all load."""
    for fixture in sorted((DATA / "checkpoints").glob("*.checkpoint")):
        data = decode(fixture.read_bytes())
        assert data.claims, fixture.name
        copy = tmp_path / fixture.name
        shutil.copy(fixture, copy)
        checkpoint = ClaimCheckpoint(copy, data.boot_id)
        assert checkpoint.load() is None


def test_newer_fields_are_ignored() -> None:
    raw = (DATA / "checkpoints" / "v2-newer-fields.checkpoint").read_bytes()
    payload = json.loads(raw.partition(b"\n")[2])
    assert "future_field" in json.dumps(payload)
    assert decode(raw).claims["c-new"].state == "prepare_completed"


async def test_concurrent_slices_spread_instead_of_colliding(node: ServiceNode) -> None:
    """14 concurrent 1g.10gb slice prepares on two empty MIG GPUs: every one fits, so every one
    succeeds (choices made at once must not all pick the same placement)."""
    await node.mig_to(0, [])
    await node.mig_to(1, [])
    results = await asyncio.gather(*(node.claims.prepare(f"s{i}", [slice_("1g.10gb")], {})
                                     for i in range(14)), return_exceptions=True)
    assert [r for r in results if isinstance(r, BaseException)] == []
    placements = {(d.gpu, d.slice.start) for r in results if not isinstance(r, BaseException)
                  for d in r.devices if d.slice is not None}
    assert len(placements) == 14
    with pytest.raises(NoSliceRoom, match=r"no MIG-enabled GPU \(0, 1\) has room for 1g\.10gb"):
        await node.claims.prepare("s-extra", [slice_("1g.10gb")], {})


async def test_a_snapshot_out_of_date_is_caught_and_changes_nothing(node: ServiceNode) -> None:
    """Existing devices resolve against the last inventory snapshot, confirmed by NVML while
    the checkpoint is written. Someone replaces a MIG device behind the agent's back: the
    vanished one is refused (422) with nothing left behind; the new one, not in the snapshot
    yet, is found on a fresh read."""
    await node.mig_to(2, ["3g.40gb"])
    old = (await node.gpu(2)).mig_devices[0]  # the snapshot now lists it
    nvml = node.sim.nvml
    handle = nvml.nvmlDeviceGetHandleByIndex(2)
    gi = nvml.nvmlDeviceGetGpuInstanceById(handle, old.gi_id)
    nvml.nvmlComputeInstanceDestroy(nvml.nvmlGpuInstanceGetComputeInstanceById(gi, old.ci_id))
    nvml.nvmlGpuInstanceDestroy(gi)
    new_gi = nvml.nvmlDeviceCreateGpuInstance(handle, nvml.nvmlDeviceGetGpuInstanceProfileInfo(
        handle, nvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE).id)
    nvml.nvmlGpuInstanceCreateComputeInstance(new_gi, nvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    assert [d.uuid for d in node.inventory.find("2").mig_devices] == [old.uuid]  # out of date

    with pytest.raises(InvalidRequest):
        await node.claims.prepare("gone", [gpu(old.uuid)], {})
    assert "gone" not in decode((node.state / "claims.checkpoint").read_bytes()).claims
    assert not (node.cdi_dir / "k8s.gpu.nodeagent.dev-claim_gone.json").exists()

    fresh = GpuInventory(node.session)
    await fresh.load()
    new = fresh.find("2").mig_devices[0]
    assert new.uuid != old.uuid
    record = await node.claims.prepare("new", [gpu(new.uuid)], {})
    assert [d.uuid for d in record.devices] == [new.uuid]
    assert set(decode((node.state / "claims.checkpoint").read_bytes()).claims) == {"new"}
