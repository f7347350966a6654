"""The served window on the model routes: what ContextPaw says beside a window field it lowered.

An agent that sizes its own history by what `/v1/models`, `/api/show` or `/props` reports compacts at
the right point only if the number is the window the server really serves. Where a route reported
more (the model file's trained length), the field carries the served window and the answer says so:
a `contextpaw` note in the body (`window`, `reported`, a sentence) and the `X-ContextPaw-Window`
header. Pure: numbers in, JSON values and text out.
"""

from __future__ import annotations

from typing import Any

WINDOW_HEADER = "X-ContextPaw-Window"


def lowered(reported: Any, window: int) -> bool:
    """Whether a window field that said `reported` must say `window` instead."""
    return isinstance(reported, int) and not isinstance(reported, bool) and reported > window


def note(window: int, reported: int | None) -> dict[str, Any]:
    """The `contextpaw` note: the served window, and what the backend's own answer said when that
    was more."""
    if reported is None or reported <= window:
        return {"window": window}
    return {
        "window": window,
        "reported": reported,
        "note": f"the server serves a window of {window} tokens; the backend reported {reported} "
        f"(the model file's trained length): ContextPaw reports the served window",
    }


def header(window: int, reported: int | None) -> str:
    """The `X-ContextPaw-Window` value."""
    if reported is None or reported <= window:
        return f"{window} tokens served"
    return f"{window} tokens served; the backend reported {reported}"
