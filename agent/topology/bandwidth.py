"""Per-link bandwidths, in GB/s (10^9 bytes per second) per direction.

NVLink (``reference/topology.md`` 2.4): NVLink1 20 GB/s per link; NVLink2, 3 and 4 25 GB/s
(A100 12 x 25 = 300, H100 18 x 25 = 450 per direction); NVLink5 50 GB/s (GB200: 18 x 53.125
as nvidia-smi rounds the signalling rate). NVLink6 is not in the reference; it is taken as
NVLink5's until measured. Keys are ``nvmlNvlinkVersion_t`` values, which differ from the
generation numbers (3.0 is 4, 4.0 is 6).

PCIe: the usable rate per lane after line coding (8b/10b for Gen1-2, 128b/130b for Gen3-5,
FLIT for Gen6) times the width; a x16 Gen4 link carries 31.5 GB/s per direction.
"""

from __future__ import annotations

NVLINK_GB_S: dict[int, float] = {
    1: 20.0,   # 1.0
    2: 25.0,   # 2.0
    3: 25.0,   # 2.2
    4: 25.0,   # 3.0 (A100)
    5: 25.0,   # 3.1
    6: 25.0,   # 4.0 (H100, H200)
    7: 50.0,   # 5.0 (B200, GB200)
    8: 50.0,   # 6.0: not in the reference; assumed equal to 5.0
}
#: When a GPU does not report its NVLink version: the most common per-link rate (NVLink2-4).
NVLINK_DEFAULT_GB_S = 25.0

PCIE_LANE_GB_S: dict[int, float] = {
    1: 0.25,
    2: 0.5,
    3: 0.985,
    4: 1.969,
    5: 3.938,
    6: 7.563,
}
#: When NVML does not report the link: PCIe Gen3 x16, the oldest a data-centre GPU has.
PCIE_DEFAULT_GB_S = round(PCIE_LANE_GB_S[3] * 16, 3)


def nvlink_gb_s(version: int) -> float:
    """Bandwidth of one NVLink of this ``nvmlNvlinkVersion_t`` (unknown: the common rate)."""
    return NVLINK_GB_S.get(version, NVLINK_DEFAULT_GB_S)


def pcie_gb_s(generation: int | None, width: int | None) -> float:
    """Bandwidth of a PCIe link; the Gen3 x16 default when NVML did not say."""
    if generation is None or width is None or generation not in PCIE_LANE_GB_S or width <= 0:
        return PCIE_DEFAULT_GB_S
    return round(PCIE_LANE_GB_S[generation] * width, 3)
