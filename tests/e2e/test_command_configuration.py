"""`contextpaw` configured without flags: a backend and a policy named in mitmproxy's config.yaml
in the confdir, or in CONTEXTPAW_* environment variables, take effect as the flags would."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from support.backends import Backend, free_port, start_process

LOOPBACK = "127.0.0.1"
COMMAND = [sys.executable, "-m", "contextpaw.command.cli"]


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def overflowing() -> dict:
    return {"model": "fake", "max_tokens": 8, "messages": [{"role": "user", "content": "word " * 3000 + "hello"}]}


def confdir(path: Path, text: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(text)
    return path


def own_environment(**variables: str) -> dict[str, str]:
    """This process's environment without CONTEXTPAW_* variables of its own, and with `variables`."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXTPAW_")}
    return {**kept, **variables}


def test_a_backend_and_policy_in_config_yaml_take_effect(workdir: Path, llamacpp: Backend) -> None:
    """No --llamacpp, no --policy: config.yaml alone names them; the backend is fronted at
    --llamacpp-port as --llamacpp would front it."""
    conf = confdir(workdir / "conf-file", (
        f"contextpaw_llamacpp: [{llamacpp.url}]\ncontextpaw_policy: strict\n"
        f"contextpaw_state_dir: {workdir / 'conf-file-state'}\ncontextpaw_calibrate: false\n"
    ))  # fmt: skip
    port = free_port()
    argv = [*COMMAND, "--confdir", str(conf), "--llamacpp-port", str(port)]
    url = f"http://{LOOPBACK}:{port}"
    with start_process(argv, url, "/contextpaw/health", workdir / "conf-file.log", 60, env=own_environment()):
        status, health = get(url + "/contextpaw/health")
        assert status == 200 and health["policy"] == "strict"
        assert [(b["kind"], b["url"]) for b in health["backends"]] == [("llamacpp", llamacpp.url)]
        status, answer = post(url + "/v1/chat/completions", overflowing())
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
        assert "policy strict" in answer["error"]["message"]
        log = (workdir / "conf-file.log").read_text()
        assert f"policy strict: llamacpp {llamacpp.url} at {url}" in log


def test_environment_variables_take_effect_over_config_yaml(workdir: Path, llamacpp: Backend) -> None:
    """CONTEXTPAW_LLAMACPP, CONTEXTPAW_LLAMACPP_PORT, CONTEXTPAW_POLICY and CONTEXTPAW_CONFDIR, and no
    argument at all; the file's policy loses to the variable's."""
    conf = confdir(workdir / "conf-env", f"contextpaw_policy: off\ncontextpaw_state_dir: {workdir / 'conf-env-state'}\n")
    port = free_port()
    env = own_environment(
        CONTEXTPAW_LLAMACPP=llamacpp.url, CONTEXTPAW_LLAMACPP_PORT=str(port), CONTEXTPAW_POLICY="strict",
        CONTEXTPAW_CONFDIR=str(conf),
    )  # fmt: skip
    url = f"http://{LOOPBACK}:{port}"
    with start_process(COMMAND, url, "/contextpaw/health", workdir / "conf-env.log", 60, env=env):
        status, health = get(url + "/contextpaw/health")
        assert status == 200 and health["policy"] == "strict"
        assert [(b["kind"], b["url"]) for b in health["backends"]] == [("llamacpp", llamacpp.url)]
        status, answer = post(url + "/v1/chat/completions", overflowing())
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
