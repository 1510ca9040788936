"""Stable device names shared by the ResourceSlices and the claims API (a claim passes the
cluster's allocation result straight through): ``gpu-<minor>`` for a full GPU and
``gpu-<minor>-mig-<profile>-<profile id>-<start>`` for a MIG device, as NVIDIA's DRA driver
names them (the minor is more stable than the index; the profile id keeps ``1g.10gb`` and
``1g.10gb+me`` apart). Names are DNS labels, so the profile loses its dots and ``+``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_MIG = re.compile(r"^gpu-(0|[1-9][0-9]*)-mig-([a-z0-9]+)-(0|[1-9][0-9]*)-(0|[1-9][0-9]*)\Z")
_GPU = re.compile(r"^gpu-(0|[1-9][0-9]*)\Z")


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


_QUANTITY = re.compile(r"^([0-9]{1,19})(?:\.([0-9]{1,9}))?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?\Z")
_QUANTITY_SCALE = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
                   "Ei": 2**60, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
                   "E": 10**18}
#: Above any GPU's memory by far (1 EiB): a bigger quantity is a mistake, not a request.
MAX_QUANTITY_BYTES = 2**60


def quantity_mib(value: object) -> int:
    """A memory quantity as whole MiB, rounded up: integer bytes, or a Kubernetes quantity
    string in the forms an API server writes memory (``10Gi``, ``512Mi``, ``1.5Gi``,
    ``10737418240``, ``10G``). ValueError says why anything else is refused (zero, negative,
    above 1 EiB, exponents, milli-bytes); a bool is not a number here."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("a memory quantity is integer bytes or a string like '10Gi'")
    if isinstance(value, int):
        total = value
    else:
        match = _QUANTITY.match(value)
        if match is None:
            raise ValueError(f"{value[:40]!r} is not a memory quantity like '10Gi', '512Mi' "
                             "or integer bytes")
        scale = _QUANTITY_SCALE[match[3]]
        fraction = match[2] or ""
        # Exact integer arithmetic: '1.5Gi' is 1610612736 bytes, rounded up to whole bytes.
        numerator = (int(match[1]) * 10**len(fraction) + int(fraction or 0)) * scale
        total = -(-numerator // 10**len(fraction))
    if total <= 0:
        raise ValueError("a memory quantity must be above zero")
    if total > MAX_QUANTITY_BYTES:
        raise ValueError("a memory quantity above 1 EiB is no GPU's")
    return -(-total // 2**20)
