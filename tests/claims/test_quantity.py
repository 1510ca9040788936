"""Kubernetes quantities (agent/quantity.py) read as Kubernetes reads them: a table of the
forms Kubernetes documents and its parser's corner cases, properties over generated
quantities, and a differential test against ``k8s.io/apimachinery``'s own parser
(tests/claims/quantity, pinned to the version tests/deploy/celcheck uses)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agent.device_names import quantity_mib
from agent.quantity import (
    SATURATION,
    QuantityError,
    kubernetes_value,
    parse_quantity,
    quantity_of,
)
from tests import gobuild

QUANTITY_GO = Path(__file__).resolve().parent / "quantity"

#: Kubernetes's documented forms ("Resource units in Kubernetes": 128974848, 129e6, 129M,
#: 128974848000m and 123Mi are about the same memory) and the parser's corner cases, with
#: the exact value Kubernetes gives each (checked against its parser by the differential
#: test below).
ACCEPTED = [
    ("128974848", 128974848), ("129e6", 129 * 10**6), ("129M", 129 * 10**6),
    ("128974848000m", 128974848), ("123Mi", 123 * 2**20), ("1e9", 10**9), ("1E3", 1000),
    ("1E", 10**18), ("1e+3", 1000), ("5e-3", Fraction(5, 1000)), ("1G", 10**9),
    ("1Gi", 2**30), ("1.5Gi", 3 * 2**29), ("0.1Ki", Fraction(1024, 10)), ("1k", 1000),
    ("1n", Fraction(1, 10**9)), ("1u", Fraction(1, 10**6)), ("+1Ki", 1024),
    ("-1.5Gi", -3 * 2**29), ("1.", 1), (".5", Fraction(1, 2)), ("1.G", 10**9),
    ("007", 7), (" 1Gi\u00a0", 2**30), ("1e-12", Fraction(1, 10**9)), ("0", 0), ("-0", 0),
    ("Mi", 0), ("e5", 0), ("+", 0), (".", 0), ("9Ei", 2**63 - 1), ("1e4294967296", 1),
    ("1e0009", 10**9), ("1.5e3", 1500),
]
#: What Kubernetes refuses.
REFUSED = ["", "\t1Gi", "1KiB", "1K", "1e", "1e+", "0x10", "1 Gi", "1Gii", "--1",
           "1e3.5", "1Ki3", "1mi", "1.2.3", ".e-10", "+e-10", "1EE", "²", "1\x1c", "Gi1",
           "1e3Gi", "1" + "0" * 300]


@pytest.mark.parametrize(("text", "value"), ACCEPTED)
def test_kubernetes_forms_read_as_kubernetes_reads_them(text: str,
                                                         value: int | Fraction) -> None:
    """Decimal and binary SI, decimal exponents, signs, fractions and Kubernetes's own
    quirks (a bare suffix reads 0, values round up to a nano, binary SI caps at 2^63 - 1,
    an exponent narrows to int32) give Kubernetes's value."""
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", REFUSED)
def test_what_kubernetes_refuses_is_refused(text: str) -> None:
    """Malformed quantities, unknown suffixes and (unlike Kubernetes) texts over 256
    characters are refused with a reason."""
    with pytest.raises(QuantityError):
        parse_quantity(text)


@pytest.mark.parametrize(("given", "mib"), [
    ("1e9", 954), (1e9, 954), ("1G", 954), ("10Gi", 10240), (10737418240, 10240),
    ("100m", 1), ("1.5Gi", 1536), ("1048577", 2)])
def test_memory_quantities_take_every_kubernetes_form(given: object, mib: int) -> None:
    """A share's memory (``quantity_mib``) takes every form Kubernetes accepts, ``1e9``
    included (refused at beeb01d), as whole MiB rounded up."""
    assert quantity_mib(given) == mib


# Quantities over generated parts: every grammar production, and texts one character off it.
_SUFFIXES = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P",
             "E", "K", "i", "KiB", "mi", "e", "E+", "e-"]
