"""The one checked step every state table takes (`core.lifecycle`)."""

from __future__ import annotations

from enum import Enum

import pytest

from contextpaw.core.lifecycle import IllegalTransition, advance, staying


class Door(Enum):
    SHUT = "shut"
    OPEN = "open"
    LOCKED = "locked"


DOOR = {Door.SHUT: frozenset({Door.OPEN, Door.LOCKED}), Door.OPEN: frozenset({Door.SHUT}), Door.LOCKED: frozenset({Door.SHUT})}


def test_a_step_the_table_lists_is_taken_and_any_other_raises_naming_both_states() -> None:
    assert advance(DOOR, Door.SHUT, Door.LOCKED) is Door.LOCKED
    with pytest.raises(IllegalTransition, match="Door.OPEN.*cannot go to.*Door.LOCKED") as raised:
        advance(DOOR, Door.OPEN, Door.LOCKED)
    assert (raised.value.current, raised.value.to) == (Door.OPEN, Door.LOCKED)


def test_staying_is_a_step_only_where_the_table_lists_it() -> None:
    with pytest.raises(IllegalTransition):
        advance(DOOR, Door.OPEN, Door.OPEN)
    assert advance(staying(DOOR), Door.OPEN, Door.OPEN) is Door.OPEN
    assert all(staying(DOOR)[state] == steps | {state} for state, steps in DOOR.items())


def test_a_table_may_say_an_illegal_step_in_its_own_words() -> None:
    class IllegalDoor(IllegalTransition):
        @staticmethod
        def told(current: Enum, to: Enum) -> str:
            return f"a door {current.value} cannot be {to.value}"

    with pytest.raises(IllegalDoor, match="^a door locked cannot be open$"):
        advance(DOOR, Door.LOCKED, Door.OPEN, IllegalDoor)
