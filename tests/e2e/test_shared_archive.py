"""Two ContextPaw instances behind one balancer share a Redis archive: what one evicted reads
back through the other by the marker's own reference, after the first is killed."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from support.backends import Backend, start_proxy
from support.common import FAKE_N_CTX
from support.redis_server import redis_server

COMMAND = re.compile(r"curl -s '(http://[^/\s]+)/contextpaw/evicted/(cp-[0-9a-f]{12}\.[0-9a-f]{16})\?part=1'")


def overflowing_chat() -> dict:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read the logs."}]
    for i in range(14):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": f"part {i} " + "log line " * 120})
    return {"model": "fake", "messages": messages, "stream": False, "options": {"num_ctx": FAKE_N_CTX}}


def post(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status, response.read()


def test_what_one_instance_evicted_reads_back_through_the_other_after_it_is_killed(
    tmp_path: Path, workdir: Path, ollama: Backend, get: Callable[..., tuple[int, dict[str, str], bytes]]
) -> None:
    with redis_server(tmp_path) as redis_url:
        shared = [f"contextpaw_archive={redis_url}"]
        first = start_proxy(ollama.url, tmp_path / "first", workdir / "shared-first.log", options=shared)
        second = start_proxy(ollama.url, tmp_path / "second", workdir / "shared-second.log", options=shared)
        try:
            status, body = post(first.url + "/api/chat", overflowing_chat())
            report = json.loads(body)["contextpaw"]
            assert status == 200 and report["compacted"], report
            dropped = next(r for r in report["removals"] if r["action"] == "dropped")
            ref = dropped["marker_id"]
            # the first instance writes behind its answer (a writer thread): the second reads it once there
            deadline = time.monotonic() + 10
            while get(f"{second.url}/contextpaw/evicted/{ref}")[0] != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            os.killpg(first.process.pid, signal.SIGKILL)  # mid-session, no shutdown
            first.process.wait(10)
            assert get(f"{first.url}/contextpaw/health")[0] == 0  # gone
            status, _, answer = get(f"{second.url}/contextpaw/evicted/{ref}")
            assert status == 200, answer
            assert json.loads(answer)["content"][0] == overflowing_chat()["messages"][dropped["index"]]
            status, _, _ = get(f"{second.url}/contextpaw/evicted/{ref.split('.')[0]}")
            assert status == 404  # the fleet's capability is still required
        finally:
            first.stop()
            second.stop()
