"""The README's "Run it in front of your servers", followed as written: its commands are read out of
README.md and run with the fake Ollama and llama-server standing in for the real ones.

Only the port numbers are changed (the README's ports may be taken on the machine that runs the
tests), one for one, in the commands and in the start-up line the README shows; everything else is
the README's own text, so a change to the README that no longer works fails here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from support.backends import Backend, free_port, start_process

REPO = Path(__file__).resolve().parents[2]
SECTION = "## Run it in front of your servers"
BACKEND_PORTS = {"ollama": 11435, "llamacpp": 8091}
"""Where the README moves the real servers: the fakes' ports take their place."""
LISTEN_PORTS = (11434, 8092)
"""Where the README has ContextPaw listen: free ports take their place."""


def section() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end > 0 else len(text)]


def blocks(text: str) -> list[str]:
    """The fenced blocks of `text`, in order."""
    return re.findall(r"```[a-z]*\n(.*?)```", text, re.S)


def commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def renumbered(text: str, ports: dict[int, int]) -> str:
    return re.sub(r"\b(\d{4,5})\b", lambda m: str(ports.get(int(m.group(1)), m.group(1))), text)


def request(url: str, body: dict | None = None) -> tuple[int, dict[str, str], dict]:
    data = json.dumps(body).encode() if body is not None else None
    sent = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(sent, timeout=60) as answer:
            return answer.status, dict(answer.headers), json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def overflowing_chat() -> dict:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Summarise the logs."}]
    for i in range(12):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": f"part {i} " + "log line " * 300})
    return {"model": "fake", "messages": messages, "stream": False}


@pytest.fixture
def ports(ollama: Backend, llamacpp: Backend) -> dict[int, int]:
    """README port -> the port used here."""
    taken = {BACKEND_PORTS["ollama"]: int(ollama.url.rpartition(":")[2]), BACKEND_PORTS["llamacpp"]: int(llamacpp.url.rpartition(":")[2])}
    return taken | {port: free_port() for port in LISTEN_PORTS}


@pytest.fixture
def home(tmp_path: Path) -> dict[str, str]:
    """The environment of a new user: a HOME of its own (mitmproxy's confdir goes there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CONTEXTPAW_", "OLLAMA_"))}
    return {**env, "HOME": str(tmp_path / "home")}


def test_the_contextpaw_command_runs_as_the_readme_says(ports: dict[int, int], home: dict[str, str], tmp_path: Path) -> None:
    text = section()
    shown = blocks(text)
    command = next(c for c in commands(shown[0]) if c.startswith(".venv/bin/contextpaw"))
    argv = shlex.split(renumbered(command, ports))
    argv[0] = str(REPO / argv[0])
    ollama_port, llamacpp_port = (ports[p] for p in LISTEN_PORTS)
    log = tmp_path / "contextpaw.log"
    with start_process(argv, f"http://127.0.0.1:{ollama_port}", "/contextpaw/health", log, 60, env=home):
        startup = renumbered(next(b for b in shown if b.startswith("contextpaw ")).strip(), ports)
        expected = re.escape(startup).replace(re.escape("0.3.0"), r"\d+\.\d+\.\d+\S*")
        assert re.search(expected, log.read_text()), (startup, log.read_text()[-2000:])

        for port in (ollama_port, llamacpp_port):
            status, _, health = request(f"http://127.0.0.1:{port}/contextpaw/health")
            assert status == 200 and {b["kind"] for b in health["backends"]} >= {"ollama", "llamacpp"}, health
            assert all(b["answers"] for b in health["backends"]), health

        status, headers, answer = request(f"http://127.0.0.1:{ollama_port}/api/chat", overflowing_chat())
        assert status == 200 and headers.get("X-ContextPaw-Compacted") == "true", (status, headers)
        assert answer["contextpaw"]["final_tokens"] <= answer["contextpaw"]["budget"]

        doctor = [str(REPO / ".venv/bin/contextpaw"), "doctor", *argv[1:]]
        done = subprocess.run(doctor, capture_output=True, text=True, timeout=120, env=home, check=False)
        report = done.stdout + done.stderr
        assert done.returncode in (0, 1), report  # 2 would be: could not check
        assert f"ok      ContextPaw at http://127.0.0.1:{ollama_port}: answers" in report, report


def test_plain_mitmdump_runs_as_the_readme_says(ports: dict[int, int], home: dict[str, str], tmp_path: Path) -> None:
    mitmdump = next(b for b in blocks(section()) if b.startswith("mitmdump "))
    argv = shlex.split(renumbered(commands(mitmdump)[0], ports))
    assert argv[0] == "mitmdump"
    argv[0] = str(REPO / ".venv/bin/mitmdump")
    ollama_port, llamacpp_port = (ports[p] for p in LISTEN_PORTS)
    argv[argv.index("-s") + 1] = str(REPO / argv[argv.index("-s") + 1])  # the README runs it from the checkout
    log = tmp_path / "mitmdump.log"
    with start_process(argv, f"http://127.0.0.1:{ollama_port}", "/contextpaw/health", log, 60, env=home):
        status, _, health = request(f"http://127.0.0.1:{llamacpp_port}/contextpaw/health")
        assert status == 200 and all(b["answers"] for b in health["backends"]), health
        body = {**overflowing_chat(), "max_tokens": 8}
        status, headers, answer = request(f"http://127.0.0.1:{llamacpp_port}/v1/chat/completions", body)
        assert status == 200 and headers.get("X-ContextPaw-Compacted") == "true", (status, headers)
