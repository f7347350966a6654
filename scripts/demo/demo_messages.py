"""The proof over Claude Code's API: the needle and the 400 over /v1/messages with the anthropic SDK.

    PYTHONPATH=tests .venv/bin/python scripts/demo/demo_messages.py [--trials 4] [--num-ctx 1024] [--seed 2026]

It starts a real llama-server with SmolLM2-135M-Instruct at ``-c --num-ctx`` (where an overflow is
a 400), the Ollama simulator over a second one (where it is cut in silence to ``--num-ctx``), and
mitmdump with the ContextPaw addon in front of each. Each trial plants a fresh secret at the start of
a request that overflows the window and asks for it back at the end, and sends it with the real
``anthropic`` client four ways: to each backend direct and through ContextPaw. Odd trials stream.
One row per request; recall ends as k/N per path.

Exits non-zero if a path through ContextPaw fails: not 200, not compacted, or recall below 80%.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
from pathlib import Path

import anthropic

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import running, start_proxy
from support.demo_runs import Progress, run_demo
from support.fake_ollama import OllamaSettings
from support.ollama_sim import ollama_sim_app
from support.proof import (
    TABLE_HEAD,
    Trial,
    anthropic_trial,
    make_secret,
    needle_chat,
    overflow_lines,
    proof_holds,
    recall_line,
    start_demo_llama,
)

MODEL = "smollm2:135m"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--num-ctx", type=int, default=1024, help="the window of both backends")
    ap.add_argument("--seed", type=int, default=2026)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)

    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="contextpaw-demo-messages-")))
        for side in ("llama", "sim"):
            (work / side).mkdir()
        llama = start_demo_llama(stack, work / "llama", args.num_ctx)
        behind_ollama = start_demo_llama(stack, work / "sim", 2 * args.num_ctx)
        if llama is None or behind_ollama is None:
            return 2
        ollama = stack.enter_context(running(ollama_sim_app(behind_ollama, OllamaSettings(model=MODEL, num_ctx=args.num_ctx))))
        through = {
            name: stack.enter_context(start_proxy(url, work / "mitm", work / f"{name}.log", options=[f"contextpaw_{kind}={url}"])).url
            for name, kind, url in (("llama-server", "llamacpp", llama), ("Ollama", "ollama", ollama))
        }
        direct = {"llama-server": llama, "Ollama": ollama}
        trials: list[Trial] = []
        progress = Progress([f"{b} {w}" for b in ("llama-server", "Ollama") for w in ("direct", "ContextPaw")] * args.trials)
        print(TABLE_HEAD)
        for n in range(args.trials):
            secret = make_secret(rng)
            messages = needle_chat(secret, filler_lines=overflow_lines(args.num_ctx, n), rng=rng)
            stream = n % 2 == 1
            for backend in ("llama-server", "Ollama"):
                for way, url in (("direct", direct[backend]), ("ContextPaw", through[backend])):
                    progress.step(f"trial {n + 1}/{args.trials}, {backend} {way}{', streamed' if stream else ''}")
                    client = anthropic.Anthropic(base_url=url, api_key="local", max_retries=0, timeout=600)
                    trial = anthropic_trial(client, f"{backend} {way}", secret, messages, model=MODEL, stream=stream)
                    trials.append(trial)
                    print(trial.row(), flush=True)
        progress.end()

    paths = [f"{b} {w}" for b in ("llama-server", "Ollama") for w in ("direct", "ContextPaw")]
    for path in paths:
        print(recall_line(path, (t for t in trials if t.path == path)))
    held = all(proof_holds(t for t in trials if t.path == path) for path in paths if path.endswith("ContextPaw"))
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(run_demo(main, name="demo_messages", servers="both llama-servers, the Ollama simulator and mitmdump"))
