"""The `contextpaw` command as mitmproxy users expect it: `-w` saves each flow as the client got it,
and the default log says in one line per request what happened."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from mitmproxy import io

from support.backends import Backend, free_port, start_module, start_process

LOOPBACK = "127.0.0.1"
N_CTX = 1024


def overflowing(turns: int = 10) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": "Read these notes."}]
    for i in range(turns):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": f"note {i}: " + "lorem ipsum " * 150})
    return [*messages, {"role": "user", "content": "What is the note about?"}]


@dataclass
class Command:
    process: Backend
    url: str
    flows: Path


@pytest.fixture(scope="module")
def saving(workdir: Path, ollama: Backend) -> Iterator[Command]:
    """`contextpaw --ollama URL -w FILE`, with the default log (no -q, no --flow-detail)."""
    port, flows = free_port(), workdir / "saved-as-sent.mitm"
    argv = [
        sys.executable, "-m", "contextpaw.command.cli", "--ollama", ollama.url, "--port", str(port),
        "--confdir", str(workdir / "conf"), "-w", str(flows),
        "--set", f"contextpaw_default_ctx={N_CTX}", "--set", "contextpaw_output_reserve=128",
        "--set", f"contextpaw_state_dir={workdir / 'saving-state'}", "--set", "contextpaw_calibrate=false",
    ]  # fmt: skip
    url = f"http://{LOOPBACK}:{port}"
    with start_process(argv, url, "/contextpaw/health", workdir / "saving.log", 60) as process:
        yield Command(process, url, flows)


def new_lines(log: Path, seen: int, want: int, timeout: float = 10) -> list[str]:
    """The log's lines after the first `seen`, once there are `want` of them (or the time is up)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = log.read_text().splitlines()[seen:]
        if len(lines) >= want or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def test_the_default_log_says_a_compaction_when_decided_and_the_answer_when_it_ends(saving: Command) -> None:
    """Two lines: the compaction as it is sent on (on the real server the answer came 4 min 17 s
    after a 0.15 s compaction, and nothing was said meanwhile), then what came of the request."""
    body = {"model": "fake", "messages": overflowing(), "options": {"num_ctx": N_CTX, "num_predict": 16}, "stream": False}
    seen = len(new_lines(saving.process.log, 0, 0))
    assert httpx.post(f"{saving.url}/api/chat", json=body, timeout=30).status_code == 200
    time.sleep(1)  # what else the request would log comes in this time
    [decided, line] = new_lines(saving.process.log, seen, 2)
    assert re.search(r"/api/chat ollama\.chat fake: compacted \d+→\d+ tokens \(budget \d+.*, sent on \(\d+\.\d+ s\)$", decided), decided
    assert re.search(r"POST /api/chat ollama\.chat fake: compacted \d+ -> \d+ tokens \(budget \d+.*\) -> 200$", line), line
    assert "connect" not in line


def test_w_saves_the_answers_the_client_got_streamed_included(saving: Command) -> None:
    body = {"model": "fake", "messages": overflowing(), "options": {"num_ctx": N_CTX, "num_predict": 16}}
    plain = httpx.post(f"{saving.url}/api/chat", json={**body, "stream": False}, timeout=30)
    streamed = httpx.post(f"{saving.url}/api/chat", json=body, timeout=30)
    assert plain.json()["contextpaw"]["compacted"] is True
    assert json.loads(streamed.text.strip().splitlines()[-1])["contextpaw"]["compacted"] is True
    saving.process.stop()  # mitmproxy closes the flow file on exit
    with saving.flows.open("rb") as f:
        saved = [flow for flow in io.FlowReader(f).stream() if flow.request.path == "/api/chat"]
    assert [flow.response.content for flow in saved[-2:]] == [plain.content, streamed.content]


def test_a_backend_down_at_start_is_warned_of_and_health_answers_503_until_it_is_back(workdir: Path) -> None:
    port, backend_port = free_port(), free_port()
    backend = f"http://{LOOPBACK}:{backend_port}"
    argv = [
        sys.executable, "-m", "contextpaw.command.cli", "--ollama", backend, "--port", str(port),
        "--confdir", str(workdir / "conf"), "--set", f"contextpaw_state_dir={workdir / 'down-state'}",
    ]  # fmt: skip
    url = f"http://{LOOPBACK}:{port}"
    with start_process(argv, url, "/contextpaw/health", workdir / "down-at-start.log", 60) as proxy:
        warned = [line for line in new_lines(proxy.log, 0, 3) if "does not answer" in line]
        assert len(warned) == 1 and backend in warned[0] and "ollama serve" in warned[0], warned
        down = httpx.get(f"{url}/contextpaw/health", timeout=10)
        [row] = down.json()["backends"]
        assert down.status_code == 503 and row["answers"] is False
        assert row["last_error"] and row["last_error_at"] and row["last_ok_at"] is None
        args = ["--n-ctx", str(N_CTX), "--native"]
        with start_module("support.fake_ollama", args, "/", workdir / "back-again.log", port=backend_port):
            up = httpx.get(f"{url}/contextpaw/health", timeout=10)
        [row] = up.json()["backends"]
        assert up.status_code == 200 and row["answers"] is True
        assert row["last_error"] is None and row["last_error_at"] and row["last_ok_at"]


def test_a_llama_server_given_as_ollama_is_said_at_start(workdir: Path) -> None:
    """Only the doctor saw it: the proxy fronted a llama-server given as --ollama without a word,
    and read its window the Ollama way."""
    port = free_port()
    with start_module("support.fake_llamacpp", ["--n-ctx", "2048"], "/health", workdir / "misnamed-llamacpp.log") as backend:
        argv = [
            sys.executable, "-m", "contextpaw.command.cli", "--ollama", backend.url, "--port", str(port),
            "--confdir", str(workdir / "conf"), "--set", f"contextpaw_state_dir={workdir / 'misnamed-state'}",
        ]  # fmt: skip
        with start_process(argv, f"http://{LOOPBACK}:{port}", "/contextpaw/health", workdir / "misnamed.log", 60) as proxy:
            warned = [line for line in new_lines(proxy.log, 0, 3, timeout=10) if "is a llamacpp" in line]
    assert len(warned) == 1 and f"give it as --llamacpp {backend.url}" in warned[0], warned
