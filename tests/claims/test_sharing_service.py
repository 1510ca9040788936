"""Sharing through the claims service, in-process over a simulated L40S node, with the
hardware tools (nvidia-smi, nvidia-cuda-mps-control) played by recording fakes: the order of
effects, what is undone and when holds are released, shares in the ledger, the checkpoint,
the CDI spec, start-up re-adoption and the daemon supervisor."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.claims.checkpoint import decode
from agent.claims.requests import DeviceRequest
from agent.claims.sharing import MpsConfig, SharingConfig, short_id
from agent.claims.sharing_runtime import DaemonSpec
from agent.errors import DeviceBusy, InvalidRequest, SharingUnavailable
from tests.claims.fake_tools import FakeMps, FakeSmi, Tools, open_node
from tests.service_node import ServiceNode

GIB = 1024


@pytest.fixture
def tools() -> Tools:
    return Tools()


@pytest.fixture
async def node(tmp_path: Path, tools: Tools) -> AsyncIterator[ServiceNode]:
    opened = await open_node(tmp_path, tools)
    yield opened
    await opened.close()


def gpu(ref: str, *, sharing: SharingConfig | None = None, memory_mib: int | None = None,
        share_id: str | None = None) -> DeviceRequest:
    return DeviceRequest(request="gpu", kind="gpu", device=ref, sharing=sharing,
                         memory_mib=memory_mib, share_id=share_id)


MPS_50 = SharingConfig("MPS", mps=MpsConfig(thread_percentage=50, pinned_mib=10 * GIB))


def checkpoint_claims(node: ServiceNode) -> dict[str, Any]:
    return decode((node.state / "claims.checkpoint").read_bytes()).model_dump()["claims"]


async def test_mps_claim_starts_one_daemon_after_exclusive_process(node: ServiceNode,
                                                                   tools: Tools) -> None:
    """An MPS claim on a full GPU sets EXCLUSIVE_PROCESS, then starts one daemon under
    <mps_root>/<short id> with its limits; unprepare stops it and resets DEFAULT."""
    uuid = (await node.gpu(0)).uuid
    record = await node.claims.prepare("c-mps", [gpu("0", sharing=MPS_50)], {})
    root = node.node.settings.mps_root / short_id("c-mps")  # type: ignore[operator]
    assert tools.smi.calls == [(uuid, "compute_mode", "EXCLUSIVE_PROCESS")]
    (spec,) = tools.mps.started
    assert (spec.root, spec.devices, spec.active_thread_percentage,
            dict(spec.pinned_limits_mib)) == (root, (uuid,), 50, {uuid: 10240})
    assert record.mps is not None and record.mps.state == "running"
    saved = checkpoint_claims(node)["c-mps"]
    assert saved["mps"]["root"] == str(root) and saved["mps"]["state"] == "running"
    assert saved["devices"][0]["sharing_state"]["compute_mode_applied"] is True
    await node.claims.unprepare("c-mps")
    assert tools.mps.stopped == [root]
    assert tools.smi.calls[-1] == (uuid, "compute_mode", "DEFAULT")
    assert node.ledger.holds(uuid) == []


async def test_mps_claim_spec_mounts_the_pipe_and_shm(node: ServiceNode) -> None:
    """The claim's CDI spec gives an MPS device the pipe directory variable and bind mounts
    of the daemon's pipe and shm directories."""
    await node.claims.prepare("c-cdi", [gpu("1", sharing=SharingConfig("MPS"))], {})
    root = node.node.settings.mps_root / short_id("c-cdi")  # type: ignore[operator]
    doc = json.loads(node.claims.cdi.claim_path("c-cdi").read_text())
    (device,) = doc["devices"]
    edits = device["containerEdits"]
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in edits["env"]
    assert {(m["hostPath"], m["containerPath"], tuple(m["options"])) for m in edits["mounts"]} \
        == {(f"{root}/pipe", "/tmp/nvidia-mps", ("rw", "nosuid", "nodev", "bind")),
            (f"{root}/shm", "/dev/shm", ("rw", "nosuid", "nodev", "bind"))}


