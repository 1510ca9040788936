"""The compute-domain benchmark runs at tiny size (2 + 1 nodes, one 2-node domain) against the
real components, and its table says what it measured (so it cannot rot). No timing is
asserted."""

from __future__ import annotations

import pytest

from bench import compute_domains
from tests.k8s.domain_bed import BED_GROUP
from tests.k8s.harness import NEWEST, build


@pytest.mark.slow
@pytest.mark.xdist_group(BED_GROUP)
def test_compute_domain_bench_forms_a_domain_and_counts_its_writes(
        capsys: pytest.CaptureFixture[str]) -> None:
    build(NEWEST)
    compute_domains.main(["--first", "2", "--second", "1", "--sizes", "2"])
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("nodes"))
    row = lines[header + 1].split()
    assert row[0] == "2"
    # Two patches of its own Node per member (join, ready), the same for every member.
    assert row[6] == "2", lines
    assert "nodes" in lines[header + 1], lines
    assert lines[header + 2].startswith("3-node job: Pending,"), lines
    assert "cannot allocate all claims" in lines[header + 2], lines
    assert lines[header + 3].startswith("its claim: ComputeDomainUnfit: asks for a compute "
                                        "domain of 3 nodes in one NVLink clique"), lines
