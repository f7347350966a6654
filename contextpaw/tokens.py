"""Token counters behind one interface.

The engine asks a counter for the cost of text, of a message (its text, images and the template's
per-message overhead) and of the tool definitions. Counters here are pure and synchronous; counts that
need the network (a backend's own tokenizer endpoint) are fetched by the shell and handed in as a
`KnownCounts` layer, so the engine never does I/O.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from typing import Any

from contextpaw.conversation import Message

MESSAGE_OVERHEAD = 5
"""Template tokens around one message (ChatML spends 4-5: role header, separators, end token)."""

IMAGE_TOKENS = 768
"""What Ollama charges per image on projector models; llama.cpp's mtmd is in the same range."""


class Counter(ABC):
    """Counts tokens the way the backend will, as closely as the source allows."""

    name: str = "abstract"
    exact: bool = False
    message_overhead: int = MESSAGE_OVERHEAD
    image_tokens: int = IMAGE_TOKENS

    @abstractmethod
    def text(self, text: str) -> int:
        """Tokens in a piece of plain text."""

    def message(self, message: Message) -> int:
        return self.message_overhead + self.text(message.text) + message.images * self.image_tokens

    def tools(self, tools: Any) -> int:
        if not tools:
            return 0
        return self.text(json.dumps(tools, ensure_ascii=False, separators=(",", ":")))


class EstimateCounter(Counter):
    """Bytes-per-token estimate: fast, and on the safe side when the ratio is conservative.

    UTF-8 bytes rather than characters, because tokenizers spend more tokens on non-Latin scripts,
    and bytes track that better than characters do.
    """

    name = "estimate"

    def __init__(self, bytes_per_token: float = 3.2) -> None:
        if not bytes_per_token > 0:
            raise ValueError("bytes_per_token must be positive")
        self.bytes_per_token = bytes_per_token

    def text(self, text: str) -> int:
        if not text:
            return 0
        return math.ceil(len(text.encode("utf-8", "surrogatepass")) / self.bytes_per_token)
