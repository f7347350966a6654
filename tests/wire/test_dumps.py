"""A list is written an item at a time (the lock let go between items), and reads as `json` writes it."""

import json

from hypothesis import given
from hypothesis import strategies as st

from contextpaw.wire.base import Number, dumps, load

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)


@given(st.lists(JSON, max_size=6))
def test_a_list_is_written_as_json_writes_it(value: list) -> None:
    assert dumps(value) == json.dumps(value, ensure_ascii=False)


def test_a_hole_s_numbers_and_lone_surrogates_go_back_as_written() -> None:
    hole = load(b'{"m": [{"a": 1e400, "b": [1.50, -0]}, "x\\ud800y"]}')["m"]
    assert dumps(hole) == '[{"a": 1e400, "b": [1.50, -0]}, "x\ud800y"]'
    assert isinstance(hole[0]["a"], Number)
