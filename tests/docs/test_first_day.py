"""A newcomer's first day, run as a test: a fresh clone, ``make run``, the README tour, the
cookbook and docs/sharing.md's requests on that agent in sequence, then the kubelet plugin as
its bare-metal unit starts it, without a cluster, with wrong credentials and with the agent
down. Nothing prints a traceback; every error is one line that says what to do.

What is simulated about "fresh": the clone is a copy of this checkout's files as git sees them
(tracked and untracked-but-not-ignored, so uncommitted work is tested too) without ``.venv``,
``.gpu-agent-sim`` or ``build/``; its ``.venv`` is a link to the environment running the tests,
installed once by ``make``, and its ``pyproject.toml`` is dated before that environment's stamp,
so ``make run`` (the README's literal command) starts at once instead of installing again.
``PYTHONPATH`` is the clone, so ``make run`` and ``.venv/bin/gpu-agent`` run the clone's code
(as the clone's own editable install would), not the checkout the environment was made from.
The agent listens on a port of its choosing (``GPU_AGENT_LISTEN``, read back from
``listeners.json``) so parallel runs never collide; the docs' 9401 becomes that port.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.kubeplugin import reasons
from agent.kubeplugin.agent_client import UNREACHABLE_HINT
from tests.agent_process import AgentProcess
from tests.docs.scripts import (
    README,
    ROOT,
    cookbook,
    cookbook_setup,
    failure,
    node_state,
    readme_tour,
    run_script,
    sh_blocks,
    sharing_requests,
    shell_env,
)
from tests.kubeplugin.conftest import NODE, write_private
from tests.kubeplugin.plugin_run import PluginRun, StandIn, follow, kubeconfig, serve
from tests.tools import require_tool, unavailable
from tests.waiting import wait_for

STATE = ".gpu-agent-sim"
SOCKET = f"{STATE}/agent.sock"
PLUGIN_UNIT = Path("systemd") / "gpu-agent-kubelet-plugin.service"
#: A problem document the agent answers (RFC 9457), as curl prints it.
PROBLEM = re.compile(r'\{"type": "https://gpu\.nodeagent\.dev/problems/')


@dataclass
class Day:
    """The newcomer's clone, the environment of their shell, and everything printed to them."""

    root: Path
    clone: Path
    env: dict[str, str]
    seen: dict[str, str] = field(default_factory=dict)

    def script(self, what: str, script: str) -> subprocess.CompletedProcess[str]:
        """``script`` run in the clone; it must succeed."""
        done = run_script(script, self.clone, self.env)
        self.seen[what] = done.stdout + done.stderr
        assert done.returncode == 0, failure(done, what)
        return done


