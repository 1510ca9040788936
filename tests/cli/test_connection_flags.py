"""The connection flags on every client verb (issue 24): ``--url``, ``--token-file``,
``--cacert``, ``--cert`` and ``--key`` are read wherever they stand: before the verb, between
verb and subverb, after the subverb or after its arguments."""

from __future__ import annotations

import pytest

from agent.cli import options
from agent.cli.main import parser

#: Each client verb as (its verb and subverb words, the arguments it needs).
VERBS: list[tuple[list[str], list[str]]] = [
    (["node"], []), (["gpus"], []),
    (["mig", "show"], []), (["mig", "set"], ["0", "3g.40gb"]), (["mig", "export"], []),
    (["mig", "apply"], ["-f", "m.yaml", "-c", "all-1g"]), (["transitions"], []),
    (["claims"], []), (["claims"], ["uid-1"]), (["claims", "show"], ["uid-1"]),
    (["claims", "prepare"], ["uid-1", "--gpu", "0"]), (["claims", "unprepare"], ["uid-1"]),
    (["cdi", "list"], []),
    (["topo"], []), (["topo", "select"], ["2"]), (["topo", "slices"], []),
    (["admin", "clear-quarantine"], ["0"]), (["admin", "clear-xid"], ["0"]),
    (["admin", "clear-health"], ["0"]), (["admin", "drain"], ["0", "--reason", "r"]),
    (["admin", "undrain"], ["0"]), (["admin", "resolve"], ["0", "finish"]),
    (["admin", "checkpoint"], []), (["support-bundle"], []),
    (["sim", "show"], []), (["sim", "process", "add"], ["0"]), (["sim", "process", "rm"], ["7"]),
    (["sim", "fault", "add"], ["nvmlInit", "NVML_ERROR_UNKNOWN"]), (["sim", "fault", "clear"], []),
    (["sim", "latency"], ["nvmlInit=0.1"]), (["sim", "xid"], ["0", "48"]),
    (["sim", "reset"], ["0"]), (["sim", "reload-driver"], []),
]

FLAGS = {"url": "https://node:9401", "token_file": "/etc/t", "cacert": "/ca.pem",
         "cert": "/c.pem", "key": "/k.pem"}
ARGV_FLAGS = ["--url", FLAGS["url"], "--token-file", FLAGS["token_file"], "--cacert",
              FLAGS["cacert"], "--cert", FLAGS["cert"], "--key", FLAGS["key"]]


def _placed(words: list[str], rest: list[str], where: int) -> list[str]:
    """The command line with the flags after ``where`` verb words (past them all: at the end)."""
    if where > len(words):
        return [*words, *rest, *ARGV_FLAGS]
    return [*words[:where], *ARGV_FLAGS, *words[where:], *rest]


CASES = [pytest.param(words, rest, where, id=f"{' '.join([*words, *rest])}@{where}")
         for words, rest in VERBS for where in range(len(words) + 2)]


@pytest.mark.parametrize(("words", "rest", "where"), CASES)
def test_connection_flags_are_read_in_any_position(words: list[str], rest: list[str],
                                                   where: int) -> None:
    args = parser().parse_args(_placed(words, rest, where))
    assert options.connection(args) == FLAGS


def test_flags_split_over_levels_are_all_kept() -> None:
    args = parser().parse_args(["--url", FLAGS["url"], "claims", "--cacert", FLAGS["cacert"],
                                "show", "uid-1", "--token-file", FLAGS["token_file"]])
    assert options.connection(args) == {**FLAGS, "cert": None, "key": None}
    assert args.uid == "uid-1"


def test_no_flag_leaves_each_unset() -> None:
    assert options.connection(parser().parse_args(["gpus"])) == dict.fromkeys(FLAGS)
