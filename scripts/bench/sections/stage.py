"""What sections 8-10 (burst, big_answer, fuzz_cpu, sessions) measure: one bare mitmdump and one
mitmdump with ContextPaw, started once for all four, each with a listener in front of each of three
backends: a fake llama-server (8 slots; the small client's and half the sessions'), a fake Ollama
(native /api/chat; the burst's and the other half of the sessions'), and scripts/measure/measure_hardening.py's
llama-server look-alike (a 1,024-token window; the big buffered answer and the fuzz pass)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from sections.common import SCRIPTS, side_by_side, started

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import Backend, free_port, start_module, start_process
from support.common import LOOPBACK

MB = 1 << 20
LLAMACPP_CTX = 65_536
"""The fake llama-server's window: the small client's chats and the sessions' fit."""
OLLAMA_CTX = 8192
"""The fake Ollama's default window (each request says its own `num_ctx`)."""
NAMES = ("mitmdump", "ContextPaw")
BACKENDS = ("llamacpp", "ollama", "hardening")


class Stage:
    """The two proxies and the three backends, started on `__enter__` and stopped on `__exit__`;
    the big answer is 300 MB (20 with `quick`)."""

    def __init__(self, work: Path, quick: bool) -> None:
        self.work, self.answer_mb = work, 20 if quick else 300
        self._stack = contextlib.ExitStack()
        self.proxies: dict[str, tuple[Backend, list[str]]] = {}
        self.backends: dict[str, Backend] = {}

    def __enter__(self) -> Stage:
        port, work = free_port(), self.work
        serve = [sys.executable, str(SCRIPTS / "measure" / "measure_hardening.py"), "--serve", str(port),
                 "--sizes", json.dumps({"record": 0, "answer": self.answer_mb * MB, "inflated_answer": 0})]  # fmt: skip
        with self._stack as stack:
            backends = started(
                stack,
                lambda: start_module(
                    "support.fake_llamacpp", ["--n-ctx", str(LLAMACPP_CTX), "--slots", "8"], "/health", work / "stage-llamacpp.log"
                ),
                lambda: start_module("support.fake_ollama", ["--n-ctx", str(OLLAMA_CTX), "--native"], "/", work / "stage-ollama.log"),
                lambda: start_process(serve, f"http://{LOOPBACK}:{port}", "/health", work / "stage-hardening.log", 120),
            )
            self.backends = dict(zip(BACKENDS, backends, strict=True))
            llamacpp, ollama, hardening = (b.url for b in backends)
            options = [f"contextpaw_llamacpp={llamacpp}", f"contextpaw_llamacpp={hardening}", f"contextpaw_ollama={ollama}",
                       "contextpaw_calibrate=false", "contextpaw_output_reserve=128", "flow_detail=0"]  # fmt: skip
            self.proxies = side_by_side(stack, [llamacpp, ollama, hardening], work, "stage", options, ["flow_detail=0"])
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def process(self, name: str) -> Backend:
        return self.proxies[name][0]

    def url(self, name: str, backend: str) -> str:
        """The listener of proxy `name` in front of `backend` (one of BACKENDS)."""
        return self.proxies[name][1][BACKENDS.index(backend)]


def turns(rounds: int) -> list[str]:
    """The paths' order, round by round: bare first, then ContextPaw first, and so on."""
    return [name for r in range(rounds) for name in (NAMES if r % 2 == 0 else NAMES[::-1])]
