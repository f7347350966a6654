"""Marker references: keyed by the proxy's secret, carrying the capability to read them back, the
same turn after turn; and conversation keys keyed the same way."""

from __future__ import annotations

from contextpaw import wire
from contextpaw.core import refs
from contextpaw.core.compact import compact_chat
from contextpaw.core.conversation import Conversation
from contextpaw.core.markers import hole_text
from contextpaw.core.refs import PLACEHOLDER_REF, Refs
from contextpaw.core.tokens import EstimateCounter

ENV = [{"role": "tool", "content": "DB_PASSWORD=hunter2-4711"}]


def test_the_same_content_under_two_secrets_gets_unrelated_ids() -> None:
    a, b = Refs(b"a" * 32).ref(ENV), Refs(b"b" * 32).ref(ENV)
    assert refs.store_id(a) != refs.store_id(b) and a != b
    assert Refs(b"a" * 32).ref(ENV) == a  # deterministic: a marker once sent is sent again the same
    assert len(a) == len(PLACEHOLDER_REF) and refs.split(a) is not None


def test_guessing_the_pin_from_marker_ids_needs_the_secret() -> None:
    """The offline attack of the issue: every PIN hashed, compared with the ids a transcript shows.
    Without the secret no guess lands on the real id (the unkeyed 48-bit hash gave it away)."""
    secret = b"s" * 32
    seen = refs.store_id(Refs(secret).ref([{"role": "tool", "content": "DB_PASSWORD=hunter2-4711"}]))
    guesses = {refs.store_id(Refs(b"").ref([{"role": "tool", "content": f"DB_PASSWORD=hunter2-{pin:04d}"}])) for pin in range(10_000)}
    assert seen not in guesses


def test_a_reference_reads_only_with_its_own_capability() -> None:
    key = b"k" * 32
    ref = Refs(key).ref(ENV)
    marker_id = refs.store_id(ref)
    assert refs.readable(key, ref) == marker_id
    assert refs.readable(b"x" * 32, ref) is None  # another proxy's capability
    assert refs.readable(key, marker_id) is None  # the bare id proves nothing
    assert refs.readable(key, marker_id + ".0000000000000000") is None
    assert refs.split("../etc/passwd") is None and refs.split(ref + "x") is None


def test_the_marker_tells_a_model_with_a_shell_the_command_that_reads_it_back() -> None:
    ref = Refs(b"k" * 32, "http://127.0.0.1:11435").ref(ENV)
    note = hole_text({"tool result": 1}, 120, ref, url="http://127.0.0.1:11435", told=False)
    assert "curl -s 'http://127.0.0.1:11435/contextpaw/evicted/<ref>?part=1'" in note and f"ref {ref}" in note
    assert "curl" not in hole_text({"tool result": 1}, 120, ref)  # no address known: the id alone


def test_markers_are_keyed_and_come_out_the_same_next_turn() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read the logs."}]
    for i in range(10):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": f"part {i} " + "log line " * 200})
    conversation = Conversation.from_wire(messages)
    keyed = Refs(b"k" * 32, "http://localhost:8080")
    first = compact_chat(conversation, 2000, EstimateCounter(), refs=keyed)
    again = compact_chat(conversation, 2000, EstimateCounter(), refs=keyed, previous=first.plan)
    other = compact_chat(conversation, 2000, EstimateCounter(), refs=Refs(b"o" * 32, "http://localhost:8080"))
    assert first.report.markers and first.report.markers == again.report.markers
    assert all(refs.readable(b"k" * 32, ref) for ref in first.report.markers)
    assert set(first.report.markers).isdisjoint(other.report.markers)
    assert first.messages == again.messages and first.report.final_tokens <= 2000


def test_a_conversation_key_belongs_to_the_proxy_that_keyed_it() -> None:
    """Plans are found by this key: whoever sends the same opening to another proxy, or without
    the secret, cannot name this conversation."""
    body = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}]}
    route = wire.route_for(wire.Kind.OLLAMA, "POST", "/api/chat")
    assert route is not None
    parsed = route.read(wire.dumps(body).encode())
    mine, again, theirs = (wire.keyed(parsed, s) for s in (b"k" * 32, b"k" * 32, b"t" * 32))
    assert isinstance(mine, wire.Chat) and isinstance(theirs, wire.Chat) and isinstance(again, wire.Chat)
    assert mine.key == again.key and mine.key not in (theirs.key, parsed.key)


def test_content_over_the_archives_bound_gets_a_marker_that_promises_no_reading_back() -> None:
    """A hole bigger than `contextpaw_evicted_mb` was never stored, yet its marker named a reference
    and said how to read it back. Now its marker says it was too big to keep, the report says why,
    and a hole within the bound keeps its reference."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read the logs."},
                {"role": "assistant", "content": "reading"}, {"role": "user", "content": "huge " + "log line " * 6000},
                {"role": "assistant", "content": "next"}, {"role": "user", "content": "small " + "log line " * 300},
                {"role": "assistant", "content": "done"}, {"role": "user", "content": "What stood out?"}]  # fmt: skip
    bounded = Refs(b"k" * 32, "http://localhost:8080", most_bytes=5_000)
    result = compact_chat(Conversation.from_wire(messages), 6000, EstimateCounter(), refs=bounded, keep_recent=1)
    sent = wire.dumps(result.messages)
    unkept = [r for r in result.report.markers if not refs.kept(r)]
    assert unkept and all(f"ref {r}" not in sent for r in unkept)
    assert "too big to keep" in sent
    assert any("over the archive's bound of 5,000 bytes" in note for note in result.report.notes), result.report.notes
    unbounded = compact_chat(Conversation.from_wire(messages), 6000, EstimateCounter(), refs=Refs(b"k" * 32, "http://localhost:8080"),
                             keep_recent=1)  # fmt: skip
    assert all(refs.kept(r) for r in unbounded.report.markers) and "too big" not in wire.dumps(unbounded.messages)
