"""Cutting a text middle-out: where to cut it so that its head and tail fit a number of tokens, and
the cut itself, remembered so that the next turn cuts the same characters. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from contextpaw.core.markers import elision_text
from contextpaw.core.refs import PLACEHOLDER_REF, Refs
from contextpaw.core.tokens import Counter

SHRINK_FLOOR = 64
"""A shrunk message keeps at least this many tokens of its own text (head and tail), note aside."""

PLACEHOLDER_ID = PLACEHOLDER_REF
"""A marker reference of the real ones' length, for sizing a note before its id is known (ids are hashes)."""


@dataclass(frozen=True, slots=True)
class Cut:
    """Where a message's text was cut middle-out: kept `text[:head]` and `text[tail:]`; the note
    between them says `elided` tokens. Remembered in the plan, so the next turn cuts the same
    characters and says the same words, whatever the counter thinks of them by then."""

    target: int
    """The tokens the text was cut to."""
    head: int
    tail: int
    elided: int
    legend: bool = False
    """The note says how to read a marker back: the request's first marker does, once."""

    def apply(self, text: str, marker_id: str, url: str = "") -> str:
        """The text as cut; `marker_id` "" where the window is too small for markers to name one."""
        told = not self.legend
        if self.head == 0 and self.tail >= len(text):  # nothing of the text left but the note
            return elision_text(self.elided, text.count("\n"), marker_id, url, told).strip("\n")
        note = elision_text(self.elided, text.count("\n", self.head, self.tail), marker_id, url, told)
        return text[: self.head] + note + text[self.tail :]


def cut_ref(refs: Refs, text: str, cut: Cut) -> str:
    """The reference of a text cut at `cut`: the text it reads back is the whole text, but a cut
    made deeper is a marker of its own, so that one reference always stands for one note."""
    return refs.ref([text, cut.head, cut.tail])


def shrink_text(text: str, target: int, counter: Counter, url: str = "", *, shown: bool = True, legend: bool = False) -> Cut:
    """Where to cut `text` so that its head and tail fit in `target` tokens, note included; cuts
    fall at line ends.

    Each pass scales the kept characters by how far the last result overshot, and always by at
    least one token's worth, so it terminates; the last resort keeps only the note. The note is
    sized with a placeholder id of the real id's length (none where markers show no id: `shown`),
    and with the legend where it carries it.
    """
    placeholder = PLACEHOLDER_ID if shown else ""
    total = counter.text(text)
    chars_per_token = max(len(text) / max(total, 1), 1.0)
    keep_chars = int(len(text) * target / max(total, 1))
    while keep_chars > 0:
        head, tail = _head_tail(text, keep_chars)
        elided = max(total - counter.text(head) - counter.text(tail), 0)
        cut = Cut(target, len(head), len(text) - len(tail), elided, legend)
        size = counter.text(cut.apply(text, placeholder, url))
        if size <= target:
            return cut
        keep_chars = min(int(keep_chars * target / size), keep_chars - int((size - target) * chars_per_token) - 1)
    return Cut(target, 0, len(text), total, legend)


def _head_tail(text: str, keep_chars: int) -> tuple[str, str]:
    """Split `keep_chars` between head and tail, moving each cut to a line end if one is near."""
    half = keep_chars // 2
    head_end = half
    newline = text.rfind("\n", 0, head_end)
    if newline >= half * 0.75:
        head_end = newline + 1
    tail_start = len(text) - (keep_chars - head_end)
    newline = text.find("\n", tail_start)
    if newline != -1 and newline - tail_start <= half * 0.25:
        tail_start = newline + 1
    tail_start = max(tail_start, head_end)
    return text[:head_end], text[tail_start:]
