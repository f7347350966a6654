"""One checked step for every state table: a flow's phases (`fitting.flow`), a GPU switch's phases
(`gpu.placement`) and llama-server's states (`gpu.supervisor`).

A table maps each state to the states it may go to next, in the manner of h11's `_state.py`: every
step is in the table, and any other raises. Staying where it is is a step too: a table that allows
it lists it (`staying` adds it for every state). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum


class IllegalTransition(RuntimeError):
    """A step no table allows: a bug in the code that took it, never the caller's doing."""

    def __init__(self, current: Enum, to: Enum) -> None:
        super().__init__(self.told(current, to))
        self.current, self.to = current, to

    @staticmethod
    def told(current: Enum, to: Enum) -> str:
        return f"{current!r} cannot go to {to!r}"


def advance[State: Enum](
    table: Mapping[State, frozenset[State]], current: State, to: State, illegal: type[IllegalTransition] = IllegalTransition
) -> State:
    """`to`, when `table` lists it among the steps from `current`; else `illegal`."""
    if to not in table[current]:
        raise illegal(current, to)
    return to


def staying[State: Enum](table: Mapping[State, frozenset[State]]) -> dict[State, frozenset[State]]:
    """`table` with each state also allowed to stay where it is."""
    return {state: steps | {state} for state, steps in table.items()}
