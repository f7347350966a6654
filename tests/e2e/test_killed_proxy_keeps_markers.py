"""A marker the model read stands for content the archive holds, even if the proxy is killed right
after the answer (issue 56: `kill -9` during writes lost 76 of 3,348 references, written behind
the answer by the archive's thread)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import urllib.request
from collections.abc import Callable
from pathlib import Path

from support.backends import Backend, start_proxy
from support.common import FAKE_N_CTX


def chat(n: int) -> dict:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Read the logs of run {n}."}]
    for i in range(14):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": f"run {n} part {i} " + "log line " * 120})
    return {"model": "fake", "messages": messages, "stream": False, "options": {"num_ctx": FAKE_N_CTX}}


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["contextpaw"]


def test_every_reference_answered_before_a_kill_reads_back_after_a_restart(
    tmp_path: Path, workdir: Path, ollama: Backend, get: Callable[..., tuple[int, dict[str, str], bytes]]
) -> None:
    state = [f"contextpaw_state_dir={tmp_path / 'state'}"]
    proxy = start_proxy(ollama.url, tmp_path / "conf", workdir / "killed-first.log", options=state)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            reports = list(pool.map(lambda n: post(proxy.url + "/api/chat", chat(n)), range(40)))
        os.killpg(proxy.process.pid, signal.SIGKILL)  # right after the last answer: no shutdown, no flush
        proxy.process.wait(10)
    finally:
        proxy.stop()
    refs = {r["marker_id"] for report in reports for r in report["removals"]}
    assert len(refs) >= 40 and all(report["compacted"] for report in reports)
    again = start_proxy(ollama.url, tmp_path / "conf", workdir / "killed-again.log", options=state)
    try:
        unread = [ref for ref in refs if get(f"{again.url}/contextpaw/evicted/{ref}")[0] != 200]
    finally:
        again.stop()
    assert unread == [], f"{len(unread)} of {len(refs)} references lost"
