"""MIG profile names from memory sizes: go-nvlib's formula over the reference's real values."""

from __future__ import annotations

import pytest

from agent.gpu.inventory import cpu_list
from agent.gpu.naming import mig_profile_name

H100 = 81559
H200 = 143771
A100_40 = 40960
A100_80 = 81920


@pytest.mark.parametrize(("slices", "memory_mib", "total", "me", "name"), [
    (1, 9984, H100, False, "1g.10gb"),
    (1, 9984, H100, True, "1g.10gb+me"),
    (1, 20096, H100, False, "1g.20gb"),
    (2, 20096, H100, False, "2g.20gb"),
    (3, 40448, H100, False, "3g.40gb"),
    (4, 40448, H100, False, "4g.40gb"),
    (7, 81152, H100, False, "7g.80gb"),
    (1, 4864, A100_40, False, "1g.5gb"),
    (1, 9856, A100_40, False, "1g.10gb"),
    (2, 9856, A100_40, False, "2g.10gb"),
    (3, 19968, A100_40, False, "3g.20gb"),
    (7, 40192, A100_40, False, "7g.40gb"),
    (1, 16384, H200, False, "1g.18gb"),
    (1, 33024, H200, False, "1g.35gb"),
    # 70.5 GB: Go's math.Round gives 71, Python's round() would give 70.
    (3, 71168, H200, False, "3g.71gb"),
    (7, 143104, H200, False, "7g.141gb"),
    # Driver 580.159.04 on a real H200 reports 256 MiB more from 2 slices up: same names.
    (1, 33280, H200, False, "1g.35gb"),
    (3, 71424, H200, False, "3g.71gb"),
    (7, 143360, H200, False, "7g.141gb"),
    (1, 9984, A100_80, False, "1g.10gb"),
    (7, 81024, A100_80, False, "7g.80gb"),
])
def test_profile_names_match_the_real_tools(slices: int, memory_mib: int, total: int, me: bool,
                                            name: str) -> None:
    assert mig_profile_name(slices, memory_mib, total, media_extensions=me) == name


@pytest.mark.parametrize(("words", "text"), [
    ([0], ""),
    ([1], "0"),
    ([0b1011], "0-1,3"),
    ([(1 << 64) - 1, 1], "0-64"),
    ([0, 0, 0xFF], "128-135"),
])
def test_cpu_list(words: list[int], text: str) -> None:
    assert cpu_list(words) == text
