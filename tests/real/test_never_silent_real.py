"""The never-silent invariant on the Ollama simulator over the real llama-server and SmolLM2: the
simulator cuts as Ollama does, with the model's own tokenizer, and records each cut; ContextPaw
counts exactly with the GGUF file the simulator's /api/show names."""

from __future__ import annotations

import pytest

from support import truncation_matrix as matrix

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def outcomes(ollama_sim: str, sim_model: str, tmp_path_factory: pytest.TempPathFactory) -> list[matrix.Outcome]:
    """Every route under compact and off, warm; and cold /v1 chat (the window it must learn)."""
    cases = [c for c in matrix.cases(policies=("compact", "off"), shapes=("dense",), sizes=(2500,), streams=(False,))
             if not c.cold or c.route == "/v1/chat/completions"]  # fmt: skip
    return matrix.measure(ollama_sim, sim_model, tmp_path_factory.mktemp("never-silent-real"), cases, [])


def test_on_the_real_model_no_cut_is_missed_and_no_whole_evaluation_is_flagged(outcomes: list[matrix.Outcome]) -> None:
    assert [o.case for o in outcomes if o.missed] == []
    assert [o.case for o in outcomes if o.false_alarm] == []
    assert any(o.cut for o in outcomes if o.case.policy == "off"), "policy off lets the simulator cut"


def test_on_the_real_model_compact_prevents_every_cut_with_exact_counts(outcomes: list[matrix.Outcome]) -> None:
    compact = [o for o in outcomes if o.case.policy == "compact"]
    assert [o.case for o in compact if o.cut or o.warned or o.status != 200] == []


def test_with_exact_counts_policy_off_is_never_left_in_doubt(outcomes: list[matrix.Outcome]) -> None:
    off = [o for o in outcomes if o.case.policy == "off"]
    assert all(o.flagged == o.cut and not o.warned for o in off)
