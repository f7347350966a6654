"""The proof over Codex's API: the needle over OpenAI's Responses API (/v1/responses), with the openai SDK.

    PYTHONPATH=tests .venv/bin/python scripts/demo/demo_responses.py [--trials 4] [--num-ctx 2048] [--seed 2026]
                                               [--llama URL] [--direct-only] [--shape codex|single]

It starts a real llama-server with SmolLM2-135M-Instruct at ``-c --num-ctx`` (where an overflow is
the 400 ``exceed_context_size_error``), the Ollama simulator over a second one (Ollama's /v1/responses
takes no options, so an overflow is cut in silence to its default window, ``--num-ctx``), and
mitmdump with the ContextPaw addon in front of each. Each trial plants a fresh secret at the start
of a request that overflows the window and asks for it back at the end: ``instructions`` plus one
user message item of ``input_text`` (``--shape single``, the default), or shaped as Codex sends a
session (``--shape codex``): the task with the secret as a typed user message item, then the log
read by the agent's shell tool (a ``function_call`` item and its ``function_call_output`` for every
part), and the user's question, so that ContextPaw drops whole calls with their outputs and stands a
marker item in their place, while the task (the head) is never cut (``scripts/demo/demo.sh`` runs it at
``--num-ctx 1024``: SmolLM2-135M finds the secret across the ~900 tokens a cut leaves there, and in
about half the trials across the ~1,900 of a 2,048-token window). It goes four ways with the real openai
client, ``client.responses.create``: to each backend direct and through ContextPaw. Odd trials
stream (the answer read from the ``response.output_text.delta`` events, the prompt size and the
report from ``response.completed``). One row per request; recall ends as k/N per path.

``--llama URL`` uses a running llama-server for both backends instead of starting two (its window
is then the llama-server side's, and caps the simulator's). ``--direct-only`` skips ContextPaw.
Exits non-zero if a path through ContextPaw fails: not 200, not compacted, or recall below 80%.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import openai

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import running, start_proxy
from support.demo_runs import Progress, run_demo
from support.fake_ollama import OllamaSettings
from support.ollama_sim import ollama_sim_app
from support.proof import (
    GREEDY_TOKENS,
    TABLE_HEAD,
    Trial,
    contextpaw_headers,
    error_answer,
    make_secret,
    needle_chat,
    overflow_lines,
    proof_holds,
    recall_line,
    recalled,
    start_demo_llama,
)

MODEL = "smollm2:135m"
BACKENDS = ("llama-server", "Ollama")


LINES_PER_CALL = 16
"""Log lines the agent's shell tool reads in one call of a Codex-shaped session."""


def _text_item(role: str, text: str) -> dict[str, Any]:
    part = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


def codex_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The needle chat as a Codex session: the system message as ``instructions``; its user message
    cut into the task (the secret, and the file to read), the log as the agent reads it (a shell
    ``function_call`` and its ``function_call_output`` for every part of the file), and the
    question, which the user asks when the reading is done."""
    lines = "\n".join(m["content"] for m in messages if m["role"] == "user").split("\n")
    task, log, question = lines[0], lines[1:-1], lines[-1]
    items = [_text_item("user", f"{task} Then read app.log; I will ask for the password later.")]
    for n, start in enumerate(range(0, len(log), LINES_PER_CALL)):
        command = ["sed", "-n", f"{start + 1},{start + LINES_PER_CALL}p", "app.log"]
        items.append({"type": "function_call", "call_id": f"call_{n}", "name": "shell", "arguments": json.dumps({"command": command})})
        items.append({"type": "function_call_output", "call_id": f"call_{n}", "output": "\n".join(log[start : start + LINES_PER_CALL])})
    instructions = "\n".join(m["content"] for m in messages if m["role"] == "system")
    return {"instructions": instructions, "input": [*items, _text_item("user", question)]}


def responses_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat as a Responses request: the system messages as ``instructions``, the rest as message
    items with ``input_text`` parts (assistant turns as ``output_text``)."""
    instructions = "\n".join(m["content"] for m in messages if m["role"] == "system")
    return {"instructions": instructions, "input": [_text_item(m["role"], m["content"]) for m in messages if m["role"] != "system"]}


def _report(value: Any) -> dict[str, Any] | None:
    extra = getattr(value, "model_extra", None) or {}
    report = extra.get("contextpaw")
    return report if isinstance(report, Mapping) else None


