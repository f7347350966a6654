"""A request the estimate cannot place on a route that cannot forbid Ollama's cut: Ollama is asked
(its native `/api/chat`, `truncate: false`, one token) before anything is cut. An agent's first
request, its summary request and its first turn after its own compaction are such requests."""

from __future__ import annotations

from typing import Any

from contextpaw.calls.server_counts import OllamaCount
from contextpaw.fitting.flow import UNCHANGED, FlowState
from support.fitters import OLLAMA, OPENAI, Asked, fitter, read_request, state

WINDOW = 32768


def agent_request(words: int = 11000) -> dict[str, Any]:
    """An agent's fresh conversation of about `words` * 1.7 estimated tokens (18,700 at 11,000):
    system prompt, tools, the task and a file of source it read."""
    source = "".join(
        f"def handler_{n}(request, context):\n    return resolve(request.user, context.settings[{n}])\n" for n in range(words // 9)
    )
    return read_request("qwen3:8b", source, 4096)


async def fitted(asked: Asked, body: dict[str, Any], **settings: Any) -> FlowState:
    f = fitter(default_ctx=WINDOW, **settings)
    f.services.asking = asked
    s = state(body, OPENAI, OLLAMA)
    DECISIONS[id(s)] = await f.fit(s)
    return s


DECISIONS: dict[int, Any] = {}


async def test_a_new_conversation_that_ollama_counts_within_the_window_goes_out_unchanged() -> None:
    asked = Asked(OllamaCount(18513, True))
    s = await fitted(asked, agent_request())
    assert DECISIONS[id(s)] == UNCHANGED
    assert s.report is not None and not s.report.compacted and s.report.exact and s.report.original_tokens == 18513
    assert any("Ollama counted it at 18513 tokens" in note for note in s.report.notes)
    (body,) = asked.bodies
    assert body["truncate"] is False and body["stream"] is False and body["options"] == {"num_predict": 1}
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "tool"]
    assert body["tools"][0]["function"]["name"] == "read" and "num_ctx" not in body["options"]


async def test_without_an_answer_from_ollama_the_estimates_guard_still_cuts() -> None:
    s = await fitted(Asked(None), agent_request())
    assert s.report is not None and s.report.compacted
    assert any("not learned yet" in note for note in s.report.notes)


async def test_a_request_ollama_refuses_is_cut_at_the_rate_its_count_shows() -> None:
    """Counted at 40,000 by Ollama: cut to the budget at that rate, deeper than the guard's width
    would need had the text been dense, and no deeper than the window less the count's margin."""
    body = agent_request()
    asked = await fitted(Asked(OllamaCount(40000, False)), body)
    guard = await fitted(Asked(None), body)
    assert asked.report is not None and guard.report is not None and asked.report.compacted
    assert any("Ollama counted it at 40000 tokens" in note for note in asked.report.notes)
    assert asked.sent_tokens is not None and guard.sent_tokens is not None
    rate = 40000 / asked.report.original_tokens
    assert asked.sent_tokens * rate <= WINDOW, "what is sent fits the window at the rate Ollama showed"
    assert asked.sent_tokens > guard.sent_tokens, "the cut keeps more than the estimate's whole width allowed"


async def test_a_count_no_text_could_give_is_no_answer() -> None:
    """An Ollama older than `truncate: false` cuts the prompt and counts what it kept: 900 tokens
    for a request whose words alone are 11,000 is not a count of it."""
    s = await fitted(Asked(OllamaCount(900, True)), agent_request())
    assert s.report is not None and s.report.compacted


async def test_a_request_whose_words_prove_it_over_the_window_is_not_asked() -> None:
    """40,000 one-letter words are 40,000 tokens at the least, in any tokenizer."""
    asked = Asked(OllamaCount(1, True))
    body = agent_request()
    body["messages"][3]["content"] = "a b c d " * 10000
    s = await fitted(asked, body)
    assert s.report is not None and s.report.compacted and not asked.bodies


async def test_asking_can_be_turned_off() -> None:
    asked = Asked(OllamaCount(18513, True))
    s = await fitted(asked, agent_request(), ask_ollama=False)
    assert s.report is not None and s.report.compacted and not asked.bodies


async def test_a_request_that_fits_by_the_estimate_is_not_asked() -> None:
    asked = Asked(OllamaCount(1, True))
    body = agent_request(words=2000)
    s = await fitted(asked, body)
    assert DECISIONS[id(s)] == UNCHANGED and not asked.bodies


async def test_under_policy_off_ollama_is_not_asked() -> None:
    """Policy off watches and tells; it adds no request of its own to the server."""
    asked = Asked(OllamaCount(18513, True))
    await fitted(asked, agent_request(), policy="off")
    assert not asked.bodies
