"""The 400 demo: an overflowing chat sent to llama-server, direct vs through ContextPaw.

    PYTHONPATH=tests .venv/bin/python scripts/demo/demo_400.py [--trials 6] [--num-ctx 1024] [--llama URL] [--seed 2026]

Without --llama it starts a real llama-server with SmolLM2-135M-Instruct and a small window
(``-c --num-ctx``, one slot), and mitmdump with the ContextPaw addon in front of it
(``--set contextpaw_llamacpp=URL``). Each trial plants a fresh secret at the start of a chat that
overflows the window, asks for it back at the end, and sends the same request both ways with the real
openai client: direct, llama-server refuses it (HTTP 400 exceed_context_size_error, the agent turn is
dead); through ContextPaw, the request is compacted to the window (asked of llama-server's /props,
or named by its 400 and retried once) and the model answers. Odd trials stream. One last trial
sends the rendered chat as a raw prompt to the native ``/completion`` route. One row per path;
recall ends as k/N.

Exits non-zero if the through-ContextPaw path fails: not 200, not compacted, or recall below 80%.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
from pathlib import Path

import openai

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import start_proxy
from support.demo_runs import Progress, run_demo
from support.proof import (
    TABLE_HEAD,
    Trial,
    completion_trial,
    make_secret,
    needle_chat,
    openai_trial,
    overflow_lines,
    proof_holds,
    recall_line,
    rendered_prompt,
    start_demo_llama,
)

DIRECT, THROUGH = "direct", "ContextPaw"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--num-ctx", type=int, default=1024, help="the window llama-server is started with (-c)")
    ap.add_argument("--llama", help="use this llama-server instead of starting one (its window must overflow)")
    ap.add_argument("--seed", type=int, default=2026)
    args, ignored = ap.parse_known_args(argv)
    if ignored:  # scripts/demo/demo.sh passes its arguments to demo_needle.py too (e.g. --ollama)
        print(f"demo_400: ignoring {' '.join(ignored)}", file=sys.stderr)
    rng = random.Random(args.seed)

    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="contextpaw-demo-400-")))
        upstream = args.llama or start_demo_llama(stack, work, args.num_ctx)
        if upstream is None:
            return 2
        proxy = stack.enter_context(
            start_proxy(upstream, work / "mitm", work / "mitmdump.log", options=[f"contextpaw_llamacpp={upstream}"])
        )
        clients = {
            DIRECT: openai.OpenAI(base_url=f"{upstream}/v1", api_key="unused", max_retries=0, timeout=600),
            THROUGH: openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=600),
        }
        trials: list[Trial] = []
        progress = Progress([DIRECT, THROUGH] * (args.trials + 1))
        print(TABLE_HEAD)
        for n in range(args.trials):
            secret = make_secret(rng)
            messages = needle_chat(secret, overflow_lines(args.num_ctx, n), rng)
            stream = n % 2 == 1
            for path, client in clients.items():
                progress.step(f"trial {n + 1}/{args.trials}, {path}{', streamed' if stream else ''}")
                trial = openai_trial(client, path + (" (stream)" if stream else ""), secret, messages, stream=stream)
                trials.append(trial)
                print(trial.row(), flush=True)
        # The raw-prompt route: the same kind of chat, rendered by the server's template, on /completion.
        secret = make_secret(rng)
        prompt = rendered_prompt(upstream, needle_chat(secret, overflow_lines(args.num_ctx, 1), rng))
        for path, base_url in ((DIRECT, upstream), (THROUGH, proxy.url)):
            progress.step(f"the raw prompt on /completion, {path}")
            trial = completion_trial(base_url, f"{path} /completion", secret, prompt)
            trials.append(trial)
            print(trial.row(), flush=True)
        progress.end()

    direct = [t for t in trials if t.path.startswith(DIRECT)]
    through = [t for t in trials if t.path.startswith(THROUGH)]
    print(recall_line(DIRECT, direct))
    print(recall_line(THROUGH, through))
    refused = sum(t.status == 400 for t in direct)
    print(f"{DIRECT}: HTTP 400 exceed_context_size_error {refused}/{len(direct)}")
    if refused < len(direct):
        print("note: some direct requests fit the window; raise the filler or lower --num-ctx", file=sys.stderr)
    rescued = sum(bool(t.report and t.report.get("recovered_from_upstream_400")) for t in through)
    print(f"{THROUGH}: HTTP 200 {sum(t.status == 200 for t in through)}/{len(through)}, "
          f"compacted {sum(t.compacted for t in through)}/{len(through)} "
          f"({len(through) - rescued} before sending, {rescued} after llama-server's 400)")  # fmt: skip
    return 0 if proof_holds(through) else 1


if __name__ == "__main__":
    started = "mitmdump" if any(a.startswith("--llama") for a in sys.argv[1:]) else "llama-server and mitmdump"
    sys.exit(run_demo(main, name="demo_400", servers=started))