@pytest.fixture
def day() -> Iterator[Day]:
    """A fresh clone in a short directory (Unix socket paths hold at most 107 bytes)."""
    for tool, hint in (("git", "apt-get install git"), ("make", "apt-get install make"),
                       ("curl", "apt-get install curl")):
        require_tool(tool, hint)
    root = Path(tempfile.mkdtemp(prefix="fd-", dir="/tmp"))
    try:
        clone = fresh_clone(root / "clone")
        yield Day(root, clone, shell_env(PYTHONPATH=str(clone),
                                         GPU_AGENT_LISTEN=f"127.0.0.1:0,unix:{SOCKET}"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def fresh_clone(clone: Path) -> Path:
    """This checkout's files as git lists them, without environments, state or builds; its
    ``.venv`` the tests' environment, up to date for ``make``."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in listed:
        source = ROOT / name
        if not name or name.split("/")[0] in (".venv", STATE, "build") \
                or not os.path.lexists(source):
            continue
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, clone / name, follow_symlinks=False)
    stamp = Path(sys.prefix) / ".installed-stamp"
    if not stamp.exists():
        unavailable(f"{sys.prefix} was not made by make (no {stamp.name}): run `make check`")
    (clone / ".venv").symlink_to(sys.prefix)
    before = stamp.stat().st_mtime - 60
    os.utime(clone / "pyproject.toml", (before, before))
    # Never let the test reinstall the shared environment from the clone.
    assert subprocess.run(["make", "-q", ".venv/.installed-stamp"], cwd=clone,
                          check=False).returncode == 0, "make run would install again"
    return clone


def make_run(day: Day) -> AgentProcess:
    """``make run`` in the clone, in a process group of its own (a terminal's Ctrl-C signals
    the group), once it answers ready; its token read as the README says."""
    log_path = day.root / "make-run.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(["make", "run"], cwd=day.clone, env=day.env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    agent = AgentProcess(proc, day.clone / STATE, log_path)
    listeners = agent.state_dir / "listeners.json"

    def listening() -> bool:
        assert proc.poll() is None, f"make run exited {proc.returncode}:\n{agent.log()}"
        return listeners.exists()
    try:
        wait_for(listening, f"{listeners} (the agent listening)", 60)
        agent.url = next(u for u in json.loads(listeners.read_text())["listeners"]
                         if u.startswith("http://"))
        [line] = [line for block in sh_blocks(README) for line in block.splitlines()
                  if line.startswith("TOKEN=")]
        agent.token = day.script("the README's token line",
                                 f'{line}\nprintf %s "$TOKEN"').stdout
        agent.wait_ready(60)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return agent


def ctrl_c(agent: AgentProcess) -> int:
    """``make run``'s exit after a Ctrl-C in its terminal (the agent stopped with it)."""
    os.killpg(agent.proc.pid, signal.SIGINT)
    return agent.proc.wait(30)


def one_line_problems(output: str) -> list[str]:
    """Each problem document in ``output``, checked to be one line with a ``detail``."""
    details = []
    for found in PROBLEM.finditer(output):
        doc, end = json.JSONDecoder().raw_decode(output, found.start())
        assert "\n" not in output[found.start():end], output[found.start():end]
        assert doc["detail"], doc
        details.append(str(doc["detail"]))
    return details


# -- the kubelet plugin, as its bare-metal unit starts it --------------------------------------


def unit_command(day: Day, **paths: str) -> list[str]:
    """The plugin unit's ``ExecStart`` with this day's paths in place of the node's: the
    clone's ``gpu-agent``, ``paths`` for the flags named (an empty one dropped), the
    node name the unit takes from ``NODE_NAME`` and no extra arguments."""
    text = (day.clone / PLUGIN_UNIT).read_text()
    [start] = re.findall(r"^ExecStart=(.*)$", text, re.M)
    binary, *words = shlex.split(start)
    assert binary == "/usr/bin/gpu-agent" and words[0] == "kubelet-plugin", start
    flags = dict(w.removeprefix("--").split("=", 1) for w in words[1:] if w.startswith("--"))
    assert [w for w in words[1:] if not w.startswith("--")] == ["$KUBELET_PLUGIN_ARGS"], start
    assert flags["node-name"] == "${NODE_NAME}", start
    places = {"node-name": NODE, "registry-dir": str(day.root / "reg"),
              "plugins-dir": str(day.root / "plug"), "health-listen": "127.0.0.1:0",
              "agent-socket": str(day.clone / SOCKET), **paths}
    assert set(flags) - {"driver"} == set(places), "the unit's flags changed: follow them here"
    flags.update(places)
    return [".venv/bin/gpu-agent", "kubelet-plugin",
            *(f"--{name}={value}" for name, value in flags.items() if value != "")]


def plugin_env(day: Day) -> dict[str, str]:
    """Outside any cluster: no service account environment, no ``KUBECONFIG``, no
    ``~/.kube``."""
    env = {k: v for k, v in day.env.items()
           if not k.startswith(("KUBERNETES_", "KUBECONFIG", "GPU_AGENT_"))}
    return {**env, "HOME": str(day.root)}


def refused_start(day: Day, what: str, command: list[str]) -> str:
    """A plugin start that must fail: exit 2, one line on stderr (returned), nothing else."""
    done = subprocess.run(command, cwd=day.clone, env=plugin_env(day), capture_output=True,
                          text=True, timeout=60, check=False)
    day.seen[what] = done.stdout + done.stderr
    assert (done.returncode, done.stdout) == (2, ""), day.seen[what]
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-agent kubelet-plugin: "), done.stderr
    return lines[0]


def running_plugin(day: Day, command: list[str]) -> PluginRun:
    return follow(subprocess.Popen(command, cwd=day.clone, env=plugin_env(day),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))


def logged(run: PluginRun, msg: str) -> list[str]:
    """The plugin's text log lines saying ``msg``."""
    return [line for line in list(run.raw) if f'msg="{msg}"' in line or f"msg={msg} " in line]


def one_line_checks(run: PluginRun) -> dict[str, str]:
    """``/readyz``'s checks, each checked to be one line."""
    checks = {k: str(v) for k, v in run.readyz()[1]["checks"].items()}
    assert all("\n" not in text for text in checks.values()), checks
    return checks


def stopped(day: Day, what: str, run: PluginRun) -> None:
    """SIGTERM (systemd's stop) ends the plugin with 0; its output kept for the last check."""
    run.stop()
    day.seen[what] = run.output()
    assert run.proc.returncode == 0, run.output()


@pytest.fixture
def api_server() -> Iterator[StandIn]:
    """A stand-in API server that knows the node ``NODE`` and one bearer token."""
    yield from serve(StandIn(token=secrets.token_hex(16)))


# -- the day -----------------------------------------------------------------------------------


def test_a_newcomers_first_day_has_no_traceback_and_one_line_errors(
        day: Day, api_server: StandIn) -> None:
    """Fresh clone, ``make run``; the README tour (node left as found), the cookbook and
    docs/sharing.md's MPS claim on that agent, every command as written succeeding and every
    error the docs show a one-line problem with a detail. The plugin as its unit starts it:
    before the kubeconfig is written and outside any cluster, exit 2 with one line naming
    ``--kubeconfig``; with a wrong agent token and a wrong API token, each its own one-line
    ``/readyz`` reason and log line naming the credential; after a Ctrl-C of ``make run``, the
    agent unreachable, naming the socket (and the CLI's one line). No traceback anywhere."""
    # -P: the path a console script gets (no working directory), as .venv/bin/gpu-agent's.
    where = subprocess.run([".venv/bin/python", "-P", "-c", "import agent; print(agent.__file__)"],
                           cwd=day.clone, env=day.env, capture_output=True, text=True,
                           check=True).stdout.strip()
    assert Path(where) == day.clone / "agent" / "__init__.py", "not the clone's code"
    agent = make_run(day)
    running = True
    try:
        port = agent.address[1]
        fresh = node_state(agent)
        tour = day.script("the README tour", readme_tour(port))
        assert "rolled back, as the fault asked" in tour.stdout
        assert node_state(agent) == fresh, "the tour left the node changed"
        cooked = day.script("the cookbook", cookbook_setup(port) + cookbook())
        assert one_line_problems(cooked.stdout), "the cookbook shows no error answer any more"
        shared = day.script("docs/sharing.md", cookbook_setup(port) + sharing_requests(SOCKET))
        claim = json.loads(shared.stdout)
        assert [(d["sharing"]["strategy"], d["sharing"]["thread_percentage"])
                for d in claim["devices"]] == [("MPS", 50)], claim
        assert [d["state"] for d in claim["mps_daemons"]] == ["running"], claim
        assert agent.request("DELETE", f"/v1/claims/{claim['uid']}").status == 204
        for done in (tour, cooked, shared):  # an error on stderr is the CLI's one line
            assert all(line.startswith("gpu-agent: ") for line in done.stderr.splitlines()), \
                done.stderr

        api_config = kubeconfig(day.root / "kubeconfig", api_server.url, api_server.token)
        agent_token = day.clone / STATE / "tokens"
        missing = refused_start(day, "the plugin before its kubeconfig", unit_command(
            day, **{"token-file": str(agent_token), "kubeconfig": str(day.root / "none")}))
        assert "--kubeconfig" in missing and "write the plugin's kubeconfig there" in missing
        outside = refused_start(day, "the plugin outside a cluster", unit_command(
            day, **{"token-file": str(agent_token), "kubeconfig": ""}))
        assert "pass --kubeconfig PATH" in outside and "KUBERNETES_SERVICE_HOST" in outside

        wrong_agent_token = write_private(day.root / "wrong.token", secrets.token_hex(16) + "\n")
        wrong_api = kubeconfig(day.root / "wrong.kubeconfig", api_server.url, "not-the-token")
        wrong = running_plugin(day, unit_command(
            day, **{"token-file": str(wrong_agent_token), "kubeconfig": str(wrong_api)}))
        try:
            said = wrong.wait_check("agent", reasons.AGENT_TOKEN_REFUSED.text)
            assert str(wrong_agent_token) in said and "put the plugin's token" in said
            said = wrong.wait_check("api_server", reasons.API_CREDENTIAL_REFUSED.text)
            assert str(wrong_api) in said and "give the plugin a valid credential" in said
            one_line_checks(wrong)
            wait_for(lambda: logged(wrong, "agent token refused")
                     and logged(wrong, "api server credential refused"),
                     "a log line for each refused credential")
        finally:
            stopped(day, "the plugin with wrong tokens", wrong)

        running = False
        ctrl_c(agent)
        day.seen["make run"] = agent.log()
        # The README's first CLI command, with the agent stopped:
        gone = subprocess.run([".venv/bin/gpu-agent", "gpus"], cwd=day.clone, env=day.env,
                              capture_output=True, text=True, timeout=60, check=False)
        day.seen["the CLI with the agent down"] = gone.stdout + gone.stderr
        # Exit 3: the agent cannot be reached (docs/operations.md, "The CLI").
        assert (gone.returncode, gone.stdout, len(gone.stderr.splitlines())) == (3, "", 1), \
            gone.stderr
        assert gone.stderr.startswith("gpu-agent: ") and "--url" in gone.stderr, gone.stderr
        down = running_plugin(day, unit_command(
            day, **{"token-file": str(agent_token), "kubeconfig": str(api_config)}))
        try:
            said = down.wait_check("agent", reasons.AGENT_UNREACHABLE.text)
            assert str(day.clone / SOCKET) in said and said.endswith(UNREACHABLE_HINT), said
            checks = one_line_checks(down)
            assert checks["api_server"] == "ok", checks
            [line] = wait_for(lambda: logged(down, "agent unreachable"),
                              "the agent's absence logged")
            assert str(day.clone / SOCKET) in line and UNREACHABLE_HINT in line, line
        finally:
            stopped(day, "the plugin with the agent down", down)
    finally:
        if running:  # the test failed on the way: no MPS daemon outlives it
            with contextlib.suppress(OSError):
                agent.request("DELETE", "/v1/claims/c0ffee-1")
            ctrl_c(agent)
            day.seen["make run"] = agent.log()
    assert "agent stopped" in day.seen["make run"]
    assert not [what for what, text in day.seen.items() if "Traceback" in text], day.seen
