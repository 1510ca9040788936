"""Kubernetes quantities (``resource.Quantity``) read as Kubernetes reads them.

A claim's memory fields (a share's ``capacity.memory``, NVIDIA's MPS pinned limits) are
Kubernetes quantities, and a value Kubernetes accepts must be accepted here, with the same
number: NVIDIA's driver decodes its config with ``k8s.io/apimachinery``'s parser, so a claim
that works there works here. The grammar (``k8s.io/apimachinery/pkg/api/resource``)::

    quantity  = [sign] number suffix          sign = "+" | "-"
    number    = digits | digits "." [digits] | "." [digits]      (no digit at all reads 0)
    suffix    = binary SI (Ki Mi Gi Ti Pi Ei) | decimal SI (n u m "" k M G T P E)
              | ("e" | "E") [sign] digits     (a decimal exponent: 1e9, 5E-3)

The value is then rounded away from zero to a whole nano (``1e-12`` reads ``1n``) and a
binary-SI value is capped at 2^63 - 1, as Kubernetes does; spaces around a JSON string's
text are ignored (``Quantity.UnmarshalJSON``; it reads the raw JSON, so an escaped character,
``\\t`` or ``\\u0031``, is refused there: here the decoded text is read, a difference only
for escaped spaces and digits). Kubernetes' own quirks are kept on purpose:
``1.`` and ``.5`` are numbers, a bare suffix (``Mi``, ``e5``) or sign reads 0, and an
exponent is an int64 narrowed to int32 (``1e4294967296`` reads 1). Refused: anything else
(``1KiB``, ``1K``, ``1e``, ``0x10``, ``1 Gi``), and, unlike Kubernetes, a text over
:data:`MAX_TEXT` characters. Values beyond +/-10^40 saturate there: no GPU quantity is near
it, and ``1e999999999`` must not cost a billion-digit integer.
"""

from __future__ import annotations

import math
from fractions import Fraction

#: Longer quantity texts are refused (Kubernetes sets no bound; a request body does).
MAX_TEXT = 256
#: Magnitudes beyond this saturate (see the module docstring).
SATURATION = 10**40
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15,
            "E": 18}
_SUFFIX_CHARS = frozenset("eEinumkKMGTP")
_DIGITS = frozenset("0123456789")
_NANO = Fraction(1, 10**9)
_BINARY_CAP = 2**63 - 1
#: What ``Quantity.UnmarshalJSON`` trims and a JSON text can carry unescaped: Go's
#: ``unicode.IsSpace`` less the control characters. It trims the raw JSON text, escapes
#: included, so a tab (which JSON must escape, ``\\t``) is refused, as any escape is.
_GO_SPACE = " \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008" \
            "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"


class QuantityError(ValueError):
    """Not a Kubernetes quantity; the message says why (it quotes at most 40 characters)."""


