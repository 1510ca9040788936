"""The Kubernetes client on the wire: the requests it sends, raw JSON kept whole, and HTTP
failures mapped to the error a caller acts on. A small aiohttp app plays the API server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from agent.kubeplugin.kube import (
    KubeClient,
    KubeConfigMissing,
    KubeConflict,
    KubeError,
    KubeExpired,
    KubeForbidden,
    KubeInvalid,
    KubeNotFound,
    KubeUnavailable,
    error_for,
    parse_version,
)

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
SELECTOR = "spec.driver=gpu.nodeagent.dev,spec.nodeName=node-a"
FUTURE = {"metadata": {"name": "s-0", "resourceVersion": "7", "uid": "u-0"},
          "spec": {"driver": "gpu.nodeagent.dev", "nodeName": "node-a",
                   "fieldOfKubernetes99": {"kept": True}}}


@pytest.mark.parametrize(("status", "error"), [
    (404, KubeNotFound), (409, KubeConflict), (410, KubeExpired), (401, KubeForbidden),
    (403, KubeForbidden), (400, KubeInvalid), (422, KubeInvalid), (429, KubeUnavailable),
    (500, KubeUnavailable), (503, KubeUnavailable), (418, KubeError)])
def test_status_maps_to_error(status: int, error: type[KubeError]) -> None:
    """Each HTTP status becomes the exception class a caller handles it by."""
    raised = error_for(status, {"kind": "Status", "reason": "R", "message": "m"})
    assert type(raised) is error and raised.status == status and raised.reason == "R"


def test_an_error_page_in_place_of_a_status_is_one_line() -> None:
    """A proxy's HTML error page where a ``Status`` belongs (``_open`` passes its start as
    the message) becomes a one-line error: it is shown in ``/readyz`` and in a log field."""
    page = "<!DOCTYPE HTML>\n<html>\n    <body>\n        <h1>Bad Gateway</h1>\n"
    raised = error_for(502, {"message": page})
    assert str(raised) == "502: <!DOCTYPE HTML> <html> <body> <h1>Bad Gateway</h1>"
    assert str(error_for(404, {"reason": "NotFound", "message": "x\ny"})) == "404 NotFound: x y"


@pytest.mark.parametrize(("doc", "version"), [
    ({"major": "1", "minor": "35"}, (1, 35)), ({"major": "1", "minor": "34+"}, (1, 34)),
    ({"major": "", "minor": "", "gitVersion": "v1.37.2"}, (1, 37))])
def test_server_version_parsing(doc: dict[str, str], version: tuple[int, int]) -> None:
    """``/version`` answers, managed clusters' ``34+`` minors included, give (major, minor)."""
    assert parse_version(doc) == version


