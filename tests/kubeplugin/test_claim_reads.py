"""Claim reads share their slots fairly among kubelet's calls, join a read of the same claim
already running, and fail alone at their deadline; names become one path segment or a
per-claim error (agent/kubeplugin/claim_reads.py, claims.py, kube.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agent.kubeplugin.claim_reads import ClaimReads, ClaimReadTimeout
from agent.kubeplugin.claims import ClaimError, KubeletClaim, check_names, check_uid
from agent.kubeplugin.kube import segment


class Gated:
    """A reader whose reads of ``hang-*`` wait for :attr:`release`; it counts reads."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started: list[str] = []

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        self.started.append(name)
        if name.startswith("hang-"):
            await self.release.wait()
        return {"metadata": {"name": name}}


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_one_call_holds_at_most_its_share_and_another_call_reads_at_once() -> None:
    reader = Gated()
    reads = ClaimReads(reader, at_once=4, per_call=2, timeout_s=60)
    hostile, other = object(), object()
    hung = [asyncio.ensure_future(reads.read(hostile, "ns", f"hang-{i}")) for i in range(10)]
    await settle()
    assert (reads.running, reads.waiting) == (2, 8)
    assert (await reads.read(other, "ns", "good"))["metadata"]["name"] == "good"
    reader.release.set()
    assert len(await asyncio.gather(*hung)) == 10
    assert (reads.running, reads.waiting) == (0, 0)


async def test_a_free_slot_goes_to_the_call_running_fewest() -> None:
    reader = Gated()
    reads = ClaimReads(reader, at_once=2, per_call=2, timeout_s=60)
    first, second = object(), object()
    a = [asyncio.ensure_future(reads.read(first, "ns", f"hang-a{i}")) for i in range(3)]
    await settle()
    b = asyncio.ensure_future(reads.read(second, "ns", "hang-b"))
    await settle()
    assert reader.started == ["hang-a0", "hang-a1"]
    reader.release.set()
    await asyncio.gather(*a, b)
    assert reader.started[2] == "hang-b"  # before first's third read


async def test_a_claim_being_read_is_read_once() -> None:
    reader = Gated()
    reads = ClaimReads(reader, timeout_s=60)
    both = [asyncio.ensure_future(reads.read(object(), "ns", "hang-x")) for _ in range(2)]
    await settle()
    reader.release.set()
    assert len(await asyncio.gather(*both)) == 2 and reader.started == ["hang-x"]


async def test_a_read_past_its_deadline_fails_alone() -> None:
    reader = Gated()
    reads = ClaimReads(reader, timeout_s=0.05)
    call = object()
    hung = asyncio.ensure_future(reads.read(call, "ns", "hang-y"))
    assert (await reads.read(call, "ns", "good"))["metadata"]["name"] == "good"
    with pytest.raises(ClaimReadTimeout, match=r"within 0\.05 s"):
        await hung
    assert (reads.running, reads.waiting) == (0, 0)


@pytest.mark.parametrize(("name", "escaped"), [
    ("gpu-0", "gpu-0"), ("a/b", "a%2Fb"), ("..", "%2E%2E"), (".", "%2E"),
    ("x?watch=1", "x%3Fwatch%3D1"), ("%2e", "%252e"), ("a b#c", "a%20b%23c"),
])
def test_a_name_is_one_path_segment(name: str, escaped: str) -> None:
    assert segment(name) == escaped


#: A DNS-1123 subdomain of 253 characters, four labels.
LONGEST = ".".join(["a" * 63] * 3 + ["a" * 61])


@pytest.mark.parametrize(("namespace", "name", "uid", "field"), [
    ("default", "claim-1", "3f9c0a4e-1d2b-4c5e-8f70-123456789abc", None),
    ("default", "a.b.c", "uid-1", None),
    ("default", LONGEST, "u", None),
    ("default", LONGEST + "a", "u", "name"),
    ("default", "a" * 64, "u", "name"),
    ("default", "a/b", "u", "name"),
    ("default", "A", "u", "name"),
    ("default", "-a", "u", "name"),
    ("default", "a..b", "u", "name"),
    ("default", "", "u", "name"),
    ("a.b", "c", "u", "namespace"),
    ("..", "c", "u", "namespace"),
    ("n" * 64, "c", "u", "namespace"),
    ("default", "c", "../x", "uid"),
    ("default", "c", "a/b", "uid"),
    ("default", "c", "", "uid"),
])
def test_names_from_kubelet(namespace: str, name: str, uid: str, field: str | None) -> None:
    claim = KubeletClaim(namespace=namespace, uid=uid, name=name)
    if field is None:
        check_names(claim)
        return
    with pytest.raises(ClaimError, match=f"its {field} .* from kubelet is not") as raised:
        check_names(claim)
    assert raised.value.reason == "bad-claim-name"
    if field == "uid":
        with pytest.raises(ClaimError, match="its uid"):
            check_uid(claim)
