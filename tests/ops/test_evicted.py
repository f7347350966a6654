"""The bounded memories: evicted content and per-conversation plans (an `LRU`)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contextpaw import wire
from contextpaw.core.caches import LRU
from contextpaw.core.compact import Plan
from contextpaw.ops.evicted import EvictedStore, MemoryStore, encode
from support.strategies import JSON_VALUES


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def store(clock: Clock | None = None, **bounds: int) -> EvictedStore:
    limits = {"max_items": 100, "max_bytes": 1 << 20, "max_age_s": 60} | bounds
    return MemoryStore(**limits, clock=clock or Clock())


def test_content_comes_back_verbatim_as_json() -> None:
    s = store()
    content = [{"role": "tool", "content": 'ünïcode \n\t and "quotes"'}]
    s.put("cp-1", encode(content))
    assert json.loads(s.get("cp-1")) == content
    assert s.get("cp-unknown") is None


def test_the_clients_numbers_come_back_as_written_and_as_valid_json() -> None:
    """What was evicted is what the client sent: numbers Python would write otherwise (`1e400` as
    `Infinity`, which is not JSON; `1.50`, `-0.0`, `1.0e5`, 4,301 digits) come back as written."""
    numbers = ["1e400", "1.50", "-0.0", "-0", "1.0e5", "9" * 4301, "12", "0.5"]
    raw = b'{"messages":[{"role":"tool","content":"r","n":[' + ",".join(numbers).encode() + b"]}]}"
    s = store()
    s.put("cp-1", encode(wire.load(raw)["messages"]))
    kept = s.get("cp-1")
    assert kept is not None and json.loads(kept, parse_int=str, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert kept.split(b'"n":[')[1].split(b"]")[0].split(b",") == [n.encode() for n in numbers]


@given(st.lists(JSON_VALUES, max_size=6))
def test_what_is_kept_is_the_json_python_writes_byte_for_byte(content: list) -> None:
    """Whichever way a hole is written (orjson, or the slow way where a float was read as written
    or orjson refuses a lone surrogate), its bytes are Python's compact JSON of what was read."""
    sent = json.dumps({"messages": content}, ensure_ascii=False)
    read = wire.load(sent.encode("utf-8", "surrogatepass"))["messages"]
    assert encode(read) == json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


@pytest.mark.parametrize("number", ["1e-05", "2.5e-07", "-1.2676871521221707e-06", "4e-09", "1e-10", "1e+16", "0.0001"])
def test_a_float_that_orjson_spells_otherwise_is_kept_as_the_client_wrote_it(number: str) -> None:
    read = wire.load(b'{"m":[{"n":' + number.encode() + b"}]}")["m"]
    assert encode(read) == b'[{"n":' + number.encode() + b"}]"


def test_count_bound_drops_the_oldest() -> None:
    s = store(max_items=2)
    for i in range(3):
        s.put(f"cp-{i}", encode("x"))
    assert (s.get("cp-0"), len(s)) == (None, 2)
    assert s.get("cp-2") is not None


def test_byte_bound_drops_the_oldest_and_refuses_what_never_fits() -> None:
    s = store(max_bytes=20)
    s.put("cp-a", encode("a" * 10))
    s.put("cp-b", encode("b" * 10))
    assert s.get("cp-a") is None and s.get("cp-b") is not None
    s.put("cp-huge", encode("c" * 100))
    assert s.get("cp-huge") is None and s.bytes == 12


def test_age_bound_expires_and_a_repeat_refreshes() -> None:
    clock = Clock()
    s = store(clock, max_age_s=10)
    s.put("cp-old", encode("x"))
    s.put("cp-kept", encode("y"))
    clock.now = 8
    s.put("cp-kept", encode("y"))
    clock.now = 11
    assert s.get("cp-old") is None and s.get("cp-kept") is not None


def test_plan_memory_is_least_recently_used() -> None:
    plans = LRU(2)
    plans.put("a", Plan(frozenset({"1"})))
    plans.put("b", Plan())
    assert plans.get("a") is not None
    plans.put("c", Plan())
    assert plans.get("b") is None and plans.get("a") == Plan(frozenset({"1"})) and len(plans) == 2
