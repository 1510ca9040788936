"""``gpu-agent completion bash|zsh|fish``: a shell completion script generated from the parser
itself (verbs, subverbs, flags and their choices), so it cannot drift from the commands it
completes."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

SHELLS = ("bash", "zsh", "fish")

_INSTALL = """\
bash: add 'source <(gpu-agent completion bash)' to ~/.bashrc, or write it to
/etc/bash_completion.d/gpu-agent. zsh: add 'source <(gpu-agent completion zsh)' to ~/.zshrc,
after compinit. fish: gpu-agent completion fish > ~/.config/fish/completions/gpu-agent.fish.
A new shell then completes verbs, subverbs, flags and flag values."""


@dataclass(frozen=True)
class Flag:
    """One option of a verb: its spellings, whether it takes a value, and the values listed."""

    strings: tuple[str, ...]
    valued: bool
    choices: tuple[str, ...] | None


@dataclass(frozen=True)
class Level:
    """What may follow one verb path (``""`` for the top, ``"mig set"``...) on the line."""

    path: str
    verbs: tuple[str, ...]
    options: tuple[Flag, ...]
    positional: tuple[str, ...] = ()
    """The values the positional arguments take, where the parser lists them."""

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple(s for flag in self.options for s in flag.strings)

    @property
    def valued(self) -> tuple[str, ...]:
        """The flags that take a value (the next word is theirs, not a verb)."""
        return tuple(s for flag in self.options if flag.valued for s in flag.strings)

    @property
    def choices(self) -> dict[str, tuple[str, ...]]:
        """Each flag's values, where the parser lists them."""
        return {s: flag.choices for flag in self.options if flag.choices is not None
                for s in flag.strings}


def add_parser(sub: Any) -> None:
    completion = sub.add_parser(
        "completion", help="print a shell completion script (bash, zsh, fish)",
        description="Print a completion script for the shell, generated from this "
                    "gpu-agent's own commands.", epilog=_INSTALL)
    completion.add_argument("shell", choices=SHELLS)


def levels(parser: argparse.ArgumentParser, path: str = "") -> Iterator[Level]:
    """Every verb path under ``parser``, top first; an alias is a path of its own."""
    verbs: dict[str, argparse.ArgumentParser] = {}
    flags: list[Flag] = []
    positional: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            verbs.update(action._name_parser_map.items())
        elif action.help == argparse.SUPPRESS:
            continue
        elif action.option_strings:
            flags.append(Flag(tuple(action.option_strings), action.nargs != 0,
                              None if action.choices is None or action.nargs == 0
                              else tuple(map(str, action.choices))))
        elif action.choices is not None:
            positional += map(str, action.choices)
    yield Level(path, tuple(verbs), tuple(flags), tuple(positional))
    for name, child in verbs.items():
        yield from levels(child, f"{path} {name}".strip())


def _words(words: tuple[str, ...] | list[str]) -> str:
    return shlex.quote(" ".join(words))


def bash(parser: argparse.ArgumentParser) -> str:
    """The bash script: ``_gpu_agent`` walks the words typed so far through the verb paths,
    skipping each flag's value, then offers the flags, verbs or values that fit there."""
    level_cases = []
    choice_cases = []
    for level in levels(parser):
        level_cases.append(
            f"        {shlex.quote(level.path)}) verbs={_words(level.verbs)}; "
            f"flags={_words(level.flags)}; valued={_words(level.valued)}; "
            f"positional={_words(level.positional)} ;;")
        for flag, values in level.choices.items():
            choice_cases.append(f"        {shlex.quote(f'{level.path}|{flag}')}) "
                                f"echo {_words(values)} ;;")
    return _BASH.format(prog=parser.prog, levels="\n".join(level_cases),
                        choices="\n".join(choice_cases))


def zsh(parser: argparse.ArgumentParser) -> str:
    """The zsh script: the bash one, through zsh's own bash-completion layer."""
    return ("# gpu-agent completion for zsh: the bash script through bashcompinit.\n"
            "autoload -U +X bashcompinit && bashcompinit\n" + bash(parser))


