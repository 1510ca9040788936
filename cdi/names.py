"""CDI names: ``vendor/class`` kinds and ``vendor/class=device`` qualified device names, with
the reference library's rules (``pkg/parser``; reference B3)."""

from __future__ import annotations

import functools
import re

_VENDOR_OR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?\Z")
# Device names may start with a digit and contain ':' (MIG devices are named "0:1").
_DEVICE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?\Z")
_SPEC_ID = re.compile(r"^[A-Za-z0-9_.-]+$")


class CdiNameError(ValueError):
    """A vendor, class, kind or device name the CDI library would reject."""


def check_vendor(vendor: str) -> str:
    if not _VENDOR_OR_CLASS.match(vendor):
        raise CdiNameError(f"invalid CDI vendor {vendor!r}: letters first, then letters, "
                           "digits, '_', '.', '-', ending with a letter or digit")
    return vendor


def check_class(cls: str) -> str:
    if not _VENDOR_OR_CLASS.match(cls):
        raise CdiNameError(f"invalid CDI class {cls!r}: letters first, then letters, digits, "
                           "'_', '.', '-', ending with a letter or digit")
    return cls


def check_device(name: str) -> str:
    if not _DEVICE.match(name):
        raise CdiNameError(f"invalid CDI device name {name!r}: letters, digits, '_', '.', "
                           "'-', ':', starting and ending with a letter or digit")
    return name


@functools.lru_cache(maxsize=64)  # a handful of kinds, checked on every claim's spec
def split_kind(kind: str) -> tuple[str, str]:
    """``vendor/class`` → (vendor, class), both checked."""
    vendor, sep, cls = kind.partition("/")
    if not sep:
        raise CdiNameError(f"invalid CDI kind {kind!r}: expected vendor/class")
    return check_vendor(vendor), check_class(cls)


def qualified(kind: str, device: str) -> str:
    """``vendor/class=device``."""
    split_kind(kind)
    return f"{kind}={check_device(device)}"


def transient_file_name(kind: str, spec_id: str) -> str:
    """``<vendor>-<class>_<id>.json`` (``GenerateTransientSpecName``)."""
    vendor, cls = split_kind(kind)
    if not _SPEC_ID.match(spec_id):
        raise CdiNameError(f"invalid transient spec id {spec_id!r}")
    return f"{vendor}-{cls}_{spec_id}.json"


def spec_file_name(kind: str) -> str:
    """``<vendor>-<class>.json`` (``GenerateSpecName``)."""
    vendor, cls = split_kind(kind)
    return f"{vendor}-{cls}.json"
