"""Evicted content given back in parts an agent passes on whole.

Every agent cuts a tool result past a limit of its own before the model sees it, and none says so
in a way the model can undo: Codex keeps the head and tail of about 10,000 tokens (its estimate,
bytes / 4), Qwen Code saves a result over 25,000 characters or 1,000 lines to a file and sends a
stub, Claude Code caps an MCP result at 25,000 tokens and a shell command's output at 30,000
characters. So content over `PART_BYTES` or `PART_LINES` is given in parts, cut after a line, each
under a header line that says which part it is, of how many, and how to ask for the next; the parts
join back to the content byte for byte. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

PART_BYTES = 20_000
"""The most UTF-8 bytes of content in one part: under Codex's 40,000-byte estimate of 10,000 tokens
and Qwen Code's 25,000 characters (a character is at least a byte), with room for the agents' own
headers."""
PART_LINES = 800
"""The most lines in one part (Qwen Code's limit is 1,000)."""
PART_HEADER = re.compile(r"\A\[ContextPaw: part (\d+) of (\d+) of (cp-[0-9a-f.]+)[^\n]*\]\n")
"""The line that heads each part of content given in parts: the part, how many, and the reference."""


class NoSuchPart(ValueError):
    """A part number outside the content's parts; the message says which there are."""


def rendered(content: Any) -> str:
    """What was evicted, as text: a text verbatim, messages as their JSON."""
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False, indent=2)


def split(text: str, max_bytes: int = PART_BYTES, max_lines: int = PART_LINES) -> list[str]:
    """``text`` in consecutive pieces that join back to it, each at most ``max_bytes`` of UTF-8 and
    ``max_lines`` lines, cut after a newline where one falls in the piece (a line longer than the
    piece is cut between characters). Linear in the text: a hole may hold megabytes."""
    data = text.encode()
    pieces: list[str] = []
    start = 0
    while start < len(data):
        end = min(start + max_bytes, len(data))
        window = data[start:end]
        breaks = window.count(b"\n", 0, len(window) - 1)
        if breaks >= max_lines:  # cut after the max_lines-th newline
            cut = -1
            for _ in range(max_lines):
                cut = window.index(b"\n", cut + 1)
            end = start + cut + 1
        elif end < len(data):
            newline = window.rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
            else:  # one long line: between characters (never inside one's UTF-8 bytes)
                while end > start and data[end] & 0xC0 == 0x80:
                    end -= 1
                while end < len(data) and (end == start or data[end] & 0xC0 == 0x80):  # a character wider than the piece: whole
                    end += 1
        pieces.append(data[start:end].decode())
        start = end
    return pieces or [text]


def paged(text: str, ref: str, part: int, asking: Callable[[int], str]) -> str:
    """Part ``part`` (from 1) of ``text`` under a header line, or the whole text where it fits in
    one; ``asking(n)`` says how to ask for part n."""
    pieces = split(text)
    if not 1 <= part <= len(pieces):
        raise NoSuchPart(f"{ref} comes in {len(pieces)} part(s): ask for part 1 to {len(pieces)}")
    if len(pieces) == 1:
        return text
    after = f"{asking(part + 1)} for the next" if part < len(pieces) else "the last"
    return f"[ContextPaw: part {part} of {len(pieces)} of {ref}; {after}]\n{pieces[part - 1]}"
