"""``gpu-agent completion bash|zsh|fish`` (issue 24): a script generated from the parser, so
every verb, subverb, flag and choice the parser has is completed; each script sourced and run
in the real shell (zsh and fish where installed)."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
from functools import cache
from pathlib import Path

import pytest

from agent.cli import completion
from agent.cli.main import main, parser
from tests.tools import require_tool

#: The verbs a parser's usage line offers: ``{show,set,apply,export} ...``.
_VERBS_IN_USAGE = re.compile(r"\{([^{}\s]+)\}\s+\.\.\.")


def _usage(path: tuple[str, ...]) -> str:
    """The usage lines ``gpu-agent PATH --help`` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser().parse_args([*path, "--help"])
    return out.getvalue().split("\n\n")[0]


@cache
def _verb_paths(path: tuple[str, ...] = ()) -> tuple[tuple[tuple[str, ...], str], ...]:
    """Every (parent path, verb) of the CLI, aliases included, as its own --help lists them
    (read independently of the completion module's walk of the parser)."""
    found: list[tuple[tuple[str, ...], str]] = []
    listed = _VERBS_IN_USAGE.search(_usage(path))
    for verb in listed.group(1).split(",") if listed else ():
        if verb != "UID":  # 'claims UID' is 'claims show UID', not a verb
            found += [(path, verb), *_verb_paths((*path, verb))]
    return tuple(found)


def test_every_verb_and_subverb_of_the_parser_is_in_the_script() -> None:
    script = completion.bash(parser())
    lines = {line.strip().split(")", 1)[0]: line for line in script.splitlines()
             if ") verbs=" in line}
    paths = list(_verb_paths())
    assert len(paths) > 40
    for parent, verb in paths:
        offered = lines[shlex.quote(" ".join(parent))].split("verbs=", 1)[1].split(";")[0]
        assert verb in " ".join(shlex.split(offered)).split(), (parent, verb)


def test_the_zsh_script_is_the_bash_one_through_bashcompinit() -> None:
    script = completion.zsh(parser())
    assert "bashcompinit" in script and script.endswith(completion.bash(parser()))


def test_the_verb_prints_the_script(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["completion", "bash"]) == 0
    assert capsys.readouterr().out == completion.bash(parser())


#: How each shell loads the script and calls the function as its completion system does
#: (zsh's bashcompinit runs it with ksharrays, so COMP_WORDS counts from 0 as in bash).
SHELLS = {"bash": (["bash", "--norc", "--noprofile", "-c"], ""),
          "zsh": (["zsh", "-f", "-c"], "autoload -U compinit && compinit -u -D\n")}


def _complete(script: Path, *lines: str, shell: str = "bash") -> list[list[str]]:
    """COMPREPLY for each command line (its last word the one being completed), from the
    script sourced in a real shell run in the script's directory."""
    command, prelude = SHELLS[shell]
    calls = "".join(
        f"COMP_WORDS=({' '.join(shlex.quote(w) for w in words)}); "
        f"COMP_CWORD={len(words) - 1}; COMPREPLY=(); _gpu_agent; "
        "printf '%s ' \"${COMPREPLY[@]}\"; echo\n"
        for words in (shlex.split(line) + ([""] if line.endswith(" ") else []) for line in lines))
    ksh = "setopt ksharrays\n" if shell == "zsh" else ""
    done = subprocess.run([*command, f"{prelude}source {shlex.quote(str(script))}\n{ksh}{calls}"],
                          capture_output=True, text=True, timeout=30, check=True,
                          cwd=script.parent)
    assert done.stderr == ""
    return [line.split() for line in done.stdout.splitlines()]


