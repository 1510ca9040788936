"""The renderer writes dcgm-exporter's text: exact names, escaped labels, Go-style numbers;
the gzip reply is one ordinary gzip member; the live registry follows the cached block."""

from __future__ import annotations

import gzip
import math
import zlib

import pytest
from prometheus_client import CollectorRegistry, Counter

from agent.metrics.exposition import (
    CONTENT_TYPE,
    CachedBlock,
    DeviceSeries,
    XidSeries,
    format_value,
    labels_text,
    render,
    scrape,
    wants_gzip,
)
from tests.metrics.textformat import parse


@pytest.mark.parametrize(("value", "text"), [
    (87, "87"), (0, "0"), (-3, "-3"), (312.45, "312.450000"), (0.381124, "0.381124"),
    (1e-9, "0.000000"), (math.nan, "NaN"), (math.inf, "+Inf"), (-math.inf, "-Inf"),
])
def test_values_are_formatted_like_go(value: float, text: str) -> None:
    """Integers as %d, floats as %f (dcgm-exporter's `30.982000`), text-format infinities."""
    assert format_value(value) == text


def test_label_values_are_escaped_and_round_trip() -> None:
    tricky = 'a "quoted" back\\slash\nnewline'
    text = render([DeviceSeries(labels_text([("gpu", "0"), ("modelName", tricky)]),
                                {"DCGM_FI_DEV_GPU_UTIL": 5})])
    sample = parse(text.decode()).named("DCGM_FI_DEV_GPU_UTIL")[0]
    assert sample.labels == {"gpu": "0", "modelName": tricky}


def test_families_follow_the_table_and_empty_ones_are_left_out() -> None:
    devices = [DeviceSeries('gpu="0"', {"DCGM_FI_DEV_POWER_USAGE": 300.5,
                                        "DCGM_FI_DEV_SM_CLOCK": 1980}),
               DeviceSeries('gpu="1"', {"DCGM_FI_DEV_SM_CLOCK": 1755})]
    text = render(devices).decode()
    assert text.index("DCGM_FI_DEV_SM_CLOCK") < text.index("DCGM_FI_DEV_POWER_USAGE")
    assert "GPU_UTIL" not in text  # no series, so no HELP/TYPE either
    exposition = parse(text)
    assert [s.value for s in exposition.named("DCGM_FI_DEV_SM_CLOCK")] == [1980, 1755]
    assert exposition.types == {"DCGM_FI_DEV_SM_CLOCK": "gauge",
                                "DCGM_FI_DEV_POWER_USAGE": "gauge"}
    assert render([]) == b""


def test_xid_series_carry_code_and_message() -> None:
    text = render([], [XidSeries('gpu="0"', 79, "GPU has fallen off the bus"),
                       XidSeries('gpu="1"', 0, "No Error")]).decode()
    samples = parse(text).named("DCGM_FI_DEV_XID_ERRORS")
    assert [(s.labels, s.value) for s in samples] == [
        ({"gpu": "0", "err_code": "79", "err_msg": "GPU has fallen off the bus"}, 79),
        ({"gpu": "1", "err_code": "0", "err_msg": "No Error"}, 0)]


def test_gzip_reply_is_one_member_of_block_and_live_tail() -> None:
    """Strict single-member decoders (zlib with the gzip wrapper) read the whole body."""
    block = CachedBlock(b"# cached DCGM block\n" * 500)
    for tail in (b"", b"live_metric 1\n", b"x" * 100_000):
        body = block.gzip(tail)
        decoder = zlib.decompressobj(31)
        assert decoder.decompress(body) + decoder.flush() == block.text + tail
        assert decoder.eof and decoder.unused_data == b""
        assert gzip.decompress(body) == block.plain(tail)


@pytest.mark.parametrize(("header", "wanted"), [
    ("gzip", True), ("gzip, deflate, br", True), ("deflate, gzip;q=0.5", True),
    ("GZIP", True), ("*", True), ("gzip;q=0", False), ("identity", False), ("", False),
    ("br;q=1.0, gzip;q=0.0", False), ("gzip;q=bogus", False),
])
def test_accept_encoding(header: str, wanted: bool) -> None:
    assert wants_gzip(header) is wanted


def test_scrape_joins_the_cached_block_and_the_live_registry() -> None:
    registry = CollectorRegistry()
    counter = Counter("gpu_agent_things", "Things", registry=registry)
    block = CachedBlock(render([DeviceSeries('gpu="0"', {"DCGM_FI_DEV_GPU_UTIL": 7})]))
    counter.inc(3)
    body, headers = scrape(block, registry)
    assert headers == {"Content-Type": CONTENT_TYPE, "Vary": "Accept-Encoding"}
    exposition = parse(body.decode())
    assert exposition.named("DCGM_FI_DEV_GPU_UTIL")[0].value == 7
    assert exposition.named("gpu_agent_things_total")[0].value == 3
    counter.inc()
    zipped, headers = scrape(block, registry, accept_encoding="gzip")
    assert headers["Content-Encoding"] == "gzip"
    assert parse(gzip.decompress(zipped).decode()).named("gpu_agent_things_total")[0].value == 4
