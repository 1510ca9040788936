"""The sharing plan (agent/claims/sharing.py) and memory quantities: what a claim's sharing
requests do to each device, and every refusal naming its field."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.claims.sharing import (
    MpsConfig,
    SharingConfig,
    Target,
    implicit_threads,
    per_device_index,
    pinned_limit_mib,
    plan,
    short_id,
)
from agent.device_names import quantity_mib, shareable_mib
from agent.errors import InvalidRequest

L40S_MIB = 46068  # shareable: 45056
GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
GPU_C = "GPU-cccccccc-0000-0000-0000-000000000000"
MIG_A = "MIG-aaaaaaaa-1111-0000-0000-000000000000"


def full(position: int = 0, uuid: str = GPU_A, **kwargs: Any) -> Target:
    return Target(position=position, uuid=uuid, gpu=uuid, kind="gpu", memory_mib=L40S_MIB,
                  **kwargs)


def mig(position: int = 0, **kwargs: Any) -> Target:
    return Target(position=position, uuid=MIG_A, gpu=GPU_A, kind="mig", memory_mib=9856,
                  **kwargs)


MPS = SharingConfig("MPS")


def mps(threads: int | None = None, pinned: int | None = None,
        per_device: tuple[tuple[str, int], ...] = ()) -> SharingConfig:
    return SharingConfig("MPS", mps=MpsConfig(threads, pinned, per_device))


@pytest.mark.parametrize(("total", "shareable"), [
    (46068, 45056), (81559, 80896), (1024, 1024), (1023, 0), (0, 0), (-5, 0)])
def test_shareable_memory_is_the_total_rounded_down_to_whole_gib(total: int,
                                                                  shareable: int) -> None:
    """A GPU's shareable memory is its total rounded down to whole GiB (an L40S: 45,056 MiB)."""
    assert shareable_mib(total) == shareable


@pytest.mark.parametrize(("quantity", "mib"), [
    ("10Gi", 10240), ("512Mi", 512), ("1.5Gi", 1536), ("1Ki", 1), (10737418240, 10240),
    ("10737418240", 10240), ("10G", 9537), ("1", 1), (1048577, 2), ("1Ti", 1048576)])
def test_quantities_become_whole_mib_rounded_up(quantity: int | str, mib: int) -> None:
    """Integer bytes and Kubernetes memory quantities become whole MiB, rounded up."""
    assert quantity_mib(quantity) == mib


@pytest.mark.parametrize("quantity", [
    "0", 0, -1, "-1Gi", "10 Gi", "10gi", "1KiB", "", "Gi", "1.2.3", True, None, "2Ei", 2**61,
    "1" * 30, "²", float("nan")])
def test_bad_quantities_are_refused(quantity: object) -> None:
    """Zero (``Gi`` reads 0 in Kubernetes), negatives, booleans, what Kubernetes refuses and
    absurd values are refused with a reason (never another exception)."""
    with pytest.raises(ValueError, match="quantity"):
        quantity_mib(quantity)


@given(st.integers(min_value=1, max_value=2**40 - 1))
def test_a_quantity_in_bytes_and_in_mi_agree(mib: int) -> None:
    """``<n>Mi`` and ``n * 2**20`` bytes are the same n MiB; one byte more rounds up."""
    assert quantity_mib(f"{mib}Mi") == quantity_mib(mib * 2**20) == mib
    assert quantity_mib(mib * 2**20 + 1) == mib + 1