async def test_time_slicing_sets_and_restores_the_interval(node: ServiceNode,
                                                           tools: Tools) -> None:
    """TimeSlicing sets compute mode DEFAULT, then the interval; unprepare sets it back
    to 0 and starts no daemon."""
    uuid = (await node.gpu(2)).uuid
    await node.claims.prepare("c-ts", [gpu("2", sharing=SharingConfig(
        "TimeSlicing", interval="Long"))], {})
    assert tools.smi.calls == [(uuid, "compute_mode", "DEFAULT"), (uuid, "timeslice", 3)]
    assert tools.mps.started == []
    await node.claims.unprepare("c-ts")
    assert tools.smi.calls[-1] == (uuid, "timeslice", 0)


async def test_four_10gib_shares_fit_an_l40s_and_a_fifth_is_refused(node: ServiceNode,
                                                                     tools: Tools) -> None:
    """Four claims of 10 GiB each land on one L40S (45,056 MiB shareable), each with its own
    daemon (pinned 10240 MiB, 22 % threads) and no compute mode change; a fifth is a 409
    saying what is taken and left."""
    uuid = (await node.gpu(0)).uuid
    for n in range(4):
        record = await node.claims.prepare(f"s{n}", [gpu("0", memory_mib=10 * GIB,
                                                         share_id=f"share-{n}")], {})
        assert record.devices[0].share is not None
        assert record.devices[0].share.share_id == f"share-{n}"
    assert tools.smi.calls == []
    assert len(tools.mps.running) == 4
    assert {(s.active_thread_percentage, tuple(s.pinned_limits_mib.items()))
            for s in tools.mps.started} == {(22, ((uuid, 10240),))}
    assert sorted(h.holder for h in node.ledger.holds(uuid) if h.kind == "share") == \
        ["s0", "s1", "s2", "s3"]
    with pytest.raises(DeviceBusy) as caught:
        await node.claims.prepare("s4", [gpu("0", memory_mib=10 * GIB)], {})
    assert "40960 MiB of 45056 MiB are taken by claim s0, s1, s2, s3, 4096 MiB left" in \
        caught.value.detail
    assert sorted(caught.value.holders) == ["s0", "s1", "s2", "s3"]
    assert len(tools.mps.started) == 4  # the refused one started nothing
    # A share of 4 GiB still fits; an exclusive claim of the GPU does not.
    await node.claims.prepare("s5", [gpu("0", memory_mib=4 * GIB)], {})
    with pytest.raises(DeviceBusy):
        await node.claims.prepare("x", [gpu("0")], {})


async def test_a_share_of_the_whole_gpu_is_exclusive(node: ServiceNode, tools: Tools) -> None:
    """A share of all of a GPU's shareable memory holds the whole GPU: no daemon, and no
    other share fits beside it."""
    await node.claims.prepare("all", [gpu("3", memory_mib=45056)], {})
    assert tools.mps.started == []
    (hold,) = node.ledger.holds((await node.gpu(3)).uuid)
    assert hold.kind == "exclusive"
    with pytest.raises(DeviceBusy):
        await node.claims.prepare("more", [gpu("3", memory_mib=GIB)], {})


@pytest.mark.parametrize("missing", ["smi", "mps"])
async def test_a_missing_tool_is_a_503_before_anything_changes(
        tmp_path: Path, missing: str) -> None:
    """Without nvidia-smi or the MPS binary, an MPS claim answers 503 sharing-unavailable
    naming the tool, and nothing is held, recorded or run."""
    tools = Tools(smi=FakeSmi(present=missing != "smi"), mps=FakeMps(present=missing != "mps"))
    node = await open_node(tmp_path, tools)
    try:
        with pytest.raises(SharingUnavailable) as caught:
            await node.claims.prepare("c", [gpu("0", sharing=SharingConfig("MPS"))], {})
        assert caught.value.tool == ("nvidia-smi" if missing == "smi"
                                     else "nvidia-cuda-mps-control")
        assert node.ledger.holds() == [] and "c" not in checkpoint_claims(node)
        assert tools.smi.calls == [] and tools.mps.started == []
    finally:
        await node.close()