def test_bash_completes_verbs_subverbs_flags_and_choices(tmp_path: Path) -> None:
    script = tmp_path / "gpu-agent.bash"
    script.write_text(completion.bash(parser()))
    top, mig, output, prefix, after_url, resolve, kubernetes, alias, file_value = _complete(
        script,
        "gpu-agent ", "gpu-agent mig ", "gpu-agent gpus -o ", "gpu-agent gpus --to",
        "gpu-agent --url unix:/s mig s", "gpu-agent admin resolve 0 ",
        "gpu-agent topo slices --kubernetes 1.3", "gpu-agent admin clear-h",
        "gpu-agent claims --token-file gpu-agent.b")
    assert set(top) == {verb for parent, verb in _verb_paths() if parent == ()}
    assert mig == ["show", "set", "apply", "export"]
    assert output == ["table", "wide", "json", "yaml"]
    assert prefix == ["--token-file"]
    assert after_url == ["show", "set"]
    assert resolve == ["roll-back", "finish"]
    assert kubernetes == ["1.34", "1.35", "1.36", "1.37"]
    assert alias == ["clear-health"]
    assert file_value == ["gpu-agent.bash"]  # a value without choices: a file


def test_bash_offers_every_subverb_of_every_verb(tmp_path: Path) -> None:
    script = tmp_path / "gpu-agent.bash"
    script.write_text(completion.bash(parser()))
    paths = list(_verb_paths())
    parents = sorted({parent for parent, _ in paths})
    offered = _complete(script, *(" ".join(["gpu-agent", *parent]) + " " for parent in parents))
    for parent, got in zip(parents, offered, strict=True):
        want = [verb for p, verb in paths if p == parent]
        assert set(want) <= set(got), (parent, got)


def test_zsh_completes_the_same_through_bashcompinit(tmp_path: Path) -> None:
    """zsh matches the prefix itself (compadd), so its candidates, filtered by the word
    typed, are bash's."""
    require_tool("zsh", "apt-get install zsh")
    script = tmp_path / "gpu-agent.zsh"
    script.write_text(completion.zsh(parser()))
    lines = ["gpu-agent ", "gpu-agent mig ", "gpu-agent gpus -o ", "gpu-agent gpus --to",
             "gpu-agent --url unix:/s mig s", "gpu-agent admin resolve 0 ",
             "gpu-agent topo slices --kubernetes 1.3", "gpu-agent claims --token-file gpu-a"]
    bash_script = tmp_path / "gpu-agent.bash"
    bash_script.write_text(completion.bash(parser()))
    expected = _complete(bash_script, *lines)
    got = _complete(script, *lines, shell="zsh")
    assert ["gpu-agent.bash", "gpu-agent.zsh"] in map(sorted, expected)  # files, in both
    for line, zsh_words, bash_words in zip(lines, got, expected, strict=True):
        typed = "" if line.endswith(" ") else line.split()[-1]
        assert sorted(w for w in zsh_words if w.startswith(typed)) == sorted(bash_words), line


def test_fish_completes_what_bash_does(tmp_path: Path) -> None:
    """fish's own completion (``complete -C``) of the generated script offers what bash's
    does, for every verb path and for flags, choices and files."""
    require_tool("fish", "apt-get install fish")
    bash_script = tmp_path / "gpu-agent.bash"
    bash_script.write_text(completion.bash(parser()))
    script = tmp_path / "gpu-agent.fish"
    script.write_text(completion.fish(parser()))
    parents = sorted({parent for parent, _ in _verb_paths()})
    lines = [" ".join(["gpu-agent", *parent]) + " " for parent in parents] + [
        "gpu-agent gpus -o ", "gpu-agent gpus --to", "gpu-agent --url unix:/s mig s",
        "gpu-agent admin resolve 0 ", "gpu-agent topo slices --kubernetes 1.3",
        "gpu-agent admin clear-h", "gpu-agent claims --token-file gpu-agent.b"]
    calls = "".join(f"echo (complete -C {shlex.quote(line)} | cut -f1)\n"
                    for line in lines)
    done = subprocess.run(["fish", "--no-config", "-c", f"source {shlex.quote(str(script))}\n"
                           f"{calls}"], capture_output=True, text=True, timeout=60, check=True,
                          cwd=tmp_path)
    assert done.stderr == ""
    got = [line.split() for line in done.stdout.splitlines()]
    for line, fish_words, bash_words in zip(lines, got, _complete(bash_script, *lines),
                                            strict=True):
        assert sorted(fish_words) == sorted(bash_words), line
