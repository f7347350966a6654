"""A lone surrogate (a JavaScript string cut inside an emoji, valid as ASCII JSON) in a request that
llama-server counted text by text: the counter learns its rate from it instead of failing, which
forwarded the whole request unfitted ("UnicodeEncodeError while compacting")."""

from __future__ import annotations

from contextpaw.calls.server_counts import BackendCounter
from contextpaw.core.tokens import EstimateCounter


def test_a_text_with_a_lone_surrogate_teaches_the_counter_its_rate() -> None:
    cut = "\ud800 " + "old words " * 200
    fallback = EstimateCounter()
    counter = BackendCounter({cut: 400}, fallback, per_message=4)
    assert counter.text(cut) == 400
    unseen = "\udfff " + "new words " * 100
    assert 0 < counter.text(unseen) < fallback.text(unseen)  # at the rate it learned, not the fallback's