async def test_a_daemon_that_fails_to_start_undoes_everything(node: ServiceNode,
                                                              tools: Tools) -> None:
    """A daemon that fails to start fails the prepare 503; compute mode is reset, the holds
    released and nothing stays recorded or specified."""
    uuid = (await node.gpu(0)).uuid
    tools.mps.fail_start = True
    with pytest.raises(SharingUnavailable):
        await node.claims.prepare("c", [gpu("0", sharing=MPS_50)], {})
    assert tools.smi.calls == [(uuid, "compute_mode", "EXCLUSIVE_PROCESS"),
                               (uuid, "compute_mode", "DEFAULT")]
    assert node.ledger.holds() == [] and "c" not in checkpoint_claims(node)
    assert not node.claims.cdi.claim_path("c").exists()


async def test_cleanup_that_fails_keeps_the_gpu_held(node: ServiceNode, tools: Tools) -> None:
    """When the undo of a failed prepare fails too, the claim stays recorded with why and
    keeps its hold (nobody gets the GPU in an unknown state); an unprepare that succeeds
    later frees it."""
    uuid = (await node.gpu(0)).uuid
    tools.mps.fail_start = tools.mps.fail_stop = True
    with pytest.raises(SharingUnavailable):
        await node.claims.prepare("c", [gpu("0", sharing=MPS_50)], {})
    saved = checkpoint_claims(node)["c"]
    assert saved["state"] == "prepare_started" and "could not be cleaned up" in \
        saved["lost_reason"]
    assert [h.holder for h in node.ledger.holds(uuid)] == ["c"]
    with pytest.raises(DeviceBusy):
        await node.claims.prepare("other", [gpu("0")], {})
    tools.mps.fail_stop = False
    await node.claims.unprepare("c")
    assert node.ledger.holds(uuid) == [] and "c" not in checkpoint_claims(node)


async def test_restart_adopts_live_daemons_and_reports_dead_ones(tmp_path: Path,
                                                                 tools: Tools) -> None:
    """After a restart, a claim whose daemon still runs is adopted as it runs (not started
    again); one whose daemon died is reported failed (event, mps.state) and keeps its holds
    and its shares."""
    node = await open_node(tmp_path, tools)
    await node.claims.prepare("live", [gpu("0", memory_mib=10 * GIB)], {})
    await node.claims.prepare("dead", [gpu("0", memory_mib=20 * GIB)], {})
    await node.close()
    dead_root = next(r for r in tools.mps.running if r.name == short_id("dead"))
    del tools.mps.running[dead_root]
    node = await open_node(tmp_path, tools)
    try:
        assert len(tools.mps.started) == 2  # nothing started again
        assert node.claims.claim("live").mps.state == "running"  # type: ignore[union-attr]
        dead = node.claims.claim("dead").mps
        assert dead is not None and dead.state == "failed" and "not running" in str(dead.reason)
        assert any(e.kind == "claim.mps_failed" for e in node.events.since())
        uuid = (await node.gpu(0)).uuid
        shares = sorted((h.holder, h.shares[0].amount) for h in node.ledger.holds(uuid))
        assert shares == [("dead", 20480), ("live", 10240)]
        with pytest.raises(DeviceBusy, match="30720 MiB of 45056 MiB are taken"):
            await node.claims.prepare("big", [gpu("0", memory_mib=20 * GIB)], {})
    finally:
        await node.close()


async def test_restart_sets_the_time_slice_and_exclusive_process_again(tmp_path: Path,
                                                                        tools: Tools) -> None:
    """After a restart, a prepared claim's time slice and EXCLUSIVE_PROCESS are set again (a
    GPU reset while the agent was down puts back the defaults); a claim whose setting cannot
    be set again is reported and kept."""
    node = await open_node(tmp_path, tools)
    ts, mps = (await node.gpu(2)).uuid, (await node.gpu(3)).uuid
    await node.claims.prepare("c-ts", [gpu("2", sharing=SharingConfig(
        "TimeSlicing", interval="Medium"))], {})
    await node.claims.prepare("c-mps", [gpu("3", sharing=MPS_50)], {})
    await node.close()
    tools.smi.calls.clear()
    node = await open_node(tmp_path, tools)
    try:
        assert sorted(tools.smi.calls, key=str) == sorted(
            [(mps, "compute_mode", "EXCLUSIVE_PROCESS"), (ts, "timeslice", 2)], key=str)
    finally:
        await node.close()
    tools.smi.fail = True
    node = await open_node(tmp_path, tools)
    try:
        assert node.claims.claim("c-ts").state == "prepare_completed"
        assert any(e.kind == "claim.sharing_not_reapplied" for e in node.events.since())
    finally:
        await node.close()


