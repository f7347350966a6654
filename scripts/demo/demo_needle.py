"""The needle demo: a secret at the start of an overflowing chat, asked back, direct vs through ContextPaw.

    PYTHONPATH=tests .venv/bin/python scripts/demo/demo_needle.py [--trials 6] [--num-ctx 1024] [--ollama URL]

Without --ollama it starts what it needs: a real llama-server with SmolLM2-135M-Instruct, the
Ollama simulator on top of it (Ollama's own truncation, reproduced), and mitmdump with the
ContextPaw addon in front of the simulator. Each trial uses a fresh secret and a different overflow
size, asks over Ollama's /api/chat both ways, and prints one row per path; recall ends as k/N.
Exits non-zero if the through-ContextPaw path fails to recall.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
from pathlib import Path

import httpx

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import running, start_proxy
from support.demo_runs import Progress, run_demo
from support.fake_ollama import OllamaSettings
from support.ollama_sim import ollama_sim_app
from support.proof import (
    TABLE_HEAD,
    Trial,
    make_secret,
    needle_chat,
    proof_holds,
    recall_line,
    recalled,
    start_demo_llama,
)

MODEL = "smollm2:135m"


def ask(base_url: str, path: str, secret: str, messages: list[dict], num_ctx: int) -> Trial:
    """One /api/chat call; raw HTTP so the `contextpaw` report field is visible (the ollama client drops it)."""
    body = {"model": MODEL, "messages": messages, "stream": False, "options": {"num_ctx": num_ctx, "num_predict": 24, "temperature": 0}}
    reply = httpx.post(f"{base_url}/api/chat", json=body, timeout=600)
    data = reply.json()
    if reply.status_code != 200:
        return Trial(path, reply.status_code, f"error: {data.get('error')}"[:60], False)
    answer = data["message"]["content"]
    return Trial(path, 200, answer, recalled(secret, answer), data.get("prompt_eval_count"), data.get("contextpaw"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--num-ctx", type=int, default=1024, help="the window the Ollama side runs with")
    ap.add_argument("--ollama", help="use this Ollama (or simulator) instead of starting one")
    ap.add_argument("--seed", type=int, default=2026)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)

    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="contextpaw-demo-")))
        upstream = args.ollama
        if upstream is None:
            server = start_demo_llama(stack, work, 2048)
            if server is None:
                return 2
            settings = OllamaSettings(model=MODEL, num_ctx=args.num_ctx)
            upstream = stack.enter_context(running(ollama_sim_app(server, settings)))
        proxy = stack.enter_context(start_proxy(upstream, work / "mitm", work / "mitmdump.log", options=[f"contextpaw_ollama={upstream}"]))
        trials: list[Trial] = []
        progress = Progress(["direct", "ContextPaw"] * args.trials)
        print(TABLE_HEAD)
        for n in range(args.trials):
            secret = make_secret(rng)
            messages = needle_chat(secret, filler_lines=120 + 50 * n, rng=rng)
            for path, url in (("direct", upstream), ("ContextPaw", proxy.url)):
                progress.step(f"trial {n + 1}/{args.trials}, {path}")
                trial = ask(url, path, secret, messages, args.num_ctx)
                trials.append(trial)
                print(trial.row(), flush=True)
        progress.end()

    for path in ("direct", "ContextPaw"):
        print(recall_line(path, (t for t in trials if t.path == path)))
    return 0 if proof_holds(t for t in trials if t.path == "ContextPaw") else 1


if __name__ == "__main__":
    sys.exit(run_demo(main, name="demo_needle", servers="llama-server, the Ollama simulator and mitmdump"))