class FakeServer:
    """Records requests and answers them from ``replies`` (path -> (status, body))."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.replies: dict[tuple[str, str], tuple[int, Any, dict[str, str]]] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.text()
        self.requests.append({"method": request.method, "path": request.path,
                              "query": dict(request.query), "body": json.loads(body or "null"),
                              "auth": request.headers.get("Authorization")})
        status, reply, headers = self.replies.get((request.method, request.path),
                                                  (404, {"kind": "Status",
                                                         "reason": "NotFound"}, {}))
        if isinstance(reply, list):  # a watch: one event per line
            response = web.StreamResponse(status=status)
            await response.prepare(request)
            for event in reply:
                await response.write(json.dumps(event).encode() + b"\n")
            await response.write_eof()
            return response
        return web.json_response(reply, status=status, headers=headers)


@pytest.fixture
async def server(tmp_path: Path) -> Any:
    fake = FakeServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    test_server = TestServer(app, host="127.0.0.1")
    await test_server.start_server()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "c", "cluster": {
            "server": f"http://127.0.0.1:{test_server.port}"}}],
        "users": [{"name": "u", "user": {"token": "sa-token"}}],
        "contexts": [{"name": "test", "context": {"cluster": "c", "user": "u"}}]}))
    client = await KubeClient.from_environment(kubeconfig)
    yield fake, client
    await client.close()
    await test_server.close()


async def test_list_selects_the_node_and_keeps_unknown_fields(server: Any) -> None:
    """A list asks for this driver's slices of this node, with the kubeconfig's token, and
    returns objects with fields the client has never heard of intact."""
    fake, client = server
    fake.replies[("GET", SLICES)] = (200, {"metadata": {"resourceVersion": "42"},
                                           "items": [FUTURE]}, {})
    listing = await client.list_resource_slices(driver="gpu.nodeagent.dev", node="node-a")
    assert listing.resource_version == "42" and listing.items == [FUTURE]
    assert fake.requests[0]["query"] == {"fieldSelector": SELECTOR}
    assert fake.requests[0]["auth"] == "Bearer sa-token"


async def test_writes_send_the_body_as_given(server: Any) -> None:
    """Create and update send the dict as it is (PUT to the slice's name) and return the
    server's answer whole; a dry-run create asks ``dryRun=All``, a real one nothing."""
    fake, client = server
    fake.replies[("POST", SLICES)] = (201, FUTURE, {})
    fake.replies[("PUT", f"{SLICES}/s-0")] = (200, FUTURE, {})
    assert await client.create_resource_slice(FUTURE) == FUTURE
    assert await client.update_resource_slice(FUTURE) == FUTURE
    assert await client.create_resource_slice(FUTURE, dry_run=True) == FUTURE
    assert [(r["method"], r["path"], r["body"], r["query"]) for r in fake.requests] == [
        ("POST", SLICES, FUTURE, {}), ("PUT", f"{SLICES}/s-0", FUTURE, {}),
        ("POST", SLICES, FUTURE, {"dryRun": "All"})]


async def test_delete_has_uid_and_version_preconditions(server: Any) -> None:
    """A delete names the UID and resourceVersion it may delete; a failed precondition is a
    conflict."""
    fake, client = server
    fake.replies[("DELETE", f"{SLICES}/s-0")] = (200, {"kind": "Status"}, {})
    await client.delete_resource_slice("s-0", uid="u-0", resource_version="7")
    assert fake.requests[0]["body"]["preconditions"] == {"uid": "u-0", "resourceVersion": "7"}
    fake.replies[("DELETE", f"{SLICES}/s-0")] = (409, {"kind": "Status", "reason": "Conflict",
                                                       "message": "precondition failed"}, {})
    with pytest.raises(KubeConflict, match="precondition failed"):
        await client.delete_resource_slice("s-0", uid="u-0", resource_version="6")


async def test_watch_streams_events_and_expires(server: Any) -> None:
    """A watch yields each event with its object whole, from the resourceVersion asked, and
    an ERROR 410 event ends it with KubeExpired."""
    fake, client = server
    fake.replies[("GET", SLICES)] = (200, [
        {"type": "ADDED", "object": FUTURE},
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}},
        {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}], {})
    seen = []
    with pytest.raises(KubeExpired):
        async for event in client.watch_resource_slices(
                driver="gpu.nodeagent.dev", node="node-a", resource_version="5"):
            seen.append((event.type, event.resource_version))
    assert seen == [("ADDED", "7"), ("BOOKMARK", "9")]
    query = fake.requests[0]["query"]
    assert (query["watch"], query["resourceVersion"], query["fieldSelector"]) == \
        ("true", "5", SELECTOR)


async def test_reads(server: Any) -> None:
    """Node, claim and version reads go to their paths; a missing object is KubeNotFound."""
    fake, client = server
    fake.replies[("GET", "/api/v1/nodes/node-a")] = (200, {"metadata": {"uid": "n-1"}}, {})
    fake.replies[("GET", "/version")] = (200, {"major": "1", "minor": "36"}, {})
    assert (await client.get_node("node-a"))["metadata"]["uid"] == "n-1"
    assert await client.server_version() == (1, 36)
    with pytest.raises(KubeNotFound):
        await client.get_resource_claim("ns", "claim-1")
    assert fake.requests[-1]["path"] == \
        "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/claim-1"


async def test_overload_says_when_to_retry(server: Any) -> None:
    """A 429 with Retry-After is KubeUnavailable carrying the delay."""
    fake, client = server
    fake.replies[("GET", "/version")] = (429, {"kind": "Status", "reason": "TooManyRequests"},
                                         {"Retry-After": "3"})
    with pytest.raises(KubeUnavailable) as caught:
        await client.server_version()
    assert caught.value.retry_after_s == 3.0


async def test_no_server_is_unavailable(tmp_path: Path, unused_tcp_port: int) -> None:
    """A server nobody listens on is KubeUnavailable (retried), not a crash."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{unused_tcp_port}"}}],
        "users": [{"name": "u", "user": {"token": "x"}}],
        "contexts": [{"name": "t", "context": {"cluster": "c", "user": "u"}}]}))
    client = await KubeClient.from_environment(kubeconfig)
    try:
        with pytest.raises(KubeUnavailable):
            await client.server_version()
    finally:
        await client.close()


async def test_missing_configuration_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a pod and without a kubeconfig the client says which configuration it lacks."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeConfigMissing, match="in-cluster"):
        await KubeClient.from_environment(None)
