"""mig-manager's node labels, opt in (``--mig-config-map NAMESPACE/NAME``): the plugin follows
its own Node's ``nvidia.com/mig.config`` label, applies that label of the ConfigMap's
``config.yaml`` (mig-parted's ``version: v1`` format, as the GPU Operator's
``default-mig-parted-config``) through the agent's ``POST /v1/mig/apply``, and reports in
``nvidia.com/mig.config.state``: ``pending`` while applying, then ``success`` or ``failed``.

``rebooting`` is never written: no reboot is needed. Hopper and newer change MIG mode at once;
an Ampere mode change is finished by the agent's own GPU reset when ``--mig-allow-reset`` is
given (the agent's ``--gpu-reset-command``), and otherwise ends ``failed`` saying the mode is
pending a reset.

Level-triggered: a watch on the Node and one on the ConfigMap only wake the loop, which then
reads both afresh and asks :func:`decide` (pure) what to do, so a burst of changes is one
apply of the latest and a stale watch event is never acted on. An apply is run again when the
label changes, when the ConfigMap's ``config.yaml`` changes (the label now means something
else; an edit that leaves this label's entry as it was is a dry run that changes nothing), at
start-up, and when someone removes the state label (the way to retry a failed apply without
touching the label). The config itself is checked by the agent, so an unknown label or a bad
profile fails with the agent's own 422 detail.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

from agent.kubeplugin.agent_client import AgentClient, token_file_usable
from agent.kubeplugin.errors import AgentCallError, AgentRefused
from agent.kubeplugin.kube import (
    CALL_TIMEOUT_S,
    KubeClient,
    KubeError,
    KubeExpired,
    KubeNotFound,
)

log = logging.getLogger("agent.kubeplugin.miglabels")

Json = dict[str, Any]
CONFIG_LABEL = "nvidia.com/mig.config"
STATE_LABEL = "nvidia.com/mig.config.state"
#: The ConfigMap key mig-manager reads (the GPU Operator's ``default-mig-parted-config``).
CONFIG_KEY = "config.yaml"
#: How often a running apply is asked how it goes.
POLL_S = 0.25
#: Back-off after a failed call to the API server or the agent.
RETRY_S = 2.0
#: A plan and its first steps; a drain that waits is polled, not held in one call.
APPLY_CALL_TIMEOUT_S = 120.0


class State(StrEnum):
    """The values of ``nvidia.com/mig.config.state`` this plugin writes (never ``rebooting``)."""

    PENDING = "pending"
    SUCCESS = "success"
    FAILED = "failed"


# --- settings ------------------------------------------------------------------------------

def config_map_ref(text: str) -> tuple[str, str]:
    """``NAMESPACE/NAME`` as (namespace, name); :class:`ValueError` saying what is wrong."""
    namespace, sep, name = text.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise ValueError(f"--mig-config-map {text!r}: expected NAMESPACE/NAME, e.g. "
                         "gpu-operator/default-mig-parted-config")
    return namespace, name


def settings_problem(config_map: str | None, token_file: Path | None) -> str | None:
    """Why the mig-manager label flags cannot work together, or None (both off is fine)."""
    if config_map is None:
        return "--mig-token-file needs --mig-config-map" if token_file is not None else None
    try:
        config_map_ref(config_map)
    except ValueError as err:
        return str(err)
    if token_file is None:
        return ("--mig-config-map needs --mig-token-file: a token of the agent's 'geometry' "
                "scope (the claims token stays claims-only)")
    problem = token_file_usable(token_file)
    return f"--mig-token-file: {problem}" if problem else None


# --- decisions (pure) ----------------------------------------------------------------------

@dataclass(frozen=True)
class ConfigSource:
    """What the ConfigMap gives now: its ``config.yaml`` text, or why there is none."""

    text: str | None
    problem: str = ""

    @property
    def digest(self) -> str:
        """Names this content: an apply is run again when it changes."""
        if self.text is None:
            return "missing: " + self.problem
        return hashlib.sha256(self.text.encode()).hexdigest()


@dataclass(frozen=True)
class Handled:
    """What was last carried through to a state label: that label under that config."""

    label: str
    digest: str


@dataclass(frozen=True)
class Idle:
    """Nothing to do."""

    reason: str


@dataclass(frozen=True)
class Apply:
    """Apply ``label`` of ``config`` (YAML text) through the agent."""

    label: str
    config: str
    handled: Handled


@dataclass(frozen=True)
class Fail:
    """Set ``failed`` without asking the agent: there is no config to apply."""

    label: str
    reason: str
    handled: Handled


Action = Idle | Apply | Fail


def decide(*, label: str | None, state: str | None, config: ConfigSource,
           handled: Handled | None) -> Action:
    """What to do for the Node's ``label`` and ``state`` labels, the ConfigMap's content, and
    what this process last carried through (None: nothing since it started)."""
    if not label:
        return Idle(f"the Node has no {CONFIG_LABEL} label")
    now = Handled(label, config.digest)
    if handled == now and state is not None:
        return Idle(f"{label!r} is handled ({STATE_LABEL}={state})")
    if config.text is None:
        return Fail(label, config.problem, now)
    return Apply(label, config.text, now)


@dataclass(frozen=True)
class Outcome:
    """A state to set and why (the line logged with it)."""

    state: State
    reason: str


def _gpu_problems(rows: Sequence[Mapping[str, Any]]) -> str:
    parts = []
    for row in rows:
        if row.get("state") in ("succeeded", "unchanged", "planned"):
            continue
        why = row.get("error") or row.get("state")
        parts.append(f"GPU {row.get('index')}: {row.get('state')}: {why}")
    return "; ".join(parts)


def _blockers(rows: Sequence[Mapping[str, Any]]) -> str:
    return "; ".join(
        f"GPU {row.get('index')}: {b.get('instance')} in use by {b.get('kind')} {b.get('id')}"
        for row in rows for b in row.get("blockers") or [])


def dry_run_outcome(answer: Mapping[str, Any]) -> Outcome | None:
    """The state a dry run already decides (every GPU unchanged: ``success``; something in
    use: ``failed``, as the apply would be refused), or None: the apply must run."""
    rows = list(answer.get("transitions") or [])
    blocked = _blockers(rows)
    if blocked:
        return Outcome(State.FAILED, "instances the change destroys are in use: " + blocked)
    if all(row.get("state") == "unchanged" for row in rows):
        skipped = len(answer.get("skipped") or [])
        return Outcome(State.SUCCESS, "already applied" + (
            f" ({skipped} GPU(s) without MIG skipped)" if skipped else ""))
    return None


def apply_outcome(answer: Mapping[str, Any]) -> Outcome | None:
    """The state an apply's answer ends in, or None while it runs."""
    overall = answer.get("state")
    if overall == "running":
        return None
    rows = list(answer.get("transitions") or [])
    if overall == "succeeded":
        changed = sum(1 for row in rows if row.get("state") == "succeeded")
        return Outcome(State.SUCCESS, f"applied to {changed} GPU(s)")
    return Outcome(State.FAILED, f"apply {answer.get('apply_id')} ended {overall}: "
                   + (_gpu_problems(rows) or "no GPU succeeded"))


