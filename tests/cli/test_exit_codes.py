"""The CLI's failures in process (issue 24): each kind is one line on stderr and its own exit
status (2 the command line, 3 no agent at the address, 4 the credentials), never a traceback;
tests/cli/test_one_line_errors.py runs the same through the entry point for every verb."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from agent.cli.main import main


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("gpu-agent: "), err
    return code, err


@pytest.mark.parametrize("url", ["http://[::1", "http://[::1]:x", "ftp://h:1", "h:1/v1",
                                 "unix:", "http://h:1\x00"])
def test_a_malformed_url_is_a_usage_error(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _fails(["gpus", "--url", url], capsys)
    assert code == 2 and "malformed URL" in err


def test_a_missing_socket_is_the_unreachable_kind(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _fails(["node", "--url", f"unix:{tmp_path / 'absent.sock'}"], capsys)
    assert code == 3 and "cannot reach the agent" in err and "--url" in err


@pytest.mark.parametrize(("content", "says"), [
    (None, "cannot read token file"),  # a directory
    (b"\xff\xfe\n", "is not text"),
    (b"ops:t\xc3\xb6ken\n", "only printable ASCII"),
    (b"ops:tok\x07en\n", "only printable ASCII"),
    (b"# nothing\n", "holds no token"),
])
def test_an_unusable_token_file_is_the_credentials_kind(
        tmp_path: Path, content: bytes | None, says: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tokens"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    code, err = _fails(["gpus", "--url", f"unix:{tmp_path / 'a.sock'}", "--token-file",
                        str(path)], capsys)
    assert code == 4 and says in err and str(path) in err


def test_an_unusable_token_in_the_environment_names_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GPU_AGENT_TOKEN", "tökén")
    code, err = _fails(["gpus", "--url", f"unix:{tmp_path / 'a.sock'}"], capsys)
    assert code == 4 and "GPU_AGENT_TOKEN" in err


async def test_a_server_that_is_not_an_agent_is_named_so(
        capsys: pytest.CaptureFixture[str]) -> None:
    async def page(request: web.Request) -> web.Response:
        return web.Response(text="<html>a web server</html>", content_type="text/html")

    app = web.Application()
    app.router.add_get("/{tail:.*}", page)
    server: TestServer = TestServer(app)
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        for argv in (["gpus"], ["claims"], ["mig", "show"], ["topo"]):
            code = await asyncio.to_thread(main, [*argv, "--url", url])
            out, err = capsys.readouterr()
            assert (code, out, err.count("\n")) == (3, "", 1), err
            assert "not a gpu-agent" in err and "Traceback" not in err
    finally:
        await server.close()
