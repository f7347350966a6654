"""What a compaction run sends: the kept messages in order (shrunk ones as cut), each hole's marker
in its place, and what the report tells of every removal. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from contextpaw.core.conversation import Message
from contextpaw.core.holes import Holes
from contextpaw.core.markers import LEGEND_OPENING, can_fold, fold, marker_role, speaker_after, standalone
from contextpaw.core.report import Action, Removal, Report
from contextpaw.core.shrink import Cut, cut_ref
from contextpaw.core.tokens import Counter


@dataclass(slots=True)
class Rendered:
    messages: list[Message]
    removals: list[Removal]
    evicted: dict[str, Any]
    """Marker id -> what it stands for (a hole's messages, a shrunk message's text), for retrieval."""
    tokens: int
    notes: dict[str, str]
    """Marker id -> the marker's text as sent, for the next turn's plan to send again."""

    def told(self, report: Report) -> Report:
        """`report` with what was sent and what went."""
        actions = {r.action for r in self.removals}
        return replace(
            report,
            compacted=True,
            final_tokens=self.tokens,
            removals=tuple(self.removals),
            markers=tuple(dict.fromkeys(r.marker_id for r in self.removals)),
            evicted=self.evicted,
            strategy="+".join(a for a, k in (("evict", "dropped"), ("summarize", "summarized"), ("shrink", "shrunk")) if k in actions),
            summarized="summarized" in actions,
        )


def render(
    msgs: Sequence[Message],
    cost: Sequence[int],
    shrunk: Mapping[int, tuple[Message, int, Cut]],
    holes: Holes,
    *,
    written: Mapping[str, str],
    fixed: int,
    counter: Counter,
) -> Rendered:
    """The messages as cut: `shrunk` maps an index to (its message as cut, its tokens, the cut);
    `written` holds last turn's marker texts, sent again byte for byte where a hole comes out the same."""
    starts = {h[0]: h for h in holes}
    told = _told(holes, written, shrunk)
    """The request says the legend already (a marker sent again as it was, a message cut)."""
    out: list[Message] = []
    removals: list[Removal] = []
    evicted: dict[str, Any] = {}
    notes: dict[str, str] = {}
    final = fixed
    pending_fold: str | None = None
    i = 0
    while i < len(msgs):
        if i in starts:
            first, last = starts[i]
            marker_id = holes.marker_id(starts[i])
            evicted[marker_id] = [msgs[j].raw for j in range(first, last + 1)]
            digest = holes.digests.get(marker_id)
            action: Action = "summarized" if digest else "dropped"
            removals += [Removal(j, msgs[j].role, cost[j], action, marker_id) for j in range(first, last + 1)]
            if digest or marker_id not in written:
                note, told = holes.note(starts[i], marker_id, digest, told), True
            else:
                note = written[marker_id]  # written once: the prefix stays the same
            if not digest:
                notes[marker_id] = note
            if pending_fold is not None:  # walled holes side by side: both markers, in order
                note, pending_fold = f"{pending_fold}\n\n{note}", None
            after = last + 1
            role = marker_role(out[-1].speaker if out else None, speaker_after(msgs[after]) if after < len(msgs) else None)
            if role is None and after < len(msgs) and can_fold(msgs[after]):
                pending_fold = note
            elif role is None and after == len(msgs) and can_fold(out[-1]):
                out[-1] = fold(out[-1], note)
                final += holes.folded_cost(note)
            else:  # a role of its own, or next to items that hold no text (a Responses call)
                out.append(Message.from_wire(standalone(role or "user", note)))
                final += counter.message(out[-1])
            i = after
            continue
        if i in shrunk:
            message, size, cut = shrunk[i]
            marker_id = cut_ref(holes.refs, msgs[i].content_text, cut)
            evicted[marker_id] = msgs[i].content_text
            removals.append(Removal(i, message.role, cut.elided, "shrunk", marker_id))
        else:
            message, size = msgs[i], cost[i]
        if pending_fold is not None:
            message, size = fold(message, pending_fold), size + holes.folded_cost(pending_fold)
            pending_fold = None
        out.append(message)
        final += size
        i += 1
    return Rendered(out, removals, evicted, final, notes)


def _told(holes: Holes, written: Mapping[str, str], shrunk: Mapping[int, tuple[Message, int, Cut]]) -> bool:
    """Whether a marker sent again as it was, or a message cut with the legend, says the legend."""
    again = (written.get(holes.marker_id(h), "") for h in holes if not holes.digests.get(holes.marker_id(h)))
    return any(LEGEND_OPENING in note for note in again) or any(cut.legend for _, _, cut in shrunk.values())
