"""The ``/metrics`` body: the DCGM families rendered once per collection, joined at scrape
time with the live ``gpu_agent_*`` registry.

prometheus-client's ``generate_latest`` costs ~47 ms for the 1,920 DCGM series of a fully
split DGX H100, and it appends ``_total`` to every counter, which dcgm-exporter's names do not
have (``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION``). So the DCGM families are written by this small
renderer of the text format 0.0.4, in the collector thread, and a scrape only concatenates
bytes. The whole body is always text format 0.0.4, never OpenMetrics (which requires the
``_total`` suffix on counters).

Gzip: the DCGM block is compressed once per collection with a sync flush, and the compressor
state is kept; a scrape copies it and compresses only the small live block, so the reply is
one ordinary gzip member at the cost of the live block alone.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest

from agent.metrics.fields import FIELDS, XID_FIELD

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_GZIP_LEVEL = 6
_GZIP_WBITS = 31  # zlib with a gzip header and trailer

Value = int | float


def escape(value: str) -> str:
    """A label value as the text format needs it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def labels_text(pairs: Iterable[tuple[str, str]]) -> str:
    """``a="1",b="2"``: label pairs in the given order, without braces."""
    return ",".join(f'{name}="{escape(value)}"' for name, value in pairs)


def format_value(value: Value) -> str:
    """Integers as Go's ``%d``, floats as Go's ``%f`` (``30.982000``), as dcgm-exporter writes
    them; the text format's spellings for the non-finite values."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return f"{value:f}"


@dataclass(frozen=True)
class DeviceSeries:
    """One GPU or MIG GPU instance: its rendered labels and its field values."""

    labels: str
    values: Mapping[str, Value]


@dataclass(frozen=True)
class XidSeries:
    """DCGM_FI_DEV_XID_ERRORS of one GPU: the last XID (0 = none) and its message."""

    labels: str
    xid: int
    message: str


def render(devices: Sequence[DeviceSeries], xids: Sequence[XidSeries] = ()) -> bytes:
    """The DCGM families in field-table order; a family with no series is left out."""
    out: list[str] = []
    for field in FIELDS:
        if field.name == XID_FIELD:
            lines = [f'{field.name}{{{x.labels},err_code="{x.xid}",'
                     f'err_msg="{escape(x.message)}"}} {x.xid}' for x in xids]
        else:
            lines = [f"{field.name}{{{d.labels}}} {format_value(d.values[field.name])}"
                     for d in devices if field.name in d.values]
        if lines:
            out.append(f"# HELP {field.name} {_help(field.help)}")
            out.append(f"# TYPE {field.name} {field.kind.value}")
            out.extend(lines)
    return ("\n".join(out) + "\n").encode() if out else b""


def _help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


class CachedBlock:
    """Rendered bytes plus their gzip prefix, to be joined with a live tail per scrape."""

    def __init__(self, text: bytes) -> None:
        self.text = text
        self._compressor = zlib.compressobj(_GZIP_LEVEL, zlib.DEFLATED, _GZIP_WBITS)
        self._gzip_head = self._compressor.compress(text) + self._compressor.flush(
            zlib.Z_SYNC_FLUSH)

    def plain(self, tail: bytes) -> bytes:
        return self.text + tail

    def gzip(self, tail: bytes) -> bytes:
        compressor = self._compressor.copy()
        return self._gzip_head + compressor.compress(tail) + compressor.flush()


EMPTY = CachedBlock(b"")


def wants_gzip(accept_encoding: str) -> bool:
    """True if ``Accept-Encoding`` offers gzip with a non-zero quality."""
    for item in accept_encoding.split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip().lower() not in ("gzip", "*"):
            continue
        quality = params.strip().lower()
        if quality.startswith("q="):
            try:
                return float(quality[2:]) > 0
            except ValueError:
                return False
        return True
    return False


def scrape(block: CachedBlock, registry: CollectorRegistry, *,
           accept_encoding: str = "") -> tuple[bytes, dict[str, str]]:
    """The ``/metrics`` body and headers: the cached DCGM block, then the live registry."""
    live = generate_latest(registry)
    headers = {"Content-Type": CONTENT_TYPE, "Vary": "Accept-Encoding"}
    if wants_gzip(accept_encoding):
        headers["Content-Encoding"] = "gzip"
        return block.gzip(live), headers
    return block.plain(live), headers