def parse_quantity(text: str) -> Fraction:
    """The exact value Kubernetes gives the quantity ``text`` (a JSON string's content), or
    :class:`QuantityError`."""
    text = text.strip(_GO_SPACE)
    shown = repr(text[:40])
    if len(text) > MAX_TEXT:
        raise QuantityError(f"a quantity of more than {MAX_TEXT} characters is refused")
    if not text:
        raise QuantityError("an empty string is not a quantity")
    negative, digits, fraction, suffix, bare = _scan(text, shown)
    if suffix in _DECIMAL:
        base, exponent = 10, _DECIMAL[suffix]
    elif suffix in _BINARY:
        base, exponent = 2, _BINARY[suffix]
    elif len(suffix) > 1 and suffix[0] in "eE" and _integer(suffix[1:]):
        parsed = int(suffix[1:])
        if not -2**63 <= parsed < 2**63:
            raise QuantityError(f"{shown}: the exponent is out of range")
        base, exponent = 10, (parsed + 2**31) % 2**32 - 2**31  # Go's int32(int64)
    else:
        raise QuantityError(f"{shown}: unknown suffix {suffix[:20]!r} (a quantity ends in Ki, "
                            "Mi, Gi, Ti, Pi, Ei, n, u, m, k, M, G, T, P, E or an exponent "
                            "like e9)")
    if bare and (exponent < -9 if base == 10 else exponent * 3 // 10 > 13):
        # Kubernetes reads this text on its arbitrary-precision path (an exponent below
        # nano; a binary suffix of Pi and up), which finds no digit to read.
        raise QuantityError(f"{shown}: no digits before the suffix")
    significand = int(digits + fraction or "0")
    if significand == 0:
        return Fraction(0)
    if base == 2:
        value = Fraction(significand, 10**len(fraction)) * 2**exponent
        value = min(_round_up_to_nano(value), Fraction(_BINARY_CAP))
    else:
        scale = exponent - len(fraction)
        order = len(str(significand)) + scale  # 10^(order-1) <= value < 10^order
        if order > 41:
            value = Fraction(SATURATION)
        elif order < -12:
            value = _NANO  # below a nano: Kubernetes rounds it up to one
        else:
            value = _round_up_to_nano(Fraction(significand) * Fraction(10) ** scale)
    value = min(value, Fraction(SATURATION))
    return -value if negative else value


def _scan(text: str, shown: str) -> tuple[bool, str, str, str, bool]:
    """(negative, integer digits, fraction digits, suffix, no digit at all) of ``text``, by
    Kubernetes' scanner: sign, digits, ``.`` and digits, suffix letters, then an optional
    sign and digits."""
    at, end = 0, len(text)
    negative = text[0] == "-"
    if text[0] in "+-":
        at = 1
    start = at
    while at < end and text[at] in _DIGITS:
        at += 1
    digits = text[start:at]
    fraction = ""
    if at < end and text[at] == ".":
        at += 1
        start = at
        while at < end and text[at] in _DIGITS:
            at += 1
        fraction = text[start:at]
    bare = not digits and not fraction
    start = at
    while at < end and text[at] in _SUFFIX_CHARS:
        at += 1
    if at < end and text[at] in "+-":
        at += 1
    while at < end and text[at] in _DIGITS:
        at += 1
    if at != end:
        raise QuantityError(f"{shown} is not a quantity like '10Gi', '512Mi', '10G' or '1e9'")
    return negative, digits, fraction, text[start:], bare


def _integer(text: str) -> bool:
    """Whether Go's ``strconv.ParseInt(text, 10, 64)`` syntax holds (the range is the
    caller's)."""
    body = text[1:] if text[:1] in ("+", "-") else text
    return bool(body) and all(c in _DIGITS for c in body)


def _round_up_to_nano(value: Fraction) -> Fraction:
    """``value`` rounded away from zero to a whole nano (Kubernetes' smallest unit)."""
    nanos = value / _NANO
    whole = math.ceil(nanos) if nanos >= 0 else math.floor(nanos)
    return whole * _NANO


def quantity_of(value: object) -> Fraction:
    """A quantity given in JSON: a string as :func:`parse_quantity` reads it, an integer
    as itself, a finite float by its shortest text (what JSON had); anything else (a bool,
    null, an object) is :class:`QuantityError`."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise QuantityError("a quantity is a string like '10Gi' or a number")
    if isinstance(value, int):
        if abs(value) > SATURATION:
            return Fraction(SATURATION if value > 0 else -SATURATION)
        return Fraction(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise QuantityError("a quantity is a finite number")
        return parse_quantity(repr(value))
    return parse_quantity(value)


def kubernetes_value(quantity: Fraction) -> int:
    """``Quantity.Value()`` of a quantity of at least 0: rounded up to a whole unit (bytes,
    for memory). (Kubernetes rounds a negative one either way, by how it holds it; every
    negative memory quantity is refused, so that is never asked.)"""
    return math.ceil(quantity)