async def test_the_supervisor_reports_a_daemon_that_dies(node: ServiceNode,
                                                         tools: Tools) -> None:
    """A daemon that dies while its claim is prepared is found by the daemon check: the
    claim is reported failed, durably, and still prepared."""
    await node.claims.prepare("c", [gpu("1", sharing=SharingConfig("MPS"))], {})
    assert await node.claims.check_daemons() == 0
    tools.mps.running.clear()
    assert await node.claims.check_daemons() == 1
    saved = checkpoint_claims(node)["c"]
    assert saved["state"] == "prepare_completed" and saved["mps"]["state"] == "failed"
    assert await node.claims.check_daemons() == 0  # reported once


async def test_refusals_change_nothing(node: ServiceNode, tools: Tools) -> None:
    """A sharing config the device cannot honour is a 422 naming the field, before any
    hold, record or tool call."""
    with pytest.raises(InvalidRequest) as caught:
        await node.claims.prepare("c", [gpu("0", memory_mib=50 * GIB)], {})
    assert caught.value.errors[0]["field"] == "devices[0].capacity.memory"
    assert node.ledger.holds() == [] and tools.smi.calls == [] and tools.mps.started == []


async def test_a_retry_of_a_shared_claim_is_the_same_answer(node: ServiceNode,
                                                             tools: Tools) -> None:
    """A repeated prepare of a shared claim answers the same and starts nothing again; the
    same uid with another share is a conflict."""
    first = await node.claims.prepare("c", [gpu("0", memory_mib=10 * GIB)], {})
    again = await node.claims.prepare("c", [gpu("0", memory_mib=10 * GIB)], {})
    assert again is first and len(tools.mps.started) == 1
    with pytest.raises(Exception, match="other devices"):
        await node.claims.prepare("c", [gpu("0", memory_mib=11 * GIB)], {})


async def test_the_intent_is_durable_before_the_daemon_starts_and_a_crash_then_rolls_back(
        tmp_path: Path, tools: Tools) -> None:
    """When the daemon starts, the claim is already recorded durably (prepare_started, with
    its daemon and sharing intent); an agent killed at that moment restarts, stops the
    daemon, resets the compute mode and frees the GPU."""
    durable: list[bytes] = []
    checkpoint = tmp_path / "state" / "claims.checkpoint"
    tools.mps.on_start = lambda _spec: durable.append(checkpoint.read_bytes())
    node = await open_node(tmp_path, tools)
    uuid = (await node.gpu(0)).uuid
    await node.claims.prepare("c", [gpu("0", sharing=MPS_50)], {})
    await node.close()
    (at_start,) = durable
    saved = decode(at_start).model_dump()["claims"]["c"]
    assert saved["state"] == "prepare_started" and saved["mps"]["state"] == "starting"
    assert saved["devices"][0]["sharing_state"]["exclusive_process"] is True
    checkpoint.write_bytes(at_start)  # as if SIGKILLed while the daemon started
    tools.smi.calls.clear()
    node = await open_node(tmp_path, tools)
    try:
        root = node.node.settings.mps_root / short_id("c")  # type: ignore[operator]
        assert tools.mps.stopped == [root] and root not in tools.mps.running
        assert tools.smi.calls == [(uuid, "compute_mode", "DEFAULT")]
        assert node.ledger.holds(uuid) == [] and "c" not in checkpoint_claims(node)
        await node.claims.prepare("x", [gpu("0")], {})  # the GPU is free again
    finally:
        await node.close()


