"""The plugin's Kubernetes API client: the few calls it makes, as raw JSON.

Built on ``kubernetes-asyncio`` because it runs on aiohttp, which the agent already depends
on: the plugin adds no second HTTP stack, and the library brings what is tedious to get right
(in-cluster and kubeconfig loading, TLS with client certificates, service-account token
refresh: the in-cluster loader re-reads the projected token file every minute, so a rotated
token is used without a restart). ``kubernetes`` (official) would add urllib3 and a thread
pool, ``lightkube`` httpx and msgspec.

Every call goes through the library's ``ApiClient.call_api`` with the response left unread,
and bodies stay plain dicts. Its typed models are never used: a model silently drops the
fields it does not know, so an older client would read back a newer server's slice without
them (and republish it that way), and the publisher's check for fields the *server* dropped
would compare against the client's blind spots instead.

Errors are a small hierarchy, by what a caller does about them: :class:`KubeUnavailable`
(retry with backoff), :class:`KubeConflict` (re-read and re-plan), :class:`KubeNotFound`,
:class:`KubeForbidden` (RBAC or credentials: an operator must act), :class:`KubeInvalid`
(the server refused the content), :class:`KubeExpired` (a watch's resourceVersion is too
old: list again), :class:`KubeTooLarge` (an answer over its limit: not read further).

An answer is read with a limit, never whole into memory first: an object over
:data:`MAX_OBJECT_BYTES` (a list over :data:`MAX_LIST_BYTES`) stops the read at the limit
and drops the connection, so an endless or oversize answer costs the limit, not the answer.
A large answer is decoded on a thread, not on the event loop. Every name put in a path is
escaped as one path segment (callers validate names first; this is the last line).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp
import yaml
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.config import load_incluster_config, load_kube_config
from kubernetes_asyncio.config.incluster_config import (
    SERVICE_HOST_ENV_NAME,
    SERVICE_PORT_ENV_NAME,
    SERVICE_TOKEN_FILENAME,
)
from kubernetes_asyncio.config.kube_config import refresh_token

from agent.kubeplugin.credentials import ApiCredential

log = logging.getLogger("agent.kubeplugin.kube")

Json = dict[str, Any]
SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
#: A plain call's limit; a watch has its own.
CALL_TIMEOUT_S = 30.0
#: How long the server keeps one watch open before the client opens the next.
WATCH_TIMEOUT_S = 290
#: The longest object answer read (a ResourceClaim, a Node). kube-apiserver takes no request
#: body over 3 MiB (``--max-request-body-bytes``' default) and etcd stores no object over
#: 1.5 MiB (``--max-request-bytes``), so no object a real server holds is longer as JSON.
MAX_OBJECT_BYTES = 3 * 1024 * 1024
#: The longest list answer read (this node's ResourceSlices of one driver: a few objects).
MAX_LIST_BYTES = 32 * 1024 * 1024
#: Objects a page when the plugin reads a whole cluster-wide collection.
LIST_PAGE = 500
LEASES_PATH = "/apis/coordination.k8s.io/v1/namespaces/%s/leases"
#: Answers longer than this are decoded on a thread (a 3 MiB claim takes 40-60 ms).
DECODE_ON_THREAD_BYTES = 64 * 1024
_CHUNK_BYTES = 64 * 1024


class KubeError(Exception):
    """An API server call failed; ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, message: str, *, status: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class KubeUnavailable(KubeError):
    """No answer, a timeout, 429 or 5xx: try again later (``retry_after_s`` when the server
    said when)."""

    def __init__(self, message: str, *, status: int = 0, reason: str = "",
                 retry_after_s: float | None = None) -> None:
        super().__init__(message, status=status, reason=reason)
        self.retry_after_s = retry_after_s


class KubeConflict(KubeError):
    """409: the object changed (or exists) since it was read; re-read and decide again."""


class KubeNotFound(KubeError):
    """404: no such object."""


class KubeForbidden(KubeError):
    """401 or 403: the credentials or the RBAC role do not allow the call."""


class KubeInvalid(KubeError):
    """400 or 422: the server refused the request's content."""


class KubeExpired(KubeError):
    """410: the watch's resourceVersion is older than the server keeps; list again."""