# --- effects: the agent and the API server -------------------------------------------------

class MigAgent(AgentClient):
    """The agent's ``/v1/mig/apply`` with the ``geometry``-scoped token of
    ``--mig-token-file`` (the claims client never holds it)."""

    async def apply(self, config: str, label: str, *, dry_run: bool,
                    allow_reset: bool) -> Json:
        """``POST /v1/mig/apply`` (``?dry_run=true``): the apply's answer; the agent's
        refusal (422 unknown label or bad config, 409 in use) as :class:`AgentRefused`."""
        status, headers, answer = await self._call(
            "POST", "/v1/mig/apply", body={"config": config, "label": label,
                                           "allow_reset": allow_reset},
            params={"dry_run": "true"} if dry_run else None, timeout_s=APPLY_CALL_TIMEOUT_S)
        if status not in (200, 202) or not isinstance(answer, dict):
            self._raise(status, headers, answer)
        result: Json = answer
        return result

    async def apply_status(self, apply_id: str) -> Json:
        """``GET /v1/mig/apply/{id}``."""
        status, headers, answer = await self._call(
            "GET", f"/v1/mig/apply/{quote(apply_id, safe='')}", timeout_s=CALL_TIMEOUT_S)
        if status != 200 or not isinstance(answer, dict):
            self._raise(status, headers, answer)
        result: Json = answer
        return result


