"""A backend's count is evidence, not truth: calibration checks it against what the bytes allow.

The probe found that 20 answers claiming `input_tokens: 10` for 40 KB prompts took llama-server's
factor to 0.011, after which a 12 KB chat went uncompacted into a 1,024-token window; on Ollama one
sample gave 0.0085. Here backends that lie low and lie high teach the calibration nothing, and no
single sample moves the factor far.
"""

from __future__ import annotations

import json

import pytest

from contextpaw import wire
from contextpaw.fitting.calibration import EARLY_RANGE, PHYSICAL, Calibration
from contextpaw.fitting.fitter import Fitter
from contextpaw.fitting.flow import FlowState
from contextpaw.ops.evicted import MemoryStore
from contextpaw.ops.metrics import Stats
from contextpaw.settings import FitSettings

KEY = "ollama/m"


@pytest.mark.parametrize("reported", [10, 40, 200_000])
def test_a_count_the_bytes_do_not_allow_is_not_learned(reported: int) -> None:
    cal = Calibration()
    for _ in range(20):
        verdict = cal.observe(KEY, 12_500, reported, whole=True)  # 40 KB of text, estimated at 3.2 bytes a token
        assert not verdict.accepted and verdict.reason.startswith("impossible count")
    assert cal.factor(KEY) == 1.0


def test_no_single_sample_moves_the_factor_far() -> None:
    low, high = Calibration(), Calibration()
    low.observe(KEY, 10_000, int(10_000 * PHYSICAL[0]) + 1, whole=True)
    high.observe(KEY, 10_000, int(10_000 * PHYSICAL[1]), whole=True)
    assert low.factor(KEY) == EARLY_RANGE[0] and high.factor(KEY) == EARLY_RANGE[1]


def test_a_sample_far_below_what_was_learned_is_an_outlier() -> None:
    cal = Calibration()
    for _ in range(5):
        assert cal.observe(KEY, 10_000, 9_000, whole=True).accepted
    assert cal.observe(KEY, 10_000, 2_000, whole=True).reason == "outlier"
    assert cal.factor(KEY) == pytest.approx(0.9 * 1.03)


class Quiet:
    async def fetch(self, method: str, url: str, body: object) -> None:
        return None

    async def tokenizer(self, path: str) -> None:
        return None


async def test_a_backend_that_lies_low_cannot_talk_the_fitter_into_an_overflow() -> None:
    """After twenty lying answers a 12 KB chat into a 1,024-token window is still compacted."""
    store = MemoryStore(max_items=10, max_bytes=1 << 20, max_age_s=60)
    fitter = Fitter(Quiet(), Stats(store), store, FitSettings(default_ctx=1024, output_reserve=128, discover_window=False))  # type: ignore[arg-type]
    route = wire.route_for(wire.Kind.OLLAMA, "POST", "/v1/chat/completions")
    backend = wire.Backend.parse(wire.Kind.OLLAMA, "http://127.0.0.1:1")

    def chat(size: int) -> FlowState:
        messages = [{"role": "user", "content": "task"}] + [
            {"role": "assistant" if i % 2 else "user", "content": "words of prose " * (size // 15 // 8)} for i in range(8)
        ]
        return FlowState(backend, route, json.dumps({"model": "m", "messages": messages}).encode(), "/v1/chat/completions")

    for _ in range(20):
        lied = chat(40_000)
        await fitter.fit(lied)
        fitter.answers.final_report(lied, {"choices": [{"finish_reason": "stop"}], "usage": {"prompt_tokens": 10}})
    fitted = chat(12_000)
    await fitter.fit(fitted)
    assert fitted.report is not None and fitted.report.compacted and fitter.calibration.factor("ollama/m") >= 0.5
