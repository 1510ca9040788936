"""The flags every client verb shares, and how a verb prints what it got.

One parent parser each, given to the top level, every verb and every subverb, so a flag may
come before or after the verb and subverb (``gpu-agent --url X mig show 0`` and
``gpu-agent mig show 0 --url X``). Their defaults are suppressed: a subparser that was not
given a flag then leaves the value an earlier level parsed alone (argparse copies a
subparser's whole namespace, defaults included, over its parent's); read them with
:func:`connection` and :func:`output_format`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

#: The connection flags, by destination: the verbs read them only through :func:`connection`.
CONNECTION_FLAGS = ("url", "token_file", "cacert", "cert", "key")

#: ``-o`` values: table (the default) fits 120 columns, wide shows every column in full.
FORMATS = ("table", "wide", "json", "yaml")

#: The width tables and their notes are cut to unless ``-o wide``.
TABLE_WIDTH = 120


def _connection_parser() -> argparse.ArgumentParser:
    opts = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    group = opts.add_argument_group("connection")
    group.add_argument("--url", metavar="URL",
                       help="agent address: http(s)://HOST:PORT, HOST:PORT or unix:PATH (or "
                            "GPU_AGENT_URL; default: a simulated agent started here, else "
                            "the node's socket)")
    group.add_argument("--token-file", metavar="FILE",
                       help="file with the token: the token alone, or a 'name:token[:scopes]' "
                            "line (or GPU_AGENT_TOKEN_FILE, or the token in GPU_AGENT_TOKEN)")
    group.add_argument("--cacert", metavar="PEM",
                       help="CA to trust for an https:// agent (or GPU_AGENT_CACERT; default: "
                            "the system's)")
    group.add_argument("--cert", metavar="PEM",
                       help="client certificate, for an agent started with --tls-client-ca "
                            "(or GPU_AGENT_CERT)")
    group.add_argument("--key", metavar="PEM",
                       help="the private key of --cert (or GPU_AGENT_KEY; default: in the "
                            "--cert file)")
    return opts


def _output_parser() -> argparse.ArgumentParser:
    opts = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    group = opts.add_argument_group("output")
    group.add_argument("-o", "--output", choices=FORMATS,
                       help=f"table (default: fits {TABLE_WIDTH} columns), wide (every column, "
                            "nothing cut), json or yaml (the agent's answer as it is)")
    group.add_argument("--json", dest="output", action="store_const", const="json",
                       help="same as -o json")
    return opts


#: The one parent parser of the connection flags (given to every client verb and subverb).
CONNECTION = _connection_parser()
#: The one parent parser of ``-o/--output`` (every client verb that prints an answer).
OUTPUT = _output_parser()


def connection(args: argparse.Namespace) -> dict[str, Any]:
    """The connection flags given anywhere on the command line (None where absent)."""
    return {name: getattr(args, name, None) for name in CONNECTION_FLAGS}


def output_format(args: argparse.Namespace) -> str:
    """``-o``'s value (``--json`` is ``-o json``); table when neither was given."""
    value: str = getattr(args, "output", None) or "table"
    return value


def wide(args: argparse.Namespace) -> bool:
    return output_format(args) == "wide"


def structured(args: argparse.Namespace) -> bool:
    """Whether ``-o`` asks for the agent's answer itself (json or yaml) rather than text."""
    return output_format(args) in ("json", "yaml")


def width(args: argparse.Namespace) -> int | None:
    """The width a table is cut to: :data:`TABLE_WIDTH`, or None (no limit) with ``-o wide``."""
    return None if wide(args) else TABLE_WIDTH


def dump(body: Any, fmt: str) -> str:
    """``body`` as JSON (indented) or YAML (block style, keys in the agent's order)."""
    if fmt == "yaml":
        import yaml  # noqa: PLC0415 - only -o yaml needs it

        text: str = yaml.safe_dump(body, sort_keys=False, allow_unicode=True)
        return text.rstrip("\n")
    return json.dumps(body, indent=2)


def emit(args: argparse.Namespace, body: Any,
         text: Callable[[Any, int | None], str] | None = None) -> None:
    """Print ``body`` as ``-o`` asks: ``text(body, width)`` for table and wide (JSON where the
    verb has no text form), the body itself for json and yaml."""
    fmt = output_format(args)
    if fmt in ("json", "yaml") or text is None:
        print(dump(body, "yaml" if fmt == "yaml" else "json"))
    else:
        print(text(body, width(args)))


def cut(line: str, limit: int | None) -> str:
    """``line`` cut to ``limit`` characters, ending in ``...`` where it was cut."""
    if limit is None or len(line) <= limit:
        return line
    return line[:max(limit - 3, 0)] + "..."
