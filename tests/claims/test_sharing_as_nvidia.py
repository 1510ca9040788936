"""NVIDIA's sharing configs through the claims API behave as in NVIDIA's DRA driver (issue 24,
measured at beeb01d and each fixed here): pinned limits in whole MiB rounded down, limits
below 1 MiB refused, every Kubernetes quantity form, per-device keys read as NVIDIA reads
them, and one MPS daemon per config, each with its own directories in the containers'
edits. In-process over a simulated L40S node, the sharing tools played by fakes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.claims.checkpoint import decode
from agent.claims.sharing import short_id
from tests.api.test_sharing_api import Api, _api, dev
from tests.claims.fake_tools import Tools


@pytest.fixture
async def api(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[Api]:
    made = await _api(tmp_path, aiohttp_client, Tools())
    try:
        yield made
    finally:
        await made.node.close()


def mps(**config: Any) -> dict[str, Any]:
    return {"strategy": "MPS", "mpsConfig": config}


@pytest.mark.parametrize(("limit", "mib"), [
    ("1G", 953), ("1e9", 953), (1e9, 953), ("10M", 9), ("2E9", 1907), ("+1Gi", 1024),
    ("0.5Gi", 512), ("1073741824", 1024)])
async def test_a_pinned_limit_is_whole_mib_rounded_down(api: Api, limit: object,
                                                        mib: int) -> None:
    """The pinned limit a device gets (and its daemon is given) is NVIDIA's: the quantity's
    bytes in whole MiB, rounded down (``1G``: 953 MiB; 954 at beeb01d), in every form a
    Kubernetes quantity takes (``1e9`` was refused at beeb01d)."""
    status, body = await api.prepare("c", dev(sharing=mps(
        defaultPinnedDeviceMemoryLimit=limit)))
    assert status == 200, body
    (device,) = body["devices"]
    assert device["sharing"]["pinned_limit_mib"] == mib
    (spec,) = api.tools.mps.started
    assert dict(spec.pinned_limits_mib) == {device["uuid"]: mib}


@pytest.mark.parametrize(("config", "leaf", "reason"), [
    ({"defaultPinnedDeviceMemoryLimit": "1M"}, "defaultPinnedDeviceMemoryLimit", "too low"),
    ({"defaultPinnedDeviceMemoryLimit": "1048575"}, "defaultPinnedDeviceMemoryLimit",
     "too low"),
    ({"defaultPinnedDeviceMemoryLimit": "-1Gi"}, "defaultPinnedDeviceMemoryLimit", "too low"),
    ({"defaultPerDevicePinnedMemoryLimit": {"0": "1M"}}, "0", "too low"),
    ({"defaultPinnedDeviceMemoryLimit": "1KiB"}, "defaultPinnedDeviceMemoryLimit",
     "not a memory quantity"),
])
async def test_a_limit_nvidia_refuses_is_422_naming_the_field(
        api: Api, config: dict[str, Any], leaf: str, reason: str) -> None:
    """A limit below 1 MiB (``1M``, accepted at beeb01d) is NVIDIA's "value set too low", a
    422 problem naming the field; nothing is held or started."""
    status, body = await api.prepare("c", dev(sharing=mps(**config)))
    assert status == 422 and body["type"].endswith("/invalid-request"), body
    (error,) = body["errors"]
    assert error["field"].endswith(f".{leaf}") and "mpsConfig" in error["field"], body
    assert reason in error["reason"], body
    assert api.node.ledger.holds() == [] and api.tools.mps.started == []


@pytest.mark.parametrize("key", ["00", "+0", "-0", "000"])
async def test_a_per_device_key_nvidia_accepts_is_accepted(api: Api, key: str) -> None:
    """A per-device key NVIDIA's driver reads as index 0 (``00`` was refused at beeb01d)
    names the config's first device."""
    status, body = await api.prepare("c", dev(sharing=mps(
        defaultPinnedDeviceMemoryLimit="4Gi", defaultPerDevicePinnedMemoryLimit={key: "2Gi"})))
    assert status == 200, body
    assert body["devices"][0]["sharing"]["pinned_limit_mib"] == 2048


@pytest.mark.parametrize("key", ["1", "-1", "0x0", "1.0", " 0", "GPU-nope"])
async def test_a_per_device_key_nvidia_refuses_is_422_naming_it(api: Api, key: str) -> None:
    """A key that is neither a UUID of the config's devices nor an index among them is a
    422 naming the key."""
    status, body = await api.prepare("c", dev(sharing=mps(
        defaultPerDevicePinnedMemoryLimit={key: "2Gi"})))
    assert status == 422, body
    assert any(e["field"].endswith(f"defaultPerDevicePinnedMemoryLimit.{key}")
               for e in body["errors"]), body


async def test_two_mps_configs_run_a_daemon_each(api: Api) -> None:
    """Two MPS configs of one claim run a daemon each (one shared daemon at beeb01d, which
    refused their different thread percentages), each in its own directory with its own
    limits; each device's container edits mount its own daemon's pipe and shm; unprepare
    stops both. Devices of one config share its daemon."""
    one = mps(defaultActiveThreadPercentage=30, defaultPinnedDeviceMemoryLimit="2Gi")
    other = mps(defaultActiveThreadPercentage=70)
    status, body = await api.prepare("c2", dev("0", sharing=one), dev("1", sharing=other),
                                     dev("2", sharing=one))
    assert status == 200, body
    uuids = [d["uuid"] for d in body["devices"]]
    mps_root = api.node.node.settings.mps_root
    assert mps_root is not None
    roots = [mps_root / short_id("c2"), mps_root / f"{short_id('c2')}-1"]
    started = {spec.root: spec for spec in api.tools.mps.started}
    assert set(started) == set(roots)
    first, second = started[roots[0]], started[roots[1]]
    assert (first.devices, first.active_thread_percentage, dict(first.pinned_limits_mib)) == (
        tuple(sorted([uuids[0], uuids[2]])), 30, {uuids[0]: 2048, uuids[2]: 2048})
    assert (second.devices, second.active_thread_percentage, dict(second.pinned_limits_mib)) \
        == ((uuids[1],), 70, {})
    assert [d["root"] for d in body["mps_daemons"]] == [str(r) for r in roots]
    assert body["mps"] == body["mps_daemons"][0]
    assert [d["sharing"]["thread_percentage"] for d in body["devices"]] == [30, 70, 30]

    spec = json.loads(api.node.claims.cdi.claim_path("c2").read_text())
    pipes = {}
    for device in spec["devices"]:
        mounts = {m["containerPath"]: m["hostPath"] for m in device["containerEdits"]["mounts"]}
        pipes[device["name"]] = (mounts["/tmp/nvidia-mps"], mounts["/dev/shm"])
    assert sorted(pipes.values()) == sorted(
        [(f"{roots[0]}/pipe", f"{roots[0]}/shm")] * 2 + [(f"{roots[1]}/pipe", f"{roots[1]}/shm")])

    saved = decode((api.node.state / "claims.checkpoint").read_bytes()).claims["c2"]
    assert [d.root for d in saved.daemons()] == [str(r) for r in roots]
    status, _ = await api.call("DELETE", "/v1/claims/c2")
    assert status in (200, 204)
    assert sorted(api.tools.mps.stopped) == sorted(roots)
