"""Which of the node's devices each container holds, from kubelet's PodResources answer: the
pure mapping (agent/podresources/holders.py) over GPUs built as the inventory builds them."""

from __future__ import annotations

import pytest

from agent.gpu.types import Gpu, GpuStatic, Health, MigDevice, MigMode, Placement
from agent.podresources.holders import ContainerHolding, DraDevice, holders_by_device

DRIVER = "gpu.nodeagent.dev"


def _gpu(index: int, *, migs: tuple[MigDevice, ...] = ()) -> Gpu:
    static = GpuStatic(index=index, minor=index + 4, uuid=f"GPU-{index}", name="NVIDIA H100",
                       brand="Tesla", architecture="Hopper", cuda_compute_capability="9.0",
                       pci_bus_id=f"00000000:{index:02X}:00.0", pci_device_id=0,
                       pci_subsystem_id=0, memory_total_mib=81559, numa_node=0,
                       cpu_affinity="0-7", mig_capable=True)
    return Gpu(static=static, mig_mode=MigMode(bool(migs), False), mig_devices=migs,
               health=Health(True))


def _mig(gpu: int, gi: int, profile: str, start: int, size: int) -> MigDevice:
    return MigDevice(index=gi, uuid=f"MIG-{gpu}-{gi}", profile=profile, gi_id=gi, ci_id=0,
                     placement=Placement(start, size), memory_mib=9856, multiprocessors=16)


GPUS = [_gpu(0), _gpu(1, migs=(_mig(1, 9, "1g.10gb", 2, 1), _mig(1, 3, "3g.40gb", 4, 4)))]
POD = {"container": "main", "namespace": "ml", "pod": "job"}


def _dra(device: str, driver: str = DRIVER) -> DraDevice:
    return DraDevice(claim_namespace="ml", claim_name="c", driver=driver, pool="node-a",
                     device=device)


def _dra_labels(device: str) -> dict[str, str]:
    return {**POD, "dra_claim_name": "c", "dra_claim_namespace": "ml",
            "dra_driver_name": DRIVER, "dra_device_name": device, "dra_pool_name": "node-a"}


# (what, device-plugin IDs, DRA devices, expected {(gpu uuid, gi id): labels})
CASES: list[tuple[str, tuple[str, ...], tuple[DraDevice, ...],
                  dict[tuple[str, int | None], dict[str, str]]]] = [
    ("nvidia.com/gpu GPU UUID", ("GPU-0",), (), {("GPU-0", None): POD}),
    ("time-slicing replica suffix", ("GPU-0::3",), (), {("GPU-0", None): POD}),
    ("MIG UUID (mixed strategy)", ("MIG-1-3",), (), {("GPU-1", 3): POD}),
    ("unknown device-plugin ID", ("GPU-9", "0000:3b:00.0"), (), {}),
    ("DRA whole GPU by minor", (), (_dra("gpu-4"),), {("GPU-0", None): _dra_labels("gpu-4")}),
    ("DRA MIG device by profile and placement", (), (_dra("gpu-5-mig-1g10gb-19-2"),),
     {("GPU-1", 9): _dra_labels("gpu-5-mig-1g10gb-19-2")}),
    ("DRA MIG placement with no instance", (), (_dra("gpu-5-mig-1g10gb-19-0"),), {}),
    ("another driver's device", (), (_dra("gpu-4", driver="gpu.nvidia.com"),), {}),
    ("not one of our names", (), (_dra("gpu-04"), _dra("nic-0")), {}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_container_holdings_map_to_the_devices_they_name(
        case: tuple[str, tuple[str, ...], tuple[DraDevice, ...],
                    dict[tuple[str, int | None], dict[str, str]]]) -> None:
    """Device-plugin GPU and MIG UUIDs and our driver's DRA device names map to the GPU or
    the GPU instance they name, with dcgm-exporter's pod labels (and the DRA names for a
    claim's device); anything that is no device of this node maps to nothing."""
    _, ids, dra, expected = case
    holding = ContainerHolding(namespace="ml", pod="job", container="main", device_ids=ids,
                               dra=dra)
    found = holders_by_device([holding], GPUS, driver=DRIVER)
    assert found == {key: (labels,) for key, labels in expected.items()}


def test_a_device_two_containers_hold_lists_each_once_in_order() -> None:
    """A GPU two containers share (and one lists twice) lists each container once, sorted."""
    holdings = [ContainerHolding("ml", "b", "main", ("GPU-0",)),
                ContainerHolding("ml", "a", "side", ("GPU-0", "GPU-0::1")),
                ContainerHolding("ml", "a", "main", ("GPU-0",))]
    found = holders_by_device(holdings, GPUS, driver=DRIVER)
    assert [(h["pod"], h["container"]) for h in found[("GPU-0", None)]] == [
        ("a", "main"), ("a", "side"), ("b", "main")]
