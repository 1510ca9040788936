"""The sharing bench (bench/sharing.py) runs every kind of claim without a refusal."""

from __future__ import annotations

from bench import sharing


def test_sharing_bench_prepares_every_kind() -> None:
    """One sample of each kind is prepared and unprepared, and the report names them all."""
    found = sharing.run(samples=1)
    assert {k: (len(s.prepare_s), s.errors) for k, s in found.items()} == {
        **{k.name: (1, []) for k in sharing.KINDS}, "tool": (1, [])}
