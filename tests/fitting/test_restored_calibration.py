"""A calibration read back at start is held to the bounds a live sample is: a poisoned file cannot
make a model's count zero or infinite, and each bad value is dropped on its own with one log line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from contextpaw.core.tokens import EstimateCounter
from contextpaw.fitting.calibration import EARLY_SAMPLES, Calibration
from contextpaw.fitting.flow import Forward
from contextpaw.ops.kept import KeptCalibration
from support.fitters import chat, fitter, state

POISONS = {"tiny": "1e-9", "infinite": "Infinity", "nan": "NaN", "negative": "-1.5", "string": '"2.0"', "huge": "1e300", "bool": "true"}
"""Values a poisoned file can hold (json reads Infinity and NaN as floats), each in a ratio list long
enough that no early clamp hides it."""


def poisoned_text(good: float = 1.3) -> str:
    """A calibration file as json reads it: one key per poison (in its ratios, its shape ratios and
    one value of each of its kind's two pairs), and one good key."""
    lists = {f"ollama/{name}": "[" + ", ".join([value] * EARLY_SAMPLES) + "]" for name, value in POISONS.items()}
    lists["ollama/good"] = json.dumps([good] * EARLY_SAMPLES)
    table = "{" + ", ".join(f'"{key}": {values}' for key, values in lists.items()) + "}"
    kinds = [f'["ollama/{name}", "prose", [[4000, {value}], [{value}, 1.2]]]' for name, value in POISONS.items()]
    kinds.append('["ollama/good", "prose", [[4000, 1.2], [4000, 1.25], [4000, 1.3]]]')
    return f'{{"ratios": {table}, "shapes": {table}, "kinds": [{", ".join(kinds)}]}}'


def test_each_poisoned_value_is_dropped_and_its_model_counts_like_a_fresh_one(caplog: pytest.LogCaptureFixture) -> None:
    restored, fresh = Calibration(), Calibration()
    with caplog.at_level(logging.WARNING):
        assert restored.restore(json.loads(poisoned_text()))
    for name in POISONS:
        key = f"ollama/{name}"
        assert restored.factor(key) == fresh.factor(key) == 1.0, name
        assert restored.shape_factor(key) is None and restored.kind_bound(key, "prose", 4000) is None, name
        assert restored.counter(key, EstimateCounter()).text("x" * 3200) == 1000, name
    assert restored.factor("ollama/good") == pytest.approx(1.3 * 1.03), "a good entry beside them is kept"
    assert restored.kind_bound("ollama/good", "prose", 4000) is not None
    bad = len(POISONS) * EARLY_SAMPLES * 2 + len(POISONS) * 2  # ratios and shapes, then one bad value in each of a kind's two pairs
    assert restored.dropped == bad
    lines = [r for r in caplog.records if r.name.endswith("calibration")]
    assert len(lines) == 1 and f"{bad} saved values" in lines[0].getMessage()


def test_a_file_of_good_values_restores_without_a_word(caplog: pytest.LogCaptureFixture) -> None:
    cal = Calibration()
    cal.observe("ollama/m", 1000, 1300, whole=True, kind="prose", shaped=1100)
    with caplog.at_level(logging.WARNING):
        again = Calibration()
        assert again.restore(json.loads(json.dumps(cal.state())))
    assert again.factor("ollama/m") == cal.factor("ollama/m") and again.dropped == 0 and not caplog.records


def test_entries_of_the_wrong_shape_are_dropped_not_the_file() -> None:
    cal = Calibration()
    state = {"ratios": {"a": "1.2", "b": {"x": 1}, "c": [1.2]}, "kinds": [["only two", []], "x", [1, "prose", [[10, 1.0]]]]}
    assert cal.restore(state)
    assert list(cal.ratios) == ["c"] and not cal.kinds and cal.dropped == 2 + 3
    assert not Calibration().restore({"ratios": "garbage"}), "a file that is not a calibration is damaged"


@pytest.mark.parametrize("poison", ["1e-9", "Infinity"])
async def test_a_long_chat_is_judged_and_compacted_whatever_the_file_said(tmp_path: Path, poison: str) -> None:
    """With 1e-9 the factor was 0 (a 12-turn chat counted as a handful of tokens went out whole
    into a cut); with Infinity every request raised OverflowError and went out unjudged."""
    path = tmp_path / "contextpaw-calibration.json"
    path.write_text(f'{{"ratios": {{"ollama/m": [{", ".join([poison] * 5)}]}}, "shapes": {{"ollama/m": [{poison}, {poison}, {poison}]}}}}')
    f, s = fitter(), state(chat())
    assert KeptCalibration(path).restore(f.calibration) is True
    decision = await f.fit(s)
    assert "X-ContextPaw-Error" not in s.headers
    assert isinstance(decision, Forward) and decision.compacted
    assert s.report is not None and s.report.original_tokens > 2000
