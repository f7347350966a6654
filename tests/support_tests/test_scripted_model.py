"""The scripted model's measures of a session (tests/support/scripted_model.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.scripted_model import ScriptedModel, Session, Settings, from_chat, render_messages


class Characters:
    """A tokenizer of one token per character: the measures are lengths, whatever the vocabulary."""

    class Encoding:
        def __init__(self, text: str) -> None:
            self.ids = [ord(c) for c in text]

    def encode(self, text: str, add_special_tokens: bool = False) -> Encoding:
        return self.Encoding(text)


def chat(*messages: tuple[str, str]) -> dict[str, Any]:
    return {"messages": [{"role": role, "content": content} for role, content in messages]}


HEAD = (("system", "sys"), ("user", "task"))
READ_1 = (("assistant", "call 1"), ("tool", "file one"))
READ_2 = (("assistant", "call 2"), ("tool", "file two"))
READ_3 = (("assistant", "call 3"), ("tool", "file three"))


def length(body: dict[str, Any], start: int) -> int:
    return len(render_messages(from_chat(body).messages[start:]))


def test_the_least_a_turn_costs_is_the_messages_it_adds_whatever_was_cut_before_them() -> None:
    model = ScriptedModel(Settings(1000, "ollama", False, Path("unused.gguf"), None), Characters())
    session = Session(files=[])
    opening = chat(*HEAD, *READ_1)
    later = chat(*HEAD, *READ_1, *READ_2)
    after_a_cut = chat(*HEAD, ("user", "[ContextPaw: 2 messages evicted]"), *READ_2, *READ_3)
    assert model.new(session, from_chat(opening)) == length(opening, 0)  # nothing before it: all of it is new
    assert model.new(session, from_chat(later)) == length(later, 4)
    assert model.new(session, from_chat(after_a_cut)) == length(after_a_cut, 5)  # the marker is the cut's, not the turn's
