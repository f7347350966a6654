"""`wire.told_usage`: the answer's prompt size told whole after a cut, each API's fields, nothing else."""

from __future__ import annotations

from contextpaw import wire
from contextpaw.wire import anthropic, ollama, openai


def test_openai_usage_gets_the_cut_added_to_prompt_and_total_and_nothing_else_changes() -> None:
    record = {"id": "x", "choices": [], "usage": {"prompt_tokens": 900, "completion_tokens": 8, "total_tokens": 908}}
    told = wire.told_usage(record, 5000, openai.CHAT.prompt_counts)
    assert told == {"id": "x", "choices": [], "usage": {"prompt_tokens": 5900, "completion_tokens": 8, "total_tokens": 5908}}
    assert record["usage"]["prompt_tokens"] == 900, "the server's answer itself is left as it came"


def test_ollama_and_anthropic_counts_are_told_in_their_own_fields() -> None:
    assert wire.told_usage({"done": True, "prompt_eval_count": 700}, 300, ollama.CHAT.prompt_counts) == {
        "done": True,
        "prompt_eval_count": 1000,
    }
    delta = {"type": "message_delta", "usage": {"input_tokens": 40, "output_tokens": 3}}
    assert wire.told_usage(delta, 10, anthropic.MESSAGES.prompt_counts)["usage"] == {"input_tokens": 50, "output_tokens": 3}


def test_a_record_without_a_count_or_with_one_that_is_not_a_number_is_not_told() -> None:
    assert wire.told_usage({"choices": [{"delta": {"content": "hi"}}]}, 10, openai.CHAT.prompt_counts) is None
    assert wire.told_usage({"usage": None}, 10, openai.CHAT.prompt_counts) is None
    assert wire.told_usage({"prompt_eval_count": True}, 10, ollama.CHAT.prompt_counts) is None
    assert wire.told_usage({"prompt_eval_count": "12"}, 10, ollama.CHAT.prompt_counts) is None