class KubeTooLarge(KubeError):
    """The answer is longer than ``limit`` bytes; it was not read further."""

    def __init__(self, message: str, *, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


class KubeConfigMissing(KubeError):
    """Neither the in-cluster environment nor the kubeconfig gives a usable configuration."""


@dataclass(frozen=True)
class ResourceSliceList:
    """The node's slices of one driver, and the resourceVersion to watch from."""

    resource_version: str
    items: list[Json]


@dataclass(frozen=True)
class NodeList:
    """The Nodes of a label selector, and the resourceVersion to watch from."""

    resource_version: str
    items: list[Json]


@dataclass(frozen=True)
class WatchEvent:
    """``ADDED``, ``MODIFIED``, ``DELETED`` or ``BOOKMARK``, with the object as sent."""

    type: str
    object: Json

    @property
    def resource_version(self) -> str | None:
        value = self.object.get("metadata", {}).get("resourceVersion")
        return str(value) if value is not None else None


class ResourceSliceApi(Protocol):
    """What the publisher needs from the API server (:class:`KubeClient`, or a fake)."""

    async def server_version(self) -> tuple[int, int]: ...

    async def get_node(self, name: str) -> Json: ...

    async def list_resource_slices(self, *, driver: str, node: str) -> ResourceSliceList: ...

    def watch_resource_slices(self, *, driver: str, node: str, resource_version: str,
                              timeout_s: int = WATCH_TIMEOUT_S) -> AsyncIterator[WatchEvent]: ...

    async def create_resource_slice(self, body: Json, *, dry_run: bool = False) -> Json: ...

    async def update_resource_slice(self, body: Json) -> Json: ...

    async def delete_resource_slice(self, name: str, *, uid: str,
                                    resource_version: str) -> None: ...


def resource_slice_selector(*, driver: str, node: str) -> str:
    """The field selector of one node's slices of one driver (what kubelet's Go helper
    watches)."""
    return f"spec.driver={driver},spec.nodeName={node}"


def parse_version(doc: Mapping[str, Any]) -> tuple[int, int]:
    """(major, minor) of a ``/version`` answer; managed clusters write minors like ``35+``."""
    try:
        major = int(re.sub(r"\D", "", str(doc.get("major", ""))))
        minor = int(re.sub(r"\D", "", str(doc.get("minor", ""))))
    except ValueError:
        match = re.match(r"v?(\d+)\.(\d+)", str(doc.get("gitVersion", "")))
        if match is None:
            raise KubeInvalid(f"/version answered no version: {dict(doc)!r}") from None
        return int(match[1]), int(match[2])
    return major, minor


def segment(name: str) -> str:
    """``name`` as one URL path segment: ``/``, ``?``, ``%`` and ``..`` cannot escape it."""
    escaped = quote(name, safe="")
    return escaped.replace(".", "%2E") if escaped in (".", "..") else escaped


def error_for(status: int, body: Any, *, retry_after: str | None = None) -> KubeError:
    """The exception for an HTTP error status and its ``Status`` body, as one line."""
    message = reason = ""
    if isinstance(body, Mapping):
        # One line: it goes into /readyz and a log field (a proxy's error page has many).
        message = " ".join(str(body.get("message", "")).split())
        reason = " ".join(str(body.get("reason", "")).split())
    head = f"{status} {reason}".strip()
    text = f"{head}: {message}" if message else head
    if status == 404:
        return KubeNotFound(text, status=status, reason=reason)
    if status == 409:
        return KubeConflict(text, status=status, reason=reason)
    if status == 410:
        return KubeExpired(text, status=status, reason=reason)
    if status in (401, 403):
        return KubeForbidden(text, status=status, reason=reason)
    if status in (400, 422):
        return KubeInvalid(text, status=status, reason=reason)
    if status == 429 or status >= 500:
        after = None
        with contextlib.suppress(TypeError, ValueError):
            after = float(retry_after) if retry_after is not None else None
        return KubeUnavailable(text, status=status, reason=reason, retry_after_s=after)
    return KubeError(text, status=status, reason=reason)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def kubeconfig_user(path: Path) -> tuple[str, dict[str, Any]]:
    """The current context's user of a kubeconfig: its name and its ``user`` fields ("" and
    {} when the file does not say)."""
    try:
        doc = yaml.safe_load(path.read_text())
        context = next(c.get("context") or {} for c in doc.get("contexts") or []
                       if c.get("name") == doc.get("current-context"))
        name = str(context.get("user", ""))
        user = next(u.get("user") or {} for u in doc.get("users") or [] if u.get("name") == name)
    except (OSError, ValueError, yaml.YAMLError, AttributeError, StopIteration, TypeError):
        return "", {}
    return name, user if isinstance(user, dict) else {}


def credential_source(kubeconfig: Path | None) -> str:
    """The API server credential in words, for logs and readiness reasons (never the
    credential itself)."""
    if kubeconfig is None:
        return f"the in-cluster ServiceAccount token {SERVICE_TOKEN_FILENAME}"
    name, user = kubeconfig_user(kubeconfig)
    where = f"kubeconfig {kubeconfig}" + (f" (user {name})" if name else "")
    if user.get("tokenFile"):
        return f"the token file {user['tokenFile']} of {where}"
    if user.get("token"):
        return f"the token of {where}"
    if user.get("exec"):
        return f"the exec plugin's credential of {where}"
    if user.get("client-certificate") or user.get("client-certificate-data"):
        return f"the client certificate of {where}"
    return f"the credential of {where}"


def _bearer(config: Configuration) -> str | None:
    value = str(config.api_key.get("BearerToken") or "")
    return value.removeprefix("Bearer ").strip() or None


def _file_state(*paths: Path) -> tuple[tuple[int, int, int, int], ...]:
    out = []
    for path in paths:
        try:
            info = path.stat()
        except OSError:
            out.append((0, 0, 0, 0))
        else:
            out.append((info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns))
    return tuple(out)


class KubeClient:
    """The API server calls of the plugin (:class:`ResourceSliceApi`, and the claim and node
    reads).

    With a ``credential`` (:meth:`from_environment` gives one), every 401 answered to any
    call marks it refused, every answer clears that, and each read of the plugin's own Node
    shows whether a Node-bound token still matches its Node."""

    def __init__(self, api: ApiClient, *, refresher: asyncio.Task[None] | None = None,
                 credential: ApiCredential | None = None,
                 kubeconfig: Path | None = None) -> None:
        self._api = api
        self._refresher = refresher
        self.credential = credential
        self._kubeconfig = kubeconfig
        self._kubeconfig_seen = self._kubeconfig_files()

    @classmethod
    async def from_environment(cls, kubeconfig: Path | None, *,
                               node_name: str = "") -> KubeClient:
        """A client from the pod's service account (``kubeconfig`` None) or a kubeconfig file;
        :class:`KubeConfigMissing` naming what is missing and what to do.

        The in-cluster token is re-read from its file as it rotates; a kubeconfig whose user
        runs an exec plugin gets its token refreshed by a background task ended by
        :meth:`close`, and a kubeconfig rewritten with another token is read again by
        :meth:`reload_credential`."""
        config = Configuration()
        refresher: asyncio.Task[None] | None = None
        if kubeconfig is None:
            try:
                load_incluster_config(  # type: ignore[no-untyped-call]
                    client_configuration=config)
            except Exception as err:  # the library's ConfigException, or anything else
                raise KubeConfigMissing(
                    "no API server configuration: --kubeconfig not given and no in-cluster "
                    f"configuration ({_one_line(err).rstrip('.')}; looked for "
                    f"${SERVICE_HOST_ENV_NAME}, ${SERVICE_PORT_ENV_NAME} and "
                    f"{SERVICE_TOKEN_FILENAME}); pass "
                    "--kubeconfig PATH (bare metal: /etc/gpu-agent/kubelet-plugin.kubeconfig, "
                    "docs/kubernetes.md)") from err
        else:
            if not await asyncio.to_thread(kubeconfig.is_file):
                what = "not a file" if await asyncio.to_thread(kubeconfig.exists) \
                    else "no such file"
                raise KubeConfigMissing(
                    f"--kubeconfig {kubeconfig}: {what}; write the plugin's kubeconfig there "
                    "(docs/kubernetes.md, bare-metal kubelet nodes) or pass its path")
            try:
                loader = await load_kube_config(config_file=str(kubeconfig),
                                                client_configuration=config,
                                                persist_config=False)
            except Exception as err:  # ConfigException, YAML errors, a file it cannot read
                raise KubeConfigMissing(f"--kubeconfig {kubeconfig}: not a usable kubeconfig: "
                                        f"{_one_line(err)}") from err
            # Returns at once unless the user's token comes from an exec plugin (or
            # gcp), which it then refreshes every minute.
            refresher = asyncio.create_task(refresh_token(loader, config))
        credential = ApiCredential(source=credential_source(kubeconfig), node_name=node_name,
                                   token=lambda: _bearer(config))
        return cls(ApiClient(configuration=config), refresher=refresher, credential=credential,
                   kubeconfig=kubeconfig)

    @classmethod
    def from_configuration(cls, config: Configuration, *,
                           refresher: asyncio.Task[None] | None = None) -> KubeClient:
        """A client for an explicit configuration (host, TLS, token): tests use it."""
        return cls(ApiClient(configuration=config), refresher=refresher)

    def sibling(self, *, connections: int) -> KubeClient:
        """A client with the same server and credentials (a refreshed token reaches both)
        but a connection pool of its own of ``connections``: the claim reads, so that reads
        the server leaves hanging never take the publisher's connections."""
        config = copy.copy(self._api.configuration)  # shares api_key: one token for both
        config.connection_pool_maxsize = connections
        return KubeClient(ApiClient(configuration=config), credential=self.credential)

    def _kubeconfig_files(self) -> tuple[tuple[int, int, int, int], ...]:
        if self._kubeconfig is None:
            return ()
        token_file = kubeconfig_user(self._kubeconfig)[1].get("tokenFile")
        return _file_state(self._kubeconfig, *([Path(token_file)] if token_file else []))

    async def reload_credential(self) -> None:
        """The kubeconfig's token again, if the file (or its token file) changed: a renewed
        credential is used without a restart (the server and its CA are kept)."""
        if self._kubeconfig is None:
            return
        seen = self._kubeconfig_files()
        if seen == self._kubeconfig_seen:
            return
        fresh = Configuration()
        try:
            await load_kube_config(config_file=str(self._kubeconfig),
                                   client_configuration=fresh, persist_config=False)
        except Exception as err:  # half-written, say: the next check reads it again
            log.warning("kubeconfig changed but cannot be read", extra={
                "kubeconfig": str(self._kubeconfig), "error": _one_line(err)})
            return
        self._kubeconfig_seen = seen
        # The siblings share this dict (sibling() copies the configuration shallowly).
        self._api.configuration.api_key.update(fresh.api_key)
        log.info("kubeconfig changed; using its credential", extra={
            "kubeconfig": str(self._kubeconfig)})

    async def check_credential(self) -> None:
        """Read this plugin's own Node: the one call that needs both a valid credential and
        the role's RBAC (``nodes get``). A refusal (401, 403) or a missing Node is recorded
        in :attr:`credential`; no answer raises :class:`KubeUnavailable`."""
        assert self.credential is not None
        await self.reload_credential()
        name = self.credential.node_name
        try:
            await self.get_node(name)
        except KubeForbidden as err:
            if err.status == 403:
                self.credential.forbidden(str(err))
            # 401: recorded by _open already
        except KubeNotFound:
            self.credential.node_missing()

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        await self._api.close()

    async def _open(self, method: str, path: str, *,
                    query: Sequence[tuple[str, str]] = (), body: Json | None = None,
                    limits: aiohttp.ClientTimeout | None = None,
                    content_type: str = "application/json") -> aiohttp.ClientResponse:
        """The response of one call, unread and with a 2xx status (else its exception)."""
        try:
            response: aiohttp.ClientResponse = await self._api.call_api(
                path, method, query_params=list(query),
                header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body, auth_settings=["BearerToken"], _preload_content=False,
                _request_timeout=limits or aiohttp.ClientTimeout(total=CALL_TIMEOUT_S))
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            raise KubeUnavailable(f"{method} {path}: {type(err).__name__}: {err}") from err
        if self.credential is not None and response.status != 401:
            self.credential.authenticated()
        if 200 <= response.status < 300:
            return response
        try:
            text = await response.text()
        except (aiohttp.ClientError, OSError, TimeoutError):
            text = ""
        finally:
            response.release()
        try:
            status_body: Any = json.loads(text) if text else None
        except ValueError:
            status_body = {"message": text[:200]}
        error = error_for(response.status, status_body,
                          retry_after=response.headers.get("Retry-After"))
        if self.credential is not None and response.status == 401:
            self.credential.unauthenticated(str(error))
        raise error

    async def _call(self, method: str, path: str, *,
                    query: Sequence[tuple[str, str]] = (), body: Json | None = None,
                    max_bytes: int = MAX_OBJECT_BYTES,
                    content_type: str = "application/json") -> Json:
        response = await self._open(method, path, query=query, body=body,
                                    content_type=content_type)
        try:
            data = await _read_limited(response, f"{method} {path}", max_bytes)
        finally:
            response.release()
        try:
            if len(data) > DECODE_ON_THREAD_BYTES:
                doc = await asyncio.to_thread(json.loads, data)
            else:
                doc = json.loads(data)
        except (ValueError, RecursionError) as err:
            raise KubeUnavailable(f"{method} {path}: reply not JSON: {err}") from err
        if not isinstance(doc, dict):
            raise KubeUnavailable(f"{method} {path}: reply not a JSON object")
        return doc

    async def server_version(self) -> tuple[int, int]:
        """The API server's (major, minor)."""
        return parse_version(await self._call("GET", "/version"))

    async def get_node(self, name: str) -> Json:
        node = await self._call("GET", f"/api/v1/nodes/{segment(name)}")
        if self.credential is not None and name == self.credential.node_name:
            self.credential.saw_node(node)
        return node

    async def get_resource_claim(self, namespace: str, name: str) -> Json:
        """The ResourceClaim, read up to :data:`MAX_OBJECT_BYTES` (:class:`KubeTooLarge`)."""
        return await self._call("GET", f"/apis/resource.k8s.io/v1/namespaces/"
                                       f"{segment(namespace)}/resourceclaims/{segment(name)}")

    async def list_resource_slices(self, *, driver: str, node: str) -> ResourceSliceList:
        doc = await self._call("GET", SLICES_PATH,
                               query=[("fieldSelector", resource_slice_selector(driver=driver,
                                                                       node=node))],
                               max_bytes=MAX_LIST_BYTES)
        items = doc.get("items") or []
        return ResourceSliceList(resource_version=str(doc.get("metadata", {}).get("resourceVersion",
                                                                          "")),
                         items=[item for item in items if isinstance(item, dict)])

    async def watch_resource_slices(self, *, driver: str, node: str, resource_version: str,
                                    timeout_s: int = WATCH_TIMEOUT_S
                                    ) -> AsyncIterator[WatchEvent]:
        """Events after ``resource_version`` until the server ends the watch (about
        ``timeout_s``); :class:`KubeExpired` when that version is too old."""
        selector = resource_slice_selector(driver=driver, node=node)
        async for event in self.watch(SLICES_PATH, selector, resource_version, timeout_s):
            yield event

    async def watch(self, path: str, field_selector: str, resource_version: str,
                    timeout_s: int = WATCH_TIMEOUT_S, *,
                    label_selector: str = "") -> AsyncIterator[WatchEvent]:
        """Events of the collection at ``path`` matching ``field_selector`` (and
        ``label_selector``) after ``resource_version`` until the server ends the watch;
        :class:`KubeExpired` when that version is too old."""
        selectors = [("fieldSelector", field_selector)] if field_selector else []
        if label_selector:
            selectors.append(("labelSelector", label_selector))
        query = [*selectors, ("watch", "true"),
                 ("allowWatchBookmarks", "true"), ("resourceVersion", resource_version),
                 ("timeoutSeconds", str(timeout_s))]
        # No total limit: the server ends the watch; a silent connection ends by sock_read.
        limits = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout_s + 30)
        response = await self._open("GET", path, query=query, limits=limits)
        try:
            while True:
                try:
                    line = await response.content.readline()
                except (aiohttp.ClientError, OSError, TimeoutError) as err:
                    raise KubeUnavailable(f"watch of {path} cut: {err}") from err
                if not line:
                    return
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                except ValueError as err:
                    raise KubeUnavailable(f"watch event not JSON: {line[:200]!r}") from err
                kind, obj = event.get("type"), event.get("object")
                if not isinstance(obj, dict):
                    continue
                if kind == "ERROR":
                    raise error_for(int(obj.get("code") or 500), obj)
                yield WatchEvent(type=str(kind), object=obj)
        finally:
            if not response.content.at_eof() and response.connection is not None:
                # A watch left mid-stream cannot go back to the pool: drop its connection
                # now. A TLS close (close_notify) would run on after the client's close(),
                # which does not wait for connections it no longer holds.
                transport = response.connection.transport
                if transport is not None:
                    transport.abort()
            response.release()

    async def create_resource_slice(self, body: Json, *, dry_run: bool = False) -> Json:
        """Create the slice; with ``dry_run`` the server validates and answers the object as
        it would store it (feature-gated fields dropped) but stores nothing (``dryRun=All``:
        admission and RBAC as for a real create)."""
        return await self._call("POST", SLICES_PATH, body=body,
                                query=[("dryRun", "All")] if dry_run else ())

    async def update_resource_slice(self, body: Json) -> Json:
        """Replace the slice named in ``body``; its ``metadata.resourceVersion`` makes the
        write fail with :class:`KubeConflict` when the slice changed since it was read."""
        name = segment(body["metadata"]["name"])
        return await self._call("PUT", f"{SLICES_PATH}/{name}", body=body)

    async def delete_resource_slice(self, name: str, *, uid: str,
                                    resource_version: str) -> None:
        """Delete the slice only if it is still the object read (same UID and version):
        :class:`KubeConflict` otherwise, :class:`KubeNotFound` when it is gone."""
        await self._call("DELETE", f"{SLICES_PATH}/{segment(name)}", body={
            "apiVersion": "v1", "kind": "DeleteOptions",
            "preconditions": {"uid": uid, "resourceVersion": resource_version}})

    # --- Nodes of a compute domain (domains.py) ----------------------------------------------

    async def list_nodes(self, label_selector: str) -> NodeList:
        """The Nodes carrying the labels of ``label_selector``, and the list's version."""
        doc = await self._call("GET", "/api/v1/nodes", query=[("labelSelector", label_selector)],
                               max_bytes=MAX_LIST_BYTES)
        items = doc.get("items") or []
        return NodeList(
            resource_version=str(doc.get("metadata", {}).get("resourceVersion", "")),
            items=[item for item in items if isinstance(item, dict)])

    async def watch_nodes(self, label_selector: str, resource_version: str,
                          timeout_s: int = WATCH_TIMEOUT_S) -> AsyncIterator[WatchEvent]:
        """Events of the Nodes of ``label_selector`` after ``resource_version``."""
        async for event in self.watch("/api/v1/nodes", "", resource_version, timeout_s,
                                      label_selector=label_selector):
            yield event

    async def list_named(self, collection: str, name: str) -> tuple[str, Json | None]:
        """The collection's resourceVersion and the object ``name`` in it (None: absent)."""
        doc = await self._call("GET", collection,
                               query=[("fieldSelector", f"metadata.name={name}")])
        items = [item for item in doc.get("items") or [] if isinstance(item, dict)]
        return str(doc.get("metadata", {}).get("resourceVersion", "")), \
            (items[0] if items else None)

    async def watch_named(self, collection: str, name: str, resource_version: str,
                          timeout_s: int = WATCH_TIMEOUT_S) -> AsyncIterator[WatchEvent]:
        """Events of the object ``name`` after ``resource_version`` until the server ends
        the watch; :class:`KubeExpired` when that version is too old."""
        async for event in self.watch(collection, f"metadata.name={name}", resource_version,
                                      timeout_s):
            yield event

    async def patch_node_metadata(self, name: str, *,
                                  labels: Mapping[str, str | None] | None = None,
                                  annotations: Mapping[str, str | None] | None = None
                                  ) -> Json:
        """A JSON merge patch of the Node's ``metadata.labels`` and ``annotations`` (None
        removes one): only the keys named are touched, and no read-modify-write races
        kubelet's own Node updates. The Node as the server stored it."""
        metadata: Json = {}
        if labels is not None:
            metadata["labels"] = dict(labels)
        if annotations is not None:
            metadata["annotations"] = dict(annotations)
        return await self._call("PATCH", f"/api/v1/nodes/{segment(name)}",
                                body={"metadata": metadata},
                                content_type="application/merge-patch+json")

    # --- The leader lease and pending domains (lease.py, domain_explainer.py) -------------------

    async def get_lease(self, namespace: str, name: str) -> Json:
        return await self._call("GET", f"{LEASES_PATH % segment(namespace)}/{segment(name)}")

    async def create_lease(self, namespace: str, body: Json) -> Json:
        return await self._call("POST", LEASES_PATH % segment(namespace), body=body)

    async def update_lease(self, namespace: str, body: Json) -> Json:
        """Replace the Lease; :class:`KubeConflict` when it changed since it was read."""
        name = segment(body["metadata"]["name"])
        return await self._call("PUT", f"{LEASES_PATH % segment(namespace)}/{name}", body=body)

    async def list_driver_slices(self, driver: str) -> list[Json]:
        """Every ResourceSlice of ``driver`` in the cluster (the slots have no node name)."""
        return await self._list_all(SLICES_PATH, [("fieldSelector", f"spec.driver={driver}")])

    async def list_resource_claims(self) -> list[Json]:
        """Every ResourceClaim of the cluster, read a page at a time."""
        return await self._list_all("/apis/resource.k8s.io/v1/resourceclaims", [])

    async def _list_all(self, path: str, query: list[tuple[str, str]]) -> list[Json]:
        items: list[Json] = []
        token = ""
        while True:
            page = [*query, ("limit", str(LIST_PAGE))] + ([("continue", token)] if token else [])
            doc = await self._call("GET", path, query=page, max_bytes=MAX_LIST_BYTES)
            items += [item for item in doc.get("items") or [] if isinstance(item, dict)]
            token = str((doc.get("metadata") or {}).get("continue") or "")
            if not token:
                return items

    async def create_event(self, namespace: str, body: Json) -> Json:
        return await self._call("POST", f"/api/v1/namespaces/{segment(namespace)}/events",
                                body=body)

    # --- ResourceClaim device status (claim_status.py) ---------------------------------------

    async def apply_claim_status(self, namespace: str, name: str, body: Json, *,
                                 field_manager: str) -> Json:
        """Server-side apply of ``body`` (a ResourceClaim with ``metadata`` and ``status``) to
        the claim's ``status`` subresource as ``field_manager``, forcing ownership of what it
        sets; the claim as the server stored it. Fields the manager set before and ``body``
        leaves out are removed (an empty ``status.devices`` drops all of the manager's)."""
        path = (f"/apis/resource.k8s.io/v1/namespaces/{segment(namespace)}/resourceclaims/"
                f"{segment(name)}/status")
        return await self._call("PATCH", path, body=body,
                                query=[("fieldManager", field_manager), ("force", "true")],
                                content_type="application/apply-patch+yaml")


async def _read_limited(response: aiohttp.ClientResponse, what: str, limit: int) -> bytes:
    """The answer's body, or :class:`KubeTooLarge` as soon as it passes ``limit`` bytes (by
    its Content-Length, before anything is read, or while reading): the connection is then
    dropped, since the rest of the answer is never read."""
    declared = response.content_length
    if declared is not None and declared > limit:
        _drop(response)
        raise KubeTooLarge(f"{what}: the answer is {declared} bytes, over the limit of "
                           f"{limit} bytes", limit=limit)
    data = bytearray()
    try:
        async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
            data += chunk
            if len(data) > limit:
                _drop(response)
                raise KubeTooLarge(f"{what}: the answer is over the limit of {limit} bytes "
                                   "(not read further)", limit=limit)
    except (aiohttp.ClientError, OSError, TimeoutError) as err:
        raise KubeUnavailable(f"{what}: reply cut: {err}") from err
    return bytes(data)


def _drop(response: aiohttp.ClientResponse) -> None:
    """Close the connection of an answer left unread: it cannot go back to the pool."""
    if response.connection is not None and response.connection.transport is not None:
        response.connection.transport.abort()