@given(st.integers(min_value=1, max_value=45056))
def test_implicit_threads_are_proportional_and_at_least_one(share: int) -> None:
    """A share's thread percentage is floor(100 * share / shareable), never below 1 nor
    above 100."""
    threads = implicit_threads(share, 45056)
    assert 1 <= threads <= 100
    assert threads == max(1, 100 * share // 45056)


def test_short_id_is_twelve_hex_of_sha256() -> None:
    """A claim's MPS directory is the first 12 hex digits of SHA-256 of its UID."""
    assert short_id("abc") == "ba7816bf8f01"


def test_nothing_shared_is_an_empty_plan() -> None:
    """Devices without sharing or capacity plan nothing, and a share of all of a GPU's
    shareable memory is the whole GPU (no MPS, no counted share)."""
    assert plan([full()]).devices == ()
    whole = plan([full(memory_share_mib=45056)])
    assert whole.devices == () and whole.daemon is None


def test_mps_on_a_full_gpu_is_exclusive_process_with_one_daemon() -> None:
    """MPS on a full GPU sets EXCLUSIVE_PROCESS and runs the claim's one daemon with the
    configured limits."""
    result = plan([full(sharing=mps(threads=50, pinned=10240))])
    (device,) = result.devices
    assert (device.strategy, device.exclusive_process, device.thread_percentage,
            device.pinned_mib, device.share_mib) == ("MPS", True, 50, 10240, None)
    assert result.daemon is not None
    assert (result.daemon.devices, result.daemon.thread_percentage,
            result.daemon.pinned_limits_mib) == ((GPU_A,), 50, ((GPU_A, 10240),))
    assert result.needs_nvidia_smi


def test_mps_on_a_mig_device_leaves_compute_mode_alone() -> None:
    """MPS on a MIG device runs the daemon on the MIG UUID and needs no nvidia-smi."""
    result = plan([mig(sharing=MPS)])
    assert result.daemon is not None and result.daemon.devices == (MIG_A,)
    assert not result.devices[0].exclusive_process and not result.needs_nvidia_smi


def test_a_share_is_enforced_by_implicit_mps() -> None:
    """A 10 GiB share of an L40S: pinned limit 10240 MiB, 22 % of the threads, compute mode
    left DEFAULT (other claims' daemons share the GPU)."""
    result = plan([full(memory_share_mib=10240)])
    (device,) = result.devices
    assert (device.strategy, device.share_mib, device.shareable_mib, device.pinned_mib,
            device.thread_percentage, device.exclusive_process) == (
        "MPS", 10240, 45056, 10240, 22, False)
    assert result.daemon is not None and result.daemon.thread_percentage == 22
    assert not result.needs_nvidia_smi


def test_a_share_keeps_configured_limits_within_it() -> None:
    """A configured thread percentage and a pinned limit below the share are kept."""
    (device,) = plan([full(memory_share_mib=10240, sharing=mps(threads=80, pinned=4096))]
                     ).devices
    assert (device.thread_percentage, device.pinned_mib) == (80, 4096)


def test_time_slicing_sets_the_interval() -> None:
    """TimeSlicing on a full GPU maps the interval to nvidia-smi's value."""
    for interval, value in (("Default", 0), ("Short", 1), ("Medium", 2), ("Long", 3)):
        (device,) = plan([full(sharing=SharingConfig("TimeSlicing", interval=interval))]
                         ).devices  # type: ignore[arg-type]
        assert (device.strategy, device.timeslice, device.interval) == (
            "TimeSlicing", value, interval)


def test_per_device_limits_by_uuid_and_by_index() -> None:
    """Per-device pinned limits name a device by UUID or by index into the sorted UUIDs of
    the config's devices, and override the default."""
    per = ((GPU_A, 1024), ("1", 2048))
    result = plan([full(0, GPU_B, sharing=mps(pinned=4096, per_device=per)),
                   full(1, GPU_A, sharing=mps(pinned=4096, per_device=per))])
    assert {d.uuid: d.pinned_mib for d in result.devices} == {GPU_A: 1024, GPU_B: 2048}
    assert result.daemon is not None and result.daemon.devices == (GPU_A, GPU_B)


@pytest.mark.parametrize(("key", "index"), [
    ("0", 0), ("00", 0), ("007", 7), ("+1", 1), ("-0", 0), ("-1", -1),
    (str(2**63 - 1), 2**63 - 1), (str(2**63), None), ("1.0", None), (" 1", None),
    ("", None), ("+", None), ("0x1", None), ("1_0", None), ("\u0663", None)])
def test_per_device_keys_are_integers_as_go_reads_them(key: str, index: int | None) -> None:
    """A per-device key that is no UUID of the config is read as NVIDIA's driver reads it
    (``strconv.Atoi``): a sign, ASCII digits, leading zeros, int64; nothing else."""
    assert per_device_index(key) == index


@pytest.mark.parametrize(("key", "expected"), [("00", 1024), ("+1", 2048), ("-0", 1024),
                                               ("01", 2048), (GPU_B, 2048)])
def test_per_device_keys_nvidia_accepts_are_accepted(key: str, expected: int) -> None:
    """``00`` (refused at beeb01d), ``+1``, ``-0`` and ``01`` name the config's devices by
    index into their sorted UUIDs, as in NVIDIA's driver; a UUID names itself."""
    config = mps(pinned=4096, per_device=((key, expected),))
    result = plan([full(0, GPU_B, sharing=config), full(1, GPU_A, sharing=config)])
    named = GPU_A if expected == 1024 else GPU_B
    assert {d.uuid: d.pinned_mib for d in result.devices}[named] == expected


@pytest.mark.parametrize(("quantity", "mib"), [
    ("1G", 953), ("1e9", 953), (1e9, 953), ("10M", 9), ("1Gi", 1024), ("10Mi", 10),
    ("2Gi", 2048), ("1.5Gi", 1536), (1048576, 1), ("1048575.5", 1), ("2097151", 1),
    ("10Gi", 10240), ("0.5Ti", 524288)])
def test_pinned_limits_are_whole_mib_rounded_down_as_nvidia_does(quantity: object,
                                                                  mib: int) -> None:
    """A pinned limit is the quantity's bytes (``Value()``, rounded up) in whole MiB rounded
    down, as NVIDIA's driver sends it to MPS: ``1G`` is 953 MiB (954 at beeb01d), ``10M`` 9."""
    assert pinned_limit_mib(quantity) == mib


@pytest.mark.parametrize("quantity", ["1M", "1048575", 1048575, "1Ki", "0", 0, "Mi", "-1Gi",
                                      "100m"])
def test_pinned_limits_below_one_mib_are_refused_as_nvidia_does(quantity: object) -> None:
    """Below 1 MiB (``1M``, accepted at beeb01d), zero and negatives are NVIDIA's "value set
    too low"."""
    with pytest.raises(ValueError, match="too low"):
        pinned_limit_mib(quantity)


def test_two_mps_configs_get_a_daemon_each() -> None:
    """Two MPS configs of one claim each get a daemon of their own with their own limits, as
    in NVIDIA's driver (one shared daemon at beeb01d, which also refused different thread
    percentages); devices of one config share its daemon."""
    result = plan([full(0, GPU_A, sharing=mps(threads=50, pinned=1024)),
                   full(1, GPU_B, sharing=mps(threads=60)),
                   full(2, GPU_C, sharing=mps(threads=50, pinned=1024))])
    assert [(d.devices, d.thread_percentage, d.pinned_limits_mib, d.positions)
            for d in result.daemons] == [
        ((GPU_A, GPU_C), 50, ((GPU_A, 1024), (GPU_C, 1024)), (0, 2)),
        ((GPU_B,), 60, (), (1,))]
    assert {d.position: d.thread_percentage for d in result.devices} == {0: 50, 1: 60, 2: 50}


def test_a_gpu_config_and_a_mig_config_are_separate_daemons() -> None:
    """A full GPU and a MIG device never share a daemon: NVIDIA's GpuConfig and
    MigDeviceConfig are separate configs even when their content is equal."""
    result = plan([full(0, GPU_B, sharing=MPS), mig(1, sharing=MPS)])
    assert [d.devices for d in result.daemons] == [(GPU_B,), (MIG_A,)]


REFUSALS: list[tuple[str, list[Target], list[str]]] = [
    ("time-slicing on a MIG device",
     [mig(sharing=SharingConfig("TimeSlicing", interval="Long"))],
     ["devices[0].sharing.strategy"]),
    ("time-slicing on a share",
     [full(memory_share_mib=10240, sharing=SharingConfig("TimeSlicing", interval="Short"))],
     ["devices[0].sharing.strategy"]),
    ("pinned limit above the device's memory",
     [full(sharing=mps(pinned=50000))],
     ["devices[0].sharing.mpsConfig.defaultPinnedDeviceMemoryLimit"]),
    ("pinned limit above a MIG device's memory",
     [mig(sharing=mps(pinned=10240))],
     ["devices[0].sharing.mpsConfig.defaultPinnedDeviceMemoryLimit"]),
    ("pinned limit above the share",
     [full(memory_share_mib=10240, sharing=mps(pinned=20480))],
     ["devices[0].sharing.mpsConfig.defaultPinnedDeviceMemoryLimit"]),
    ("per-device key naming no device",
     [full(sharing=mps(per_device=(("GPU-nope", 1024), ("3", 1024))))],
     ["devices[0].sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.GPU-nope",
      "devices[0].sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.3"]),
    ("per-device limit above memory",
     [full(sharing=mps(per_device=(("0", 99999),)))],
     ["devices[0].sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.0"]),
    ("share of a MIG device", [mig(memory_share_mib=1024)], ["devices[0].capacity.memory"]),
    ("share of a GPU with MIG on", [full(memory_share_mib=1024, mig_enabled=True)],
     ["devices[0].capacity.memory"]),
    ("share above the shareable memory", [full(memory_share_mib=45057)],
     ["devices[0].capacity.memory"]),
    ("sharing on an admin-access device", [full(sharing=MPS, admin_access=True)],
     ["devices[0].sharing"]),
    ("per-device index of another config's device",
     [full(0, GPU_A, sharing=mps(per_device=(("1", 1024),))),
      full(1, GPU_B, sharing=mps(threads=50))],
     ["devices[0].sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.1"]),
    ("per-device keys that are no integer nor a UUID of the config",
     [full(sharing=mps(per_device=(("-1", 1), ("1.0", 1), (" 0", 1), ("0x0", 1), ("", 1),
                                   ("\u0663", 1), ("9" * 30, 1), (GPU_B, 1))))],
     [f"devices[0].sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.{key}"
      for key in ("-1", "1.0", " 0", "0x0", "", "\u0663", "9" * 30, GPU_B)]),
    ("two per-device keys naming one device",
     [full(sharing=mps(per_device=((GPU_A, 1024), ("00", 2048))))],
     ["devices[0].sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.00"]),
    ("every problem at once",
     [mig(0, sharing=SharingConfig("TimeSlicing")), full(1, GPU_B, memory_share_mib=99999)],
     ["devices[0].sharing.strategy", "devices[1].capacity.memory"]),
]


@pytest.mark.parametrize(("case", "targets", "fields"), REFUSALS,
                         ids=[case for case, _, _ in REFUSALS])
def test_what_cannot_be_honoured_is_refused_naming_each_field(
        case: str, targets: list[Target], fields: list[str]) -> None:
    """A sharing request the device cannot honour is a 422 naming every offending field."""
    with pytest.raises(InvalidRequest) as caught:
        plan(targets)
    assert sorted(e["field"] for e in caught.value.errors) == sorted(fields), case


@pytest.mark.parametrize("targets", [[full(sharing=MPS)], [full(memory_share_mib=1024)]])
def test_mps_and_shares_are_refused_with_dynamic_mig(targets: list[Target]) -> None:
    """NVIDIA forbids MPS with dynamic MIG: MPS and shares are refused with --dynamic-mig."""
    with pytest.raises(InvalidRequest) as caught:
        plan(targets, dynamic_mig=True)
    assert caught.value.errors[0]["field"].startswith("devices[0].")


def test_implicit_percentages_of_two_shares_take_the_smallest() -> None:
    """One daemon serves two shares of different GPUs: its default thread percentage is the
    smaller share's, so neither gets more than its proportion."""
    result = plan([full(0, GPU_A, memory_share_mib=10240),
                   full(1, GPU_B, memory_share_mib=20480)])
    assert result.daemon is not None and result.daemon.thread_percentage == 22
    assert {d.pinned_mib for d in result.devices} == {10240, 20480}
