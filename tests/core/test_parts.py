"""Evicted content in parts: they join back byte for byte, and each keeps to the agents' limits."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contextpaw.core import parts

REF = "cp-0123456789ab.0011223344556677"


def asking(n: int) -> str:
    return f"ask for part {n}"


@given(st.text(st.characters(codec="utf-8"), max_size=400), st.integers(1, 60), st.integers(1, 6))
def test_the_parts_join_back_and_each_keeps_to_its_bytes_and_lines(whole: str, max_bytes: int, max_lines: int) -> None:
    """A part is never cut inside a character: one wider than the part's bytes is a part of its own."""
    pieces = parts.split(whole, max_bytes, max_lines)
    assert "".join(pieces) == whole and (all(pieces) or pieces == [""])
    assert all((len(p.encode()) <= max_bytes or len(p) == 1) and p.count("\n", 0, len(p) - 1) < max_lines for p in pieces)


def test_content_that_fits_one_part_comes_whole_without_a_header() -> None:
    assert parts.paged("one line\n", REF, 1, asking) == "one line\n"


def test_each_part_names_itself_and_how_to_ask_for_the_next_and_the_last_says_so() -> None:
    text = "".join(f"line {n}\n" for n in range(2000))
    count = len(parts.split(text))
    first, last = parts.paged(text, REF, 1, asking), parts.paged(text, REF, count, asking)
    assert first.startswith(f"[ContextPaw: part 1 of {count} of {REF}; ask for part 2 for the next]\n")
    assert last.startswith(f"[ContextPaw: part {count} of {count} of {REF}; the last]\n")
    with pytest.raises(parts.NoSuchPart, match=f"comes in {count} part"):
        parts.paged(text, REF, count + 1, asking)