def responses_trial(client: openai.OpenAI, path: str, secret: str, body: dict[str, Any], *, stream: bool) -> Trial:
    """One ``client.responses.create``, streamed or not. A 4xx is the client's ``APIStatusError``:
    the row shows the error and llama-server's token count. The prompt size is ``usage.input_tokens``;
    the ``contextpaw`` report is read from the response (``model_extra``) or, in a stream, from the
    ``response.completed`` event or the response it carries; X-ContextPaw-* from the headers."""
    try:
        raw = client.responses.with_raw_response.create(
            model=MODEL,
            max_output_tokens=GREEDY_TOKENS,
            temperature=0,
            stream=stream,
            **body,  # type: ignore[arg-type]
        )
    except openai.APIStatusError as e:
        error = e.body if isinstance(e.body, Mapping) else {}
        try:
            report = e.response.json().get("contextpaw")
        except ValueError:
            report = None
        return Trial(path, e.status_code, error_answer(error), False, error.get("n_prompt_tokens"), report,
                     headers=contextpaw_headers(e.response.headers))  # fmt: skip
    headers = contextpaw_headers(raw.headers)
    if not stream:
        response = raw.parse()
        answer = response.output_text
        usage = response.usage.input_tokens if response.usage else None
        return Trial(path, raw.status_code, answer, recalled(secret, answer), usage, _report(response), headers=headers)
    pieces: list[str] = []
    usage, report, status = None, None, raw.status_code
    for event in raw.parse():
        if event.type == "response.output_text.delta":
            pieces.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete", "response.failed"):
            usage = event.response.usage.input_tokens if event.response.usage else usage
            report = _report(event) or _report(event.response) or report
        elif event.type == "error":
            pieces.append(f"[stream error: {getattr(event, 'message', '')}]")
    answer = "".join(pieces)
    return Trial(path, status, answer, recalled(secret, answer), usage, report, ["stream"], headers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--num-ctx", type=int, default=2048, help="the window of both backends")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--llama", help="a running llama-server to use for both backends instead of starting two")
    ap.add_argument("--direct-only", action="store_true", help="only the direct rows (no mitmdump)")
    ap.add_argument("--shape", choices=("codex", "single"), default="single", help="a Codex session of turns, or one user item")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    ways = ("direct",) if args.direct_only else ("direct", "ContextPaw")

    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="contextpaw-demo-responses-")))
        for side in ("llama", "sim"):
            (work / side).mkdir()
        llama = args.llama or start_demo_llama(stack, work / "llama", args.num_ctx)
        behind_ollama = args.llama or start_demo_llama(stack, work / "sim", 2 * args.num_ctx)
        if llama is None or behind_ollama is None:
            return 2
        settings = OllamaSettings(model=MODEL, num_ctx=args.num_ctx)
        ollama = stack.enter_context(running(ollama_sim_app(behind_ollama, settings)))
        urls = {("llama-server", "direct"): llama, ("Ollama", "direct"): ollama}
        if not args.direct_only:
            for backend, kind, url in (("llama-server", "llamacpp", llama), ("Ollama", "ollama", ollama)):
                log = work / f"{kind}-mitmdump.log"
                proxy = stack.enter_context(start_proxy(url, work / "mitm", log, options=[f"contextpaw_{kind}={url}"]))
                urls[(backend, "ContextPaw")] = proxy.url
        trials: list[Trial] = []
        progress = Progress([f"{b} {w}" for b in BACKENDS for w in ways] * args.trials)
        print(TABLE_HEAD)
        for n in range(args.trials):
            secret = make_secret(rng)
            messages = needle_chat(secret, filler_lines=overflow_lines(args.num_ctx, n), rng=rng)
            body = codex_body(messages) if args.shape == "codex" else responses_body(messages)
            stream = n % 2 == 1
            print(f"| trial {n + 1}: {'streamed' if stream else 'not streamed'}, secret {secret} | | | | | |", flush=True)
            for backend in BACKENDS:
                for way in ways:
                    progress.step(f"trial {n + 1}/{args.trials}, {backend} {way}{', streamed' if stream else ''}")
                    client = openai.OpenAI(base_url=f"{urls[(backend, way)]}/v1", api_key="local", max_retries=0, timeout=900)
                    trial = responses_trial(client, f"{backend} {way}", secret, body, stream=stream)
                    trials.append(trial)
                    print(trial.row(), flush=True)
        progress.end()

    paths = [f"{b} {w}" for b in BACKENDS for w in ways]
    for path in paths:
        print(recall_line(path, (t for t in trials if t.path == path)))
    held = all(proof_holds(t for t in trials if t.path == path) for path in paths if path.endswith("ContextPaw"))
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(run_demo(main, name="demo_responses", servers="the llama-servers, the Ollama simulator and mitmdump"))
