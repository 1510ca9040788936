"""A strict reader of the Prometheus text format 0.0.4, for tests: sample names exactly as
written (prometheus-client's parser renames counter samples to ``*_total``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)",?')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float
    label_order: tuple[str, ...] = ()


@dataclass
class Exposition:
    samples: list[Sample] = field(default_factory=list)
    help: dict[str, str] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)

    def named(self, name: str) -> list[Sample]:
        return [s for s in self.samples if s.name == name]

    def names(self) -> set[str]:
        return {s.name for s in self.samples}


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), value)


def parse(text: str) -> Exposition:
    """Every line must be a comment, HELP, TYPE or a sample; anything else raises."""
    out = Exposition()
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# HELP "):
            name, _, text_ = line[7:].partition(" ")
            out.help[name] = text_
            continue
        if line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            out.types[name] = kind
            continue
        if line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"not a sample line: {line!r}")
        name, raw, value = match.groups()
        labels: dict[str, str] = {}
        order: list[str] = []
        if raw:
            pos = 0
            while pos < len(raw):
                label = _LABEL.match(raw, pos)
                if label is None:
                    raise ValueError(f"bad labels in {line!r}")
                labels[label.group(1)] = _unescape(label.group(2))
                order.append(label.group(1))
                pos = label.end()
        out.samples.append(Sample(name, labels, float(value), tuple(order)))
    return out
