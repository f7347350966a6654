"""What a search reads of kept content: every string in it, whichever parser read it."""

from contextpaw.ops.evicted import encode, searchable


def test_every_string_is_read_in_order() -> None:
    assert searchable(encode([{"role": "tool", "content": "DB_HOST=db"}, {"n": 1.5, "list": ["a", "b"]}])) == "tool\nDB_HOST=db\na\nb"


def test_a_lone_surrogate_and_a_number_past_floats_are_read_too() -> None:
    assert searchable(b'[{"a": "x\\ud800y", "n": 1e400}, "z"]') == "x?y\nz"


def test_what_is_not_json_is_read_as_text() -> None:
    assert searchable(b"plain output") == "plain output"