class LabelKube(KubeClient):
    """The API server calls of the label mode (raw JSON, as :class:`KubeClient`): the
    ConfigMap, and a merge patch of the Node's labels."""

    async def get_config_map(self, namespace: str, name: str) -> Json:
        return await self._call("GET", f"/api/v1/namespaces/{namespace}/configmaps/{name}")

    async def patch_node_labels(self, name: str, labels: Mapping[str, str | None]) -> Json:
        """A JSON merge patch of ``metadata.labels`` (None removes a label): only the labels
        named are touched, and no read-modify-write races kubelet's own Node updates."""
        return await self.patch_node_metadata(name, labels=labels)


def node_marks(node: Json | None) -> tuple[str | None, str | None]:
    """The Node's (``nvidia.com/mig.config``, ``nvidia.com/mig.config.state``) labels."""
    labels = ((node or {}).get("metadata") or {}).get("labels") or {}
    return labels.get(CONFIG_LABEL), labels.get(STATE_LABEL)


def config_text(config_map: Json | None) -> str | None:
    """The ConfigMap's ``config.yaml`` (None: no ConfigMap, or no such key)."""
    value = ((config_map or {}).get("data") or {}).get(CONFIG_KEY)
    return value if isinstance(value, str) else None


class MigLabels:
    """The label mode's loop: two watches that wake it, and :meth:`reconcile`."""

    def __init__(self, kube: LabelKube, agent: MigAgent, *, node_name: str, config_map: str,
                 allow_reset: bool = False) -> None:
        self.kube = kube
        self.agent = agent
        self.node_name = node_name
        self.namespace, self.config_name = config_map_ref(config_map)
        self.allow_reset = allow_reset
        self.handled: Handled | None = None
        self._wake = asyncio.Event()

    @classmethod
    async def open(cls, *, kubeconfig: Path | None, agent_socket: Path, token_file: Path,
                   node_name: str, config_map: str, allow_reset: bool) -> MigLabels:
        """Its own API server client (same credentials as the plugin's) and agent client."""
        # from_environment builds ``cls``; its annotation says only KubeClient.
        kube = cast(LabelKube, await LabelKube.from_environment(kubeconfig))
        return cls(kube, MigAgent(agent_socket, token_file), node_name=node_name,
                   config_map=config_map, allow_reset=allow_reset)

    async def close(self) -> None:
        await self.kube.close()
        await self.agent.close()

    @property
    def where(self) -> str:
        return f"ConfigMap {self.namespace}/{self.config_name}"

    async def run(self) -> None:
        """Follow the labels until cancelled."""
        log.info("following the Node's MIG config label", extra={
            "node": self.node_name, "config_map": f"{self.namespace}/{self.config_name}",
            "label": CONFIG_LABEL})
        watches = [
            asyncio.create_task(self._follow("/api/v1/nodes", self.node_name, node_marks)),
            asyncio.create_task(self._follow(
                f"/api/v1/namespaces/{self.namespace}/configmaps", self.config_name,
                config_text))]
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                try:
                    await self.reconcile()
                except asyncio.CancelledError:
                    raise
                except (KubeError, AgentCallError) as err:
                    log.warning("MIG config label: will try again",
                                extra={"error": str(err), "retry_in_s": RETRY_S})
                    await asyncio.sleep(RETRY_S)
                    self._wake.set()
                except Exception:
                    # A bug must not end the mode silently while the plugin runs on.
                    log.exception("MIG config label: reconcile failed; trying again",
                                  extra={"retry_in_s": RETRY_S})
                    await asyncio.sleep(RETRY_S)
                    self._wake.set()
        finally:
            for task in watches:
                task.cancel()
            for task in watches:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _follow(self, collection: str, name: str,
                      marks: Callable[[Json | None], object]) -> None:
        """Wake the loop whenever ``marks`` of the object changes (and after every list)."""
        seen: object = object()
        while True:
            try:
                version, item = await self.kube.list_named(collection, name)
                seen = marks(item)
                self._wake.set()
                while True:
                    async for event in self.kube.watch_named(collection, name, version):
                        version = event.resource_version or version
                        if event.type == "BOOKMARK":
                            continue
                        now = marks(None if event.type == "DELETED" else event.object)
                        if now != seen:
                            seen = now
                            self._wake.set()
            except asyncio.CancelledError:
                raise
            except KubeExpired:
                continue
            except KubeError as err:
                log.warning("MIG config label: watch failed; listing again",
                            extra={"collection": collection, "error": str(err),
                                   "retry_in_s": RETRY_S})
                await asyncio.sleep(RETRY_S)

    async def _config(self) -> ConfigSource:
        try:
            config_map = await self.kube.get_config_map(self.namespace, self.config_name)
        except KubeNotFound:
            return ConfigSource(None, f"{self.where} not found")
        text = config_text(config_map)
        if text is None:
            return ConfigSource(None, f"{self.where} has no key {CONFIG_KEY!r}")
        return ConfigSource(text)

    async def reconcile(self) -> None:
        """Read the Node and the ConfigMap now, and do what :func:`decide` says."""
        label, state = node_marks(await self.kube.get_node(self.node_name))
        action = decide(label=label, state=state, config=await self._config(),
                        handled=self.handled)
        if isinstance(action, Idle):
            log.debug("MIG config label: nothing to do", extra={"reason": action.reason})
            return
        if isinstance(action, Fail):
            outcome = Outcome(State.FAILED, action.reason)
        else:
            outcome, state = await self._apply(action, state)
        await self._set(action.label, outcome, state)
        self.handled = action.handled

    async def _apply(self, action: Apply, state: str | None) -> tuple[Outcome, str | None]:
        """The apply's outcome, and the state label as it now is."""
        try:
            planned = await self.agent.apply(action.config, action.label, dry_run=True,
                                             allow_reset=self.allow_reset)
        except AgentRefused as err:
            return Outcome(State.FAILED, f"the agent refused {action.label!r}: "
                           f"{err.detail}"), state
        decided = dry_run_outcome(planned)
        if decided is not None:
            return decided, state
        await self._set(action.label, Outcome(State.PENDING, "applying"), state)
        state = State.PENDING
        try:
            answer = await self.agent.apply(action.config, action.label, dry_run=False,
                                            allow_reset=self.allow_reset)
        except AgentRefused as err:
            return Outcome(State.FAILED, f"the agent refused {action.label!r}: "
                           f"{err.detail}"), state
        apply_id = str(answer.get("apply_id"))
        while (outcome := apply_outcome(answer)) is None:
            await asyncio.sleep(POLL_S)
            try:
                answer = await self.agent.apply_status(apply_id)
            except AgentRefused as err:
                # 404: the agent restarted and keeps no applies; its journal finished or
                # rolled back each GPU, so what happened is not known here.
                return Outcome(State.FAILED, f"apply {apply_id} lost: {err.detail}"), state
            except AgentCallError as err:
                log.warning("MIG config label: agent unreachable during the apply",
                            extra={"apply_id": apply_id, "error": str(err)})
                await asyncio.sleep(RETRY_S)
        return outcome, state

    async def _set(self, label: str, outcome: Outcome, state: str | None) -> None:
        """Log the outcome; write the state label unless it already says so (a ConfigMap
        edit reaches every node, and most have nothing to change)."""
        if state != outcome.state.value:
            await self.kube.patch_node_labels(self.node_name,
                                              {STATE_LABEL: outcome.state.value})
        extra = {"node": self.node_name, "mig_config": label, "state": outcome.state.value,
                 "reason": outcome.reason}
        if outcome.state is State.FAILED:
            log.error("MIG config label failed", extra=extra)
        else:
            log.info("MIG config label", extra=extra)