async def test_a_failed_cleanup_at_start_up_keeps_the_gpu_held(tmp_path: Path,
                                                               tools: Tools) -> None:
    """A half-done MPS claim whose daemon cannot be stopped at start-up keeps its GPU held
    and is reported, until a later unprepare succeeds."""
    durable: list[bytes] = []
    checkpoint = tmp_path / "state" / "claims.checkpoint"
    tools.mps.on_start = lambda _spec: durable.append(checkpoint.read_bytes())
    node = await open_node(tmp_path, tools)
    uuid = (await node.gpu(0)).uuid
    await node.claims.prepare("c", [gpu("0", sharing=MPS_50)], {})
    await node.close()
    checkpoint.write_bytes(durable[0])
    tools.mps.fail_stop = True
    node = await open_node(tmp_path, tools)
    try:
        assert [h.holder for h in node.ledger.holds(uuid)] == ["c"]
        assert "could not be cleaned up" in str(node.claims.claim("c").lost_reason)
        with pytest.raises(DeviceBusy):
            await node.claims.prepare("x", [gpu("0")], {})
        tools.mps.fail_stop = False
        await node.claims.unprepare("c")
        assert node.ledger.holds(uuid) == []
    finally:
        await node.close()


MPS_30 = SharingConfig("MPS", mps=MpsConfig(thread_percentage=30))
MPS_70 = SharingConfig("MPS", mps=MpsConfig(thread_percentage=70))


async def test_each_daemon_of_a_two_config_claim_is_supervised_on_its_own(
        node: ServiceNode, tools: Tools) -> None:
    """A claim with two MPS configs has two daemons; when one dies, the check reports that
    one failed (durably) and the other keeps running."""
    await node.claims.prepare("c2", [gpu("0", sharing=MPS_30), gpu("1", sharing=MPS_70)], {})
    first, second = (Path(d["root"]) for d in [checkpoint_claims(node)["c2"]["mps"],
                                                *checkpoint_claims(node)["c2"]["mps_more"]])
    del tools.mps.running[second]
    assert await node.claims.check_daemons() == 1
    saved = checkpoint_claims(node)["c2"]
    assert (saved["mps"]["root"], saved["mps"]["state"]) == (str(first), "running")
    assert [(d["root"], d["state"]) for d in saved["mps_more"]] == [(str(second), "failed")]
    assert await node.claims.check_daemons() == 0


async def test_a_second_daemon_that_fails_to_start_undoes_the_first(node: ServiceNode,
                                                                    tools: Tools) -> None:
    """When the second config's daemon fails to start, the first is stopped too, compute
    modes are reset and nothing stays held or recorded."""
    def fail_second(spec: DaemonSpec) -> None:
        if tools.mps.started:
            raise SharingUnavailable("exit 1", tool="nvidia-cuda-mps-control",
                                     reason="exit 1")

    tools.mps.on_start = fail_second
    with pytest.raises(SharingUnavailable):
        await node.claims.prepare("c2", [gpu("0", sharing=MPS_30), gpu("1", sharing=MPS_70)],
                                  {})
    (started,) = tools.mps.started
    assert started.root in tools.mps.stopped and tools.mps.running == {}
    assert node.ledger.holds() == [] and "c2" not in checkpoint_claims(node)
    assert sorted(c for c in tools.smi.calls if c[2] == "DEFAULT") == sorted(
        [((await node.gpu(0)).uuid, "compute_mode", "DEFAULT"),
         ((await node.gpu(1)).uuid, "compute_mode", "DEFAULT")])


async def test_restart_adopts_each_daemon_of_a_claim(tmp_path: Path, tools: Tools) -> None:
    """After a restart, each daemon of a two-config claim is adopted or reported on its own,
    and the claim's spec still mounts each device's own daemon."""
    node = await open_node(tmp_path, tools)
    await node.claims.prepare("c2", [gpu("0", sharing=MPS_30), gpu("1", sharing=MPS_70)], {})
    before = node.claims.cdi.claim_path("c2").read_text()
    await node.close()
    second = next(r for r in tools.mps.running if r.name == f"{short_id('c2')}-1")
    del tools.mps.running[second]
    node = await open_node(tmp_path, tools)
    try:
        assert len(tools.mps.started) == 2  # nothing started again
        record = node.claims.claim("c2")
        assert [d.state for d in record.daemons()] == ["running", "failed"]
        assert node.claims.cdi.claim_path("c2").read_text() == before
    finally:
        await node.close()
