"""A list is written an item at a time (the lock let go between items), and reads as `json` writes it."""

import json
import sys

from hypothesis import given
from hypothesis import strategies as st

from contextpaw.wire.base import Number, dumps, load
from support.strategies import JSON_VALUES


@given(st.lists(JSON_VALUES, max_size=6))
def test_a_list_is_written_as_json_writes_it(value: list) -> None:
    assert dumps(value) == json.dumps(value, ensure_ascii=False)
    assert dumps(value, separators=(",", ":")) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def test_a_hole_s_numbers_and_lone_surrogates_go_back_as_written() -> None:
    hole = load(b'{"m": [{"a": 1e400, "b": [1.50, -0]}, "x\\ud800y"]}')["m"]
    assert dumps(hole) == '[{"a": 1e400, "b": [1.50, -0]}, "x\ud800y"]'
    assert isinstance(hole[0]["a"], Number)


def test_reading_a_body_enters_python_between_its_messages() -> None:
    """`json`'s C scanner holds the interpreter's lock for a whole body; only a call into Python
    lets a thread that reads a big body hand the lock to the event loop. One at least per message."""
    body = json.dumps({"model": "m", "messages": [{"role": "tool", "content": "x" * 1000} for _ in range(100)]}).encode()
    entered = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal entered
        entered += event == "call"

    sys.setprofile(profile)
    try:
        load(body)
    finally:
        sys.setprofile(None)
    assert entered >= 100
