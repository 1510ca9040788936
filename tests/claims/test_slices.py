"""Which GPUs a claim of slices may go on: the fresh read a prepare waits for covers those."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.claims.requests import DeviceRequest
from agent.claims.slices import gpus_for
from agent.gpu.inventory import GpuInventory
from agent.gpu.session import NvmlSession
from agent.gpu.sim.node import SimulatedNode
from agent.gpu.types import Gpu


@pytest.fixture
async def dgx(tmp_path: Path) -> AsyncIterator[tuple[Gpu, ...]]:
    node = SimulatedNode("dgx-h100", tmp_path / "state", tmp_path / "proc")
    session = NvmlSession(node.nvml)
    try:
        await session.initialise()
        inventory = GpuInventory(session)
        await inventory.load()
        yield inventory.gpus
    finally:
        session.close()
        node.close()


def _slice(**fields: object) -> DeviceRequest:
    return DeviceRequest(request="r", kind="slice", **fields)  # type: ignore[arg-type]


# (requests, indices of the GPUs read afresh; () for every GPU)
CASES = [
    ([_slice(profile="1g.10gb")], ()),
    ([_slice(profile="1g.10gb", gpu="3")], (3,)),
    ([_slice(device="gpu-5-mig-1g10gb-19-0")], (5,)),
    ([_slice(device="gpu-5-mig-1g10gb-19-0"), _slice(profile="1g.10gb", gpu="1")], (1, 5)),
    ([_slice(device="gpu-2-mig-1g10gb-19-0"), _slice(profile="1g.10gb")], ()),
    ([_slice(profile="1g.10gb", gpu="3"), DeviceRequest(request="g", kind="gpu", device="0")],
     ()),
    ([_slice(profile="1g.10gb", gpu="9")], ()),  # unknown here: the make says why, fresh
    ([_slice(device="not-a-device-name")], ()),
]


@pytest.mark.parametrize(("requests", "indices"), CASES)
async def test_the_gpus_a_claim_of_slices_may_go_on(
        dgx: tuple[Gpu, ...], requests: list[DeviceRequest], indices: tuple[int, ...]) -> None:
    assert gpus_for(requests, dgx) == frozenset(dgx[i].uuid for i in indices)


async def test_a_pinned_slice_is_found_by_uuid_too(dgx: tuple[Gpu, ...]) -> None:
    assert gpus_for([_slice(profile="1g.10gb", gpu=dgx[6].uuid)], dgx) == {dgx[6].uuid}