_parts = st.tuples(
    st.sampled_from(["", "+", "-"]), st.text("0123456789", max_size=22),
    st.sampled_from(["", "."]), st.text("0123456789", max_size=12),
    st.one_of(st.sampled_from(_SUFFIXES),
              st.builds(lambda e, sign, n: f"{e}{sign}{n}", st.sampled_from(["e", "E"]),
                        st.sampled_from(["", "+", "-"]), st.integers(0, 30))))
quantities = st.one_of(
    st.builds(lambda p: "".join(map(str, p)), _parts),
    st.text(st.sampled_from("0123456789.+-eEinumkKMGTP x"), max_size=12))


@given(quantities)
@example("1e9")
@example("e-10")
@example("1.e-10")
def test_a_quantity_is_refused_or_has_one_value(text: str) -> None:
    """Every text is either refused with :class:`QuantityError` or read as one exact value;
    ``Value()`` is that value rounded up to a whole unit."""
    try:
        value = parse_quantity(text)
    except QuantityError:
        return
    assert kubernetes_value(value) >= value > kubernetes_value(value) - 1


@given(st.integers(min_value=0, max_value=2**32), st.sampled_from(
    [("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("k", 10**3), ("M", 10**6),
     ("G", 10**9), ("e3", 10**3), ("E6", 10**6)]))
def test_a_suffix_is_its_factor(number: int, suffix: tuple[str, int]) -> None:
    """``<n><suffix>`` is n times the suffix's factor, signed either way (below the binary
    cap)."""
    text, factor = suffix
    assert parse_quantity(f"{number}{text}") == number * factor
    assert parse_quantity(f"-{number}{text}") == -number * factor


@pytest.mark.parametrize("given", [True, None, {}, [], float("inf"), float("nan")])
def test_a_quantity_is_a_string_or_a_number(given: object) -> None:
    """Booleans, null, objects and non-finite numbers are no quantity."""
    with pytest.raises(QuantityError):
        quantity_of(given)


@pytest.fixture(scope="session")
def kubernetes_parser() -> Callable[[list[str]], list[dict[str, object]]]:
    """``parse(json_values) -> answers`` through apimachinery's ``Quantity.UnmarshalJSON``
    (a Go program, built once)."""
    binary = gobuild.build(QUANTITY_GO, gobuild.BUILD / "quantity" / "quantity", timeout_s=600)

    def parse(values: list[str]) -> list[dict[str, object]]:
        done = subprocess.run([str(binary)], input="".join(f"{v}\n" for v in values),
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        return [json.loads(line) for line in done.stdout.splitlines()]

    return parse


def _agree(parse: Callable[[list[str]], list[dict[str, object]]], texts: list[str]) -> None:
    answers = parse([json.dumps(t, ensure_ascii=False) for t in texts])
    assert len(answers) == len(texts)
    for text, answer in zip(texts, answers, strict=True):
        try:
            mine: Fraction | None = parse_quantity(text)
        except QuantityError:
            mine = None
        if mine is None:
            assert not answer["ok"], f"{text!r}: Kubernetes reads {answer}, refused here"
            continue
        assert answer["ok"], f"{text!r}: Kubernetes refuses it ({answer['error']}), " \
                             f"read {mine} here"
        if abs(mine) >= SATURATION:
            continue  # saturated here on purpose (agent/quantity.py)
        assert Fraction(str(answer["exact"])) == mine, f"{text!r}: {answer} vs {mine}"
        if 0 <= mine < 2**62:  # (a negative's Value() depends on Go's representation)
            assert answer.get("value", 0) == kubernetes_value(mine), f"{text!r}: {answer}"


def test_the_table_agrees_with_kubernetes(
        kubernetes_parser: Callable[[list[str]], list[dict[str, object]]]) -> None:
    """Every accepted and refused example above is what apimachinery's parser says."""
    _agree(kubernetes_parser, [t for t, _ in ACCEPTED] + REFUSED[:-1])


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(quantities, min_size=1, max_size=50))
def test_generated_quantities_agree_with_kubernetes(
        kubernetes_parser: Callable[[list[str]], list[dict[str, object]]],
        texts: list[str]) -> None:
    """Generated quantities (every production, and texts one character off): accepted or
    refused as apimachinery does, with its exact value and ``Value()``."""
    _agree(kubernetes_parser, texts)
