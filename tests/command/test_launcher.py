"""`contextpaw launch` as a command: it finds ContextPaw where the rest of the command would, goes
on while one backend is down and names it, refuses a model the backend does not have, and says
what it waits for. ContextPaw's admin endpoints are served here as the proxy answers them
(`/contextpaw/health`, `/contextpaw/window`, `/v1/models`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from contextpaw.command import launcher

DOWN = {"kind": "ollama", "url": "http://127.0.0.1:11435", "answers": False, "last_error": "connection refused"}
UP = {"kind": "llamacpp", "url": "http://127.0.0.1:8091", "answers": True, "last_error": None}


class Admin(BaseHTTPRequestHandler):
    health: tuple[int, dict[str, Any]] = (200, {"policy": "compact", "backends": [UP]})
    models: list[str] = ["smollm2"]

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/contextpaw/health":
            status, body = self.health
        elif self.path == "/v1/models":
            status, body = 200, {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}
        elif self.path.startswith("/contextpaw/window?model="):
            model = self.path.split("=", 1)[1]
            status, body = 200, {"model": model, "backend": {"kind": "llamacpp", "url": UP["url"]}, "window": 8192,
                                 "source": "backend", "counted": "exactly", "agent_window": 8192}  # fmt: skip
        else:
            status, body = 404, {"error": "not found"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def admin() -> Iterator[tuple[str, type[Admin]]]:
    handler = type("Handler", (Admin,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def test_contextpaw_is_found_where_the_environment_says_it_listens(admin, monkeypatch) -> None:
    url, _ = admin
    port = url.rsplit(":", 1)[1]
    assert launcher.proxies({"CONTEXTPAW_PORT": port}) == (url, "http://127.0.0.1:8092")
    assert launcher.proxies({"CONTEXTPAW_URL": url + "/"}) == (url,)
    assert launcher.proxies({"CONTEXTPAW_HOST": "0.0.0.0", "CONTEXTPAW_LLAMACPP_PORT": port})[1] == url
    assert launcher.proxy_url(None, {"CONTEXTPAW_PORT": port}) == url


def test_a_backend_down_is_named_and_the_launch_goes_on(admin, capsys) -> None:
    url, handler = admin
    handler.health = (503, {"policy": "compact", "backends": [DOWN, UP]})
    assert launcher.proxy_url(url) == url
    err = capsys.readouterr().err
    assert "ollama at http://127.0.0.1:11435 does not (connection refused)" in err and "8091" not in err


def test_a_model_the_backend_does_not_list_is_refused_with_what_it_lists(admin, tmp_path) -> None:
    url, _ = admin
    ns = launcher.parser().parse_args(["codex", "--url", url, "--model", "nosuch", "--state-dir", str(tmp_path)])
    with pytest.raises(launcher.LaunchError, match="no model nosuch: it lists smollm2"):
        launcher.target(ns)


def test_an_ollama_model_named_without_its_tag_is_the_latest_one(admin) -> None:
    url, handler = admin
    handler.models = ["qwen3:latest", "llama3:8b"]
    assert launcher.chosen_model(url, "qwen3") == "qwen3"
    with pytest.raises(launcher.LaunchError, match="name the model with --model"):
        launcher.chosen_model(url, None)


def test_launch_says_what_it_waits_for(admin, tmp_path, capsys) -> None:
    url, _ = admin
    ns = launcher.parser().parse_args(["codex", "--url", url, "--state-dir", str(tmp_path)])
    assert launcher.target(ns).window == 8192
    assert f"asking ContextPaw at {url} for the window of smollm2" in capsys.readouterr().err


def test_nothing_answering_is_said_with_every_address_tried() -> None:
    with pytest.raises(launcher.LaunchError, match=r"no ContextPaw answers at http://127.0.0.1:9 or http://127.0.0.1:7"):
        launcher.proxy_url(None, {"CONTEXTPAW_PORT": "9", "CONTEXTPAW_LLAMACPP_PORT": "7"})


def test_a_window_the_agent_cannot_live_in_is_refused_with_the_window_it_needs_and_how(admin, tmp_path, capsys) -> None:
    """Served at 8,192, Codex would compact turn after turn and still overflow: launch starts
    nothing, names the window it needs and the server's option that gives it."""
    url, _ = admin
    assert launcher.main(["codex", "--url", url, "--state-dir", str(tmp_path), "--print"]) == 2
    err = capsys.readouterr().err
    assert "codex needs a window of at least 32,768" in err and "smollm2 is served at 8,192" in err
    assert "start llama-server with -c 32768" in err and "--force" in err
    assert not (tmp_path / "launch").exists()


def test_force_starts_the_agent_anyway_and_says_so(admin, tmp_path, capsys) -> None:
    url, _ = admin
    assert launcher.main(["codex", "--url", url, "--state-dir", str(tmp_path), "--print", "--force"]) == 0
    out, err = capsys.readouterr()
    assert "exec codex" in out and "model_context_window=8192" in out
    assert "started anyway (--force): codex needs a window of at least 32,768" in err


def test_contextpaw_is_asked_straight_never_through_an_http_proxy(admin, monkeypatch) -> None:
    """`contextpaw mcp` sends the local token with what it asks: with `http_proxy` set (and no
    `no_proxy`), the token went to that proxy. Both commands ask ContextPaw straight."""
    from contextpaw.command.mcp import Proxy

    seen: list[str] = []

    class Elsewhere(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append(self.headers.get("X-ContextPaw-Token") or "")
            self.send_response(502)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    relay = ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    url, _ = admin
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{relay.server_address[1]}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    try:
        assert Proxy(url=url, token="secret").get(url + "/contextpaw/health", "secret")[0] == 200
        assert launcher.ask(url + "/contextpaw/health")[0] == 200
    finally:
        relay.shutdown()
        relay.server_close()
    assert seen == []


def test_an_agent_not_installed_is_named_with_the_command_that_installs_it(admin, tmp_path, capsys, monkeypatch) -> None:
    url, _ = admin
    monkeypatch.setenv("PATH", str(tmp_path))
    assert launcher.main(["opencode", "--url", url, "--state-dir", str(tmp_path), "--force"]) == 2
    assert "opencode is not on PATH: install it with `npm install -g opencode-ai`" in capsys.readouterr().err
