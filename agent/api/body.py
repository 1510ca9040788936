"""Request bodies from clients, read as hostile: JSON in UTF-8, nested at most
:data:`MAX_DEPTH` deep, every key once, numbers of a sane size, then validated by the route's
pydantic model in strict mode (``"60"`` is not a number, ``true`` is not a count).

Every refusal is a 4xx naming what was wrong; nothing here echoes the body back, and nothing
here can fail in a way that is not a :class:`~agent.errors.AgentError` (deep nesting,
a 5,000-digit number and ``NaN`` are refusals, not a ``RecursionError`` or ``ValueError``).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from typing import Any, TypeVar

from aiohttp import ClientPayloadError, web
from aiohttp.web_protocol import RequestPayloadError
from pydantic import BaseModel, ValidationError

from agent.errors import BadRequest, InvalidRequest

M = TypeVar("M", bound=BaseModel)

#: The document :func:`parse_body` parsed, kept for the request's audit line (which would
#: otherwise parse the same bytes again).
PARSED_BODY = web.RequestKey("parsed_body", object)

#: Deepest nesting of arrays and objects a body may have (the API's own need is under 6).
MAX_DEPTH = 400
#: Most digits an integer in a body may have: every integer the API takes fits in 64 bits.
MAX_INT_DIGITS = 20
_MAX_FLOAT_CHARS = 40


class BodyError(ValueError):
    """Why a JSON document was refused (the message is safe to show: it names no content)."""


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for key, value in pairs:
        if key in doc:
            raise BodyError(f"key {_shown(key)} appears twice in one object")
        doc[key] = value
    return doc


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise BodyError(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _bounded_float(text: str) -> float:
    if len(text) > _MAX_FLOAT_CHARS:
        raise BodyError(f"a number of {len(text)} characters (at most {_MAX_FLOAT_CHARS})")
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise BodyError(f"the number {text} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise BodyError(f"{name} is not JSON")


def _shown(key: str) -> str:
    return repr(key if len(key) <= 40 else key[:40] + "...")


def nesting_depth(doc: Any) -> int:
    """How deep arrays and objects nest in ``doc`` (a scalar is 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(doc, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in children)
    return deepest


# A string, or an unterminated one to the end: the pattern matches from every opening quote,
# so the scan never restarts inside a string (which made it quadratic in escaped quotes).
_STRING = re.compile(r'"(?:[^"\\]|\\[\s\S])*(?:"|\\?\Z)')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DELTA = {"[": 1, "{": 1, "]": -1, "}": -1}


def _bracket_depth(text: str) -> int:
    """An upper bound of the nesting depth of JSON text, read before parsing it: brackets
    outside strings. Every step runs in C (a regex, ``accumulate``), so a megabyte of
    brackets costs milliseconds, not a Python loop over each character."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return text.count("[") + text.count("{")
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if brackets.count("[") + brackets.count("{") <= MAX_DEPTH:
        return brackets.count("[") + brackets.count("{")
    return max(itertools.accumulate(map(_DELTA.__getitem__, brackets)), default=0)


def load_json(raw: bytes) -> Any:
    """``raw`` as a JSON document under this module's rules, or :class:`BodyError`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BodyError(f"not UTF-8 (byte {err.start})") from None
    # Brackets are counted before parsing: json's C parser recurses, and a deep enough
    # document is a RecursionError in it (or in anything that walks the result).
    if (depth := _bracket_depth(text)) > MAX_DEPTH:
        raise BodyError(f"nested more than {MAX_DEPTH} deep")
    try:
        return json.loads(text, object_pairs_hook=_refuse_duplicates, parse_int=_bounded_int,
                          parse_float=_bounded_float, parse_constant=_no_constant)
    except BodyError:
        raise
    except json.JSONDecodeError as err:
        raise BodyError(f"not valid JSON: {err.msg} at line {err.lineno} column "
                        f"{err.colno}") from None
    except (ValueError, RecursionError) as err:  # pragma: no cover - bounded above
        raise BodyError(f"not valid JSON ({type(err).__name__}, depth {depth})") from None


def field_path(loc: Sequence[int | str]) -> str:
    """The field a pydantic error location names, spelled as the services spell the fields
    they refuse: list positions in brackets, names after dots (``devices[0].sharing``);
    ``(body)`` for the document itself."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or "(body)"


def _field_errors(err: ValidationError) -> list[dict[str, Any]]:
    return [{"field": field_path(e["loc"]), "reason": e["msg"]}
            for e in err.errors(include_url=False, include_input=False)]


def validation_problem(err: ValidationError, what: str = "body") -> InvalidRequest:
    """A pydantic error as :class:`InvalidRequest` naming every offending field."""
    errors = _field_errors(err)
    first = errors[0]
    detail = f"invalid {what}: {first['field']}: {first['reason']}"
    if len(errors) > 1:
        detail += f" (and {len(errors) - 1} more)"
    return InvalidRequest(detail, errors)


def _document(raw: bytes) -> Any:
    try:
        return load_json(raw or b"null")
    except BodyError as err:
        raise BadRequest(f"body is {err}" if str(err).startswith("not")
                         else f"body refused: {err}") from None


def _validated(doc: Any, model: type[M]) -> M:
    # Strict mode: each JSON value keeps its type (a string never becomes a number or a
    # boolean, a boolean never a count). Validated from the parsed document, not the text:
    # pydantic's JSON parser stops at about 200 levels with no field named.
    try:
        return model.model_validate(doc, strict=True)
    except ValidationError as err:
        raise validation_problem(err) from None


def validate_body(raw: bytes, model: type[M]) -> M:
    """Validate a raw JSON body against ``model``: :class:`BadRequest` (400) for a document
    this module refuses, :class:`InvalidRequest` (422) naming each field the model refuses."""
    return _validated(_document(raw), model)


async def parse_body(request: web.Request, model: type[M]) -> M:
    """Read and validate a JSON body; bad input raises a 4xx naming what is wrong."""
    if request.content_type not in ("application/json", ""):
        raise BadRequest(f"expected Content-Type application/json, got "
                         f"{request.content_type[:64]!r}")
    try:
        raw = await request.read()
    except (ClientPayloadError, RequestPayloadError) as err:
        # A body that is not what its Content-Encoding says (or was cut short).
        raise BadRequest(f"body could not be read: {str(err).splitlines()[-1].strip()}") \
            from None
    doc = _document(raw)
    if raw:
        request[PARSED_BODY] = doc
    return _validated(doc, model)
