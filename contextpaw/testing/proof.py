"""The proof, as code shared by the demos and the real-backend tests: a needle in an overflowing chat.

A random secret is planted at the start of a prompt that overflows the window (a pasted log), and the
end of it asks for the secret back. Ollama cuts the front and the model invents; llama-server refuses
with a 400; through ContextPaw the middle is elided with a marker, head and tail are kept, and the
model can answer.
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


def needle_chat(secret: str, filler_lines: int, rng: random.Random) -> list[dict[str, Any]]:
    """A chat whose one user message holds the secret first, a long pasted log, and the question last."""
    return [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": needle_prompt(secret, filler_lines, rng)},
    ]


def needle_prompt(secret: str, filler_lines: int, rng: random.Random) -> str:
    """Secret first, `filler_lines` of bland log, the question last."""
    filler = "\n".join(rng.choice(FILLER) for _ in range(filler_lines))
    return f"Remember this password: {secret}.\n{filler}\nWhat is the password I asked you to remember?"


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