def fish(parser: argparse.ArgumentParser) -> str:
    """The fish script: ``__gpu_agent_at PATH`` tells whether the words typed so far lead to
    that verb path (each flag's value skipped); a ``complete`` line per verb path and flag."""
    verb_cases, valued_cases, lines = [], [], []
    for level in levels(parser):
        if not re.fullmatch(r"[a-z0-9 -]*", level.path):
            raise ValueError(f"verb path {level.path!r}: not a plain word for a fish pattern")
        if level.verbs:
            verb_cases.append(f"        case '{level.path}'\n            printf '%s\\n' "
                              + " ".join(map(shlex.quote, level.verbs)))
        if level.valued:
            valued_cases.append(f"        case '{level.path}'\n            printf '%s\\n' "
                                + " ".join(map(shlex.quote, level.valued)))
        when = f"-n \"__gpu_agent_at '{level.path}'\""
        if level.verbs or level.positional:
            lines.append(f"complete -c {parser.prog} {when} -a "
                         + _words((*level.verbs, *level.positional)))
        for flag in level.options:
            spelled = " ".join(f"-l {s[2:]}" if s.startswith("--") else f"-s {s[1:]}"
                               for s in flag.strings)
            value = "" if not flag.valued else " -r -F" if flag.choices is None \
                else f" -x -a {_words(flag.choices)}"
            lines.append(f"complete -c {parser.prog} {when} {spelled}{value}")
    return _FISH.format(prog=parser.prog, verbs="\n".join(verb_cases),
                        valued="\n".join(valued_cases), lines="\n".join(lines))


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    script = {"bash": bash, "zsh": zsh, "fish": fish}[args.shell]
    print(script(parser), end="")
    return 0


# Bash that zsh's bashcompinit runs as well: no associative arrays, no unquoted expansion
# that needs word splitting, no variable named as a zsh special one (path, words).
_BASH = """\
# {prog} completion for bash, generated from its parser: {prog} completion bash
_gpu_agent_level() {{
    # What may follow the verb path $1: verbs, flags, valued (flags taking a value) and the
    # values of positional arguments.
    case "$1" in
{levels}
        *) verbs=""; flags=""; valued=""; positional="" ;;
    esac
}}

_gpu_agent_choices() {{
    # The values of flag $2 after the verb path $1, where the parser lists them.
    case "$1|$2" in
{choices}
    esac
}}

_gpu_agent() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" verb_path="" word i skip=0 choices
    local verbs flags valued positional
    _gpu_agent_level ""
    for (( i = 1; i < COMP_CWORD; i++ )); do
        word="${{COMP_WORDS[i]}}"
        if (( skip )); then
            skip=0
            continue
        fi
        case "$word" in
            --*=*) continue ;;
            -*) case " $valued " in *" $word "*) skip=1 ;; esac; continue ;;
        esac
        case " $verbs " in
            *" $word "*)
                verb_path="${{verb_path:+$verb_path }}$word"
                _gpu_agent_level "$verb_path" ;;
        esac
    done
    if (( skip )); then
        choices="$(_gpu_agent_choices "$verb_path" "${{COMP_WORDS[COMP_CWORD-1]}}")"
        if [[ -n "$choices" ]]; then
            COMPREPLY=( $(compgen -W "$choices" -- "$cur") )
        else
            COMPREPLY=( $(compgen -f -- "$cur") )
        fi
    elif [[ "$cur" == -* ]]; then
        COMPREPLY=( $(compgen -W "$flags" -- "$cur") )
    else
        COMPREPLY=( $(compgen -W "$verbs $positional" -- "$cur") )
    fi
    return 0
}}

complete -F _gpu_agent {prog}
"""

_FISH = """\
# {prog} completion for fish, generated from its parser: {prog} completion fish
function __gpu_agent_verbs --argument-names verb_path
    switch "$verb_path"
{verbs}
    end
end

function __gpu_agent_valued --argument-names verb_path
    switch "$verb_path"
{valued}
    end
end

function __gpu_agent_at --argument-names want
    # Whether the words before the cursor lead to the verb path $want.
    set -l verb_path ''
    set -l skip 0
    for word in (commandline -opc)[2..-1]
        if test $skip -eq 1
            set skip 0
            continue
        end
        switch $word
            case '--*=*'
                continue
            case '-*'
                if contains -- $word (__gpu_agent_valued "$verb_path")
                    set skip 1
                end
                continue
        end
        if contains -- $word (__gpu_agent_verbs "$verb_path")
            set verb_path (string trim -- "$verb_path $word")
        end
    end
    test "$verb_path" = "$want"
end

complete -c {prog} -f
{lines}
"""
