"""The proof, as code shared by the demos and the real-backend tests: a needle in an overflowing chat.

A random secret is planted in the first user message (the task), the conversation then grows past the
window with bland tool output, and the last message asks for the secret back. Ollama drops the front
and the model invents; llama-server refuses with a 400; through ContextPaw the task is kept, the stale
middle is evicted with a marker, and the model can answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

WORDS = ["walrus", "mango", "copper", "violet", "falcon", "pepper", "glacier", "saffron", "otter", "cobalt"]
FILLER = [
    "The build log shows the compiler finished the module without warnings.",
    "The linter reported no issues in this directory.",
    "The cache directory was cleaned and recreated.",
    "All unit tests in this package passed on the last run.",
    "The configuration file uses the default values for every field.",
]


def make_secret(rng: random.Random) -> str:
    return f"{rng.choice(WORDS).upper()}-{rng.randint(1000, 9999)}"


def needle_chat(secret: str, filler_turns: int, rng: random.Random, lines_per_dump: int = 12) -> list[dict[str, Any]]:
    """A chat whose first message holds the secret and whose middle is `filler_turns` tool-output turns."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"Remember this password: {secret}. I will ask you for it later."},
        {"role": "assistant", "content": "Understood. I will remember the password."},
    ]
    for turn in range(filler_turns):
        dump = "\n".join(rng.choice(FILLER) for _ in range(lines_per_dump))
        messages.append({"role": "user", "content": f"Here is status report {turn + 1}:\n{dump}"})
        messages.append({"role": "assistant", "content": "Noted."})
    messages.append({"role": "user", "content": "What is the password I asked you to remember? Reply with the password only."})
    return messages


def needle_prompt(secret: str, filler_lines: int, rng: random.Random) -> str:
    """The raw-prompt form for /api/generate and /completion: secret first, question last."""
    filler = "\n".join(rng.choice(FILLER) for _ in range(filler_lines))
    return (
        f"Remember this password: {secret}.\n{filler}\n"
        "Question: what is the password I asked you to remember? Answer: The password is"
    )


def recalled(secret: str, answer: str | None) -> bool:
    """The answer holds the secret's distinctive number (small models mangle case and punctuation)."""
    return bool(answer) and secret.split("-")[1] in answer


@dataclass
class Trial:
    path: str
    status: int
    answer: str
    recalled: bool
    prompt_tokens: int | None = None
    report: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def row(self) -> str:
        report = self.report or {}
        squeezed = (
            f"{report.get('original_tokens')}→{report.get('final_tokens')} (budget {report.get('budget')})"
            if report.get("compacted")
            else "-"
        )
        answer = self.answer.replace("\n", " ")[:60]
        return (
            f"| {self.path} | {self.status} | {self.prompt_tokens if self.prompt_tokens is not None else '-'} "
            f"| {squeezed} | {answer} | {'yes' if self.recalled else 'no'} |"
        )


TABLE_HEAD = "| path | HTTP | prompt tokens (server) | compaction | answer | recalled |\n|---|---:|---:|---|---|---|"
