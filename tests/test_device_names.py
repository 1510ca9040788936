"""Device names round-trip and are DNS labels."""

from __future__ import annotations

import re

import pytest

from agent.device_names import (
    ParsedName,
    ascii_integer,
    gpu_device_name,
    mig_device_name,
    parse_device_name,
)

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@pytest.mark.parametrize(("name", "parsed"), [
    (gpu_device_name(3), ParsedName(3)),
    (mig_device_name(2, "1g.24gb", 19, 0), ParsedName(2, "1g24gb", 19, 0)),
    (mig_device_name(0, "1g.10gb+me", 20, 6), ParsedName(0, "1g10gbme", 20, 6)),
    (mig_device_name(7, "7g.141gb", 0, 0), ParsedName(7, "7g141gb", 0, 0)),
])
def test_names_round_trip_and_are_dns_labels(name: str, parsed: ParsedName) -> None:
    assert DNS_LABEL.match(name)
    assert parse_device_name(name) == parsed


@pytest.mark.parametrize("name", ["gpu", "gpu-a", "GPU-0", "gpu-0-mig-1g.10gb-19-0", "mig-1",
                                  "gpu-02", "gpu-\u0662", "gpu-2\n", "gpu-0-mig-1g10gb-19-00"])
def test_other_strings_are_not_device_names(name: str) -> None:
    assert parse_device_name(name) is None


@pytest.mark.parametrize(("text", "value"), [
    ("0", 0), ("7", 7), ("0042", None), ("00", None), ("9" * 18, int("9" * 18)),
    ("", None), ("-1", None), ("+1", None), (" 1", None), ("1.0", None), ("\u00b2", None),
    ("\u0663", None), ("\uff11", None), ("9" * 19, None),
])
def test_ascii_integer(text: str, value: int | None) -> None:
    assert ascii_integer(text) == value
