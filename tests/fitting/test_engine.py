"""The seam between the engine and the wire formats (`fitting.engine`): a fit's body is written once."""

from __future__ import annotations

import json
from typing import Any

import pytest

from contextpaw import wire
from contextpaw.fitting.engine import forbidding_truncation
from contextpaw.fitting.flow import Forward
from support.fitters import chat, fitter, state

WRITTEN = [
    {"model": "m", "messages": [{"role": "user", "content": "héllo \u2603"}], "options": {"num_ctx": 2048, "temperature": 0.5}},
    {"model": "m", "messages": [{"role": "user", "content": "an emoji cut in half: \ud83d"}], "stream": True},
    {"model": "m", "prompt": "p", "images": [], "keep_alive": None, "format": {"type": "object", "required": ["a"]}},
    {},
]


@pytest.mark.parametrize("fields", WRITTEN)
def test_truncate_false_is_added_to_a_written_body_byte_for_byte_as_a_parse_and_rewrite_would(fields: dict[str, Any]) -> None:
    body = wire.write(fields)
    assert forbidding_truncation(body) == wire.write(wire.load(body), truncate=False)


def test_truncate_false_goes_at_the_end_of_a_body_whose_numbers_python_would_write_otherwise() -> None:
    body = wire.write(wire.load(b'{"model": "m", "options": {"seed": 1e400, "top_p": 0.10}, "prompt": "p"}'))
    assert forbidding_truncation(body) == wire.write(wire.load(body), truncate=False)
    assert forbidding_truncation(body).endswith(b',"truncate":false}') and b"1e400" in body


async def test_an_overflowing_ollama_chat_is_written_once_and_never_parsed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded: list[bytes] = []
    load = wire.load
    monkeypatch.setattr(wire, "load", lambda raw: loaded.append(raw) or load(raw))
    decision = await fitter(output_reserve=0).fit(state(chat()))
    assert isinstance(decision, Forward) and decision.compacted and decision.body is not None
    assert json.loads(decision.body)["truncate"] is False
    cut = decision.body.removesuffix(b',"truncate":false}') + b"}"
    assert cut not in loaded, "the fit's body is not read back to add truncate: false"
