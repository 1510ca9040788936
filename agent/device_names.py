"""Stable device names shared by the ResourceSlices and the claims API (a claim passes the
cluster's allocation result straight through): ``gpu-<minor>`` for a full GPU and
``gpu-<minor>-mig-<profile>-<profile id>-<start>`` for a MIG device, as NVIDIA's DRA driver
names them (the minor is more stable than the index; the profile id keeps ``1g.10gb`` and
``1g.10gb+me`` apart). Names are DNS labels, so the profile loses its dots and ``+``.

A node's compute-domain slot (``agent/dra/domain_slot.py``) is named here too, since the agent
renders it and the kubelet plugin reconciles it by name: the slice ``<node>-compute-domain``,
its pool ``<node>/compute-domain``, its one device ``slot``, the Node label
``<driver>/fabric-clique`` its slice selects on.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from agent.quantity import QuantityError, kubernetes_value, quantity_of

SLOT_DEVICE = "slot"
SLOT_POOL_SUFFIX = "/compute-domain"
_SLOT_SUFFIX = "-compute-domain"
#: The longest object name (a DNS subdomain).
_MAX_OBJECT_NAME = 253

_MIG = re.compile(r"^gpu-(0|[1-9][0-9]*)-mig-([a-z0-9]+)-(0|[1-9][0-9]*)-(0|[1-9][0-9]*)\Z")
_GPU = re.compile(r"^gpu-(0|[1-9][0-9]*)\Z")


def clique_label(driver: str) -> str:
    """The Node label naming the node's NVLink clique (``gpu.nodeagent.dev/fabric-clique``)."""
    return f"{driver}/fabric-clique"


def slot_slice_name(node: str) -> str:
    """``<node>-compute-domain`` (the node name made a DNS subdomain, as the GPU slices'
    names are); a node name too long for it is cut and a digest of the whole name added, so
    two long names never meet."""
    base = re.sub(r"[^a-z0-9.-]+", "-", node.lower()).strip("-.")
    if len(base) + len(_SLOT_SUFFIX) <= _MAX_OBJECT_NAME:
        return base + _SLOT_SUFFIX
    digest = hashlib.sha256(node.encode()).hexdigest()[:12]
    return f"{base[:_MAX_OBJECT_NAME - len(_SLOT_SUFFIX) - 13].rstrip('-.')}-{digest}" \
        + _SLOT_SUFFIX


def ascii_integer(text: str, *, digits: int = 18) -> int | None:
    """``text`` as a non-negative integer when it is one in ASCII digits (at most ``digits``
    of them) spelled the one canonical way (no leading zero: ``"02"`` is not GPU 2), else
    None. ``str.isdigit`` alone accepts ``"²"``, which ``int`` refuses, and ``int`` refuses
    more than 4,300 digits: either would be a 500 for a GPU reference."""
    if (0 < len(text) <= digits and text.isascii() and text.isdigit()
            and (text[0] != "0" or text == "0")):
        return int(text)
    return None


def profile_label(profile: str) -> str:
    """``1g.10gb+me`` → ``1g10gbme``."""
    return re.sub(r"[^a-z0-9]", "", profile.lower())


def gpu_device_name(minor: int) -> str:
    return f"gpu-{minor}"


def mig_device_name(minor: int, profile: str, profile_id: int, start: int) -> str:
    return f"gpu-{minor}-mig-{profile_label(profile)}-{profile_id}-{start}"


@dataclass(frozen=True)
class ParsedName:
    """A parsed device name: ``profile`` (DNS form), ``profile_id`` and ``start`` are set for
    MIG devices only."""

    minor: int
    profile: str | None = None
    profile_id: int | None = None
    start: int | None = None


def parse_device_name(name: str) -> ParsedName | None:
    """The parts of a device name, or None when it is not one of ours."""
    if match := _GPU.match(name):
        return ParsedName(int(match[1]))
    if match := _MIG.match(name):
        return ParsedName(int(match[1]), match[2], int(match[3]), int(match[4]))
    return None


def shareable_mib(total_mib: int) -> int:
    """The memory of a full GPU that counted shares may add up to: its total rounded down to
    whole GiB, in MiB (an L40S's 46,068 MiB give 45,056). The ResourceSlices publish it as the
    device's ``memory`` capacity and the ledger counts shares against it, so both agree on
    what fits; the remainder below a GiB is never offered (the scheduler's step is 1 GiB)."""
    return max(0, total_mib) // 1024 * 1024


#: Above any GPU's memory by far (1 EiB): a bigger quantity is a mistake, not a request.
MAX_QUANTITY_BYTES = 2**60


def quantity_mib(value: object) -> int:
    """A memory quantity as whole MiB, rounded up: integer bytes, or a Kubernetes quantity
    in any form Kubernetes accepts (``10Gi``, ``1.5Gi``, ``10737418240``, ``10G``, ``1e9``;
    :mod:`agent.quantity`), its bytes rounded up as ``Quantity.Value()`` does. ValueError
    says why anything else is refused (not a quantity, zero or negative, above 1 EiB); a bool
    is not a number here."""
    try:
        total = kubernetes_value(quantity_of(value))
    except QuantityError as err:
        raise ValueError(f"not a memory quantity: {err}") from None
    if total <= 0:
        raise ValueError("a memory quantity must be above zero")
    if total > MAX_QUANTITY_BYTES:
        raise ValueError("a memory quantity above 1 EiB is no GPU's")
    return -(-total // 2**20)
