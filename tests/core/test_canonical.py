"""What is hashed is serialized one way: the same bytes for the same content, and different bytes
for content that differs, whatever orjson refuses."""

from contextpaw.core.canonical import canonical
from contextpaw.core.conversation import Conversation
from contextpaw.wire.base import Number


def test_keys_are_sorted_so_the_same_content_gives_the_same_bytes() -> None:
    assert canonical({"b": 1, "a": [1, {"d": 2, "c": 3}]}) == canonical({"a": [1, {"c": 3, "d": 2}], "b": 1})


def test_content_orjson_refuses_is_serialized_all_the_same() -> None:
    # a lone surrogate (a JavaScript string cut inside an emoji) and an integer past 64 bits
    surrogate, huge = {"content": "cut \ud83d"}, {"n": 10**30}
    assert canonical(surrogate) == canonical(dict(surrogate))
    assert canonical(surrogate) != canonical({"content": "cut "})
    assert canonical(huge) != canonical({"n": 10**30 + 1})


def test_numbers_kept_as_written_stay_apart() -> None:
    """1e400 and 1e401 are both infinity to Python: their literals keep their ids apart."""
    assert canonical({"n": Number("1e400")}) != canonical({"n": Number("1e401")})
    assert canonical({"n": Number("1.50")}) != canonical({"n": 1.5})


def test_a_conversation_s_unit_digests_are_the_same_on_every_read() -> None:
    messages = [{"role": "user", "content": "read a.py"}, {"role": "tool", "content": "x = 1\n" * 50, "extra": {"z": 1, "a": 2}}]
    again = [dict(m) for m in messages]
    assert [u.key for u in Conversation.from_wire(messages).units()] == [u.key for u in Conversation.from_wire(again).units()]
