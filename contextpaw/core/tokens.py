"""Token counters behind one interface.

The engine asks a counter for the cost of text, of a message (its text, images and the template's
per-message overhead) and of the tool definitions. Counters here are pure and synchronous; counts that
need the network (a backend's own tokenizer endpoint) are fetched by the shell beforehand and handed
in as a `counting.BackendCounter`, so the engine never does I/O.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from contextpaw.core.conversation import Message

EXACT_COUNTERS = frozenset({"backend", "tokenizer"})
"""Counter names whose counts of a text are the model's own."""

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


class ShapeCounter(Counter):
    """An estimate from a text's shape: its words, digits, punctuation, non-ASCII bytes and breaks.

    Bytes alone are off by a factor of five across kinds of text (digits cost a token each, an
    English word one or two whatever its length), so one learned ratio to the byte estimate prices
    prose by what dense tool output taught it. Counted by shape, prose, code, JSON, logs and numbers
    land within about 1.3 of each other on a byte-level BPE tokenizer (SmolLM2's, where the weights
    were fitted), and calibration learns the level. A letter run of any length is one word, so a
    text is never priced under a token per `LONGEST_TOKEN` bytes; past that it has no physical
    bound, and the verdict's bounds stay the byte estimate's.
    """

    name = "shape"

    def text(self, text: str) -> int:
        if not text:
            return 0
        raw = text.encode("utf-8", "surrogatepass")
        digits = len(raw) - len(raw.translate(None, _DIGITS))
        marks = len(raw) - len(raw.translate(None, _MARKS))
        wide = len(raw) - len(raw.translate(None, _WIDE))
        words = len(raw.translate(_LETTERS).split())
        spaced = raw.translate(_SPACES)
        breaks = raw.count(b"\n") + spaced.count(b"x  ") + spaced.startswith(b"  ")  # runs of two spaces or more
        shaped = WORD_TOKENS * words + DIGIT_TOKENS * digits + MARK_TOKENS * marks + WIDE_TOKENS * wide + BREAK_TOKENS * breaks
        return math.ceil(max(shaped, len(raw) / LONGEST_TOKEN))


WORD_TOKENS, DIGIT_TOKENS, MARK_TOKENS, WIDE_TOKENS, BREAK_TOKENS = 1.1, 1.15, 0.8, 0.5, 1.0
"""Tokens per word (a run of Latin letters), digit, punctuation mark, non-ASCII byte and line break
or run of spaces: a least-squares fit to SmolLM2's tokenizer over code, prose, JSON and agents' texts."""
LONGEST_TOKEN = 8
"""Bytes of text one token holds at most, but for runs of whitespace (which a shape prices high)."""
_DIGITS = b"0123456789"
_MARKS = b"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
_WIDE = bytes(range(128, 256))
_LETTERS = bytes(c if chr(c).isascii() and chr(c).isalpha() else 32 for c in range(256))
"""Latin letters kept, all else a space: its `split()` is the words, in C."""
_SPACES = bytes(32 if c in b" \t" else 120 for c in range(256))
"""Spaces and tabs as spaces, all else an x: each run of two spaces or more begins an `x  `."""


CACHED_FROM = 32
"""Texts of at least this many characters are counted once: a message, and the markers' notes, which
the engine prices again for every hole it weighs (44,000 times in a 200-turn chat)."""
CACHED_CHARS = 32 << 20
"""The most characters of text whose counts are kept, about a long session's history several times
over; past it the cache starts afresh."""


class TokenizerCounter(Counter):
    """Exact content counts from the model's own tokenizer (a `tokenizers.Tokenizer`).

    Content is exact; the template's per-message overhead is whatever the caller measured for this
    model (from the backend's rendered template) or the default.
    """

    name = "tokenizer"
    exact = True

    def __init__(self, tokenizer: Any, message_overhead: int = MESSAGE_OVERHEAD) -> None:
        self.tokenizer = tokenizer
        self.message_overhead = message_overhead
        self._known: dict[str, int] = {}
        """Each long text's count, by the text itself (exact: a hit compares the whole text). A
        conversation is sent whole every turn: at turn 200 of a growing chat, tokenizing every
        message again took 92% of the fit's time and made a turn cost 20 times turn 10's."""
        self._held = 0

    @classmethod
    def from_file(cls, path: str, **kw: Any) -> TokenizerCounter:
        """Load a `tokenizer.json` (Hugging Face format) or build one from a `.gguf` model file."""
        if str(path).endswith(".gguf"):
            return cls(tokenizer_from_gguf(path), **kw)
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)), **kw)

    def text(self, text: str) -> int:
        if not text:
            return 0
        if len(text) < CACHED_FROM:
            return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        known = self._known.get(text)
        if known is not None:
            return known
        counted = len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if self._held + len(text) > CACHED_CHARS:  # dropped whole: one step, safe while another thread reads
            self._known, self._held = {}, 0
        self._known[text] = counted
        self._held += len(text)
        return counted


_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LINES_AND_SPACES = r"\s*[\r\n]+|\s+(?!\S)|\s+"


@dataclass(frozen=True)
class PreTokenizer:
    """How a byte-level BPE vocabulary splits text before its merges, as llama.cpp's
    `llm_tokenizer_bpe` does for a `tokenizer.ggml.pre` name: each pattern splits the pieces the
    last one left (what no pattern matches stays a piece of its own), and `ignore_merges` takes a
    piece that is a whole token in the vocabulary as it is."""

    patterns: tuple[str, ...]
    ignore_merges: bool = False


_GPT2 = PreTokenizer((_GPT2_SPLIT,))
_DIGITS_FIRST = PreTokenizer((r"\p{N}", _GPT2_SPLIT))
_LLAMA3 = PreTokenizer(
    (rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|{_LINES_AND_SPACES}",),
    ignore_merges=True,
)
_QWEN2 = PreTokenizer((rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|{_LINES_AND_SPACES}",))
_QWEN35 = PreTokenizer(
    (rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+|\p{{N}}| ?[^\s\p{{L}}\p{{M}}\p{{N}}]+[\r\n]*|{_LINES_AND_SPACES}",)
)
_DEEPSEEK_CODER = PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}"))
_FALCON = PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, "[0-9][0-9][0-9]"))

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling"), _GPT2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), _DIGITS_FIRST),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _QWEN2),
    "qwen35": _QWEN35,
    "deepseek-coder": _DEEPSEEK_CODER,
    "falcon": _FALCON,
}
"""The `tokenizer.ggml.pre` names rebuilt here, by llama.cpp's grouping of them (llama-vocab.cpp at
the pinned llama.cpp). Each group is checked against llama.cpp's own test vectors for one of its
vocabularies (`tests/core/test_gguf_vocabularies.py`); a name not listed falls back to calibration
rather than count with a splitting that is not the model's."""


@dataclass(frozen=True)
class Vocabulary:
    """What a GGUF file says of its tokenizer (`tokenizer.ggml.*`)."""

    model: str | None
    pre: str
    tokens: list[str]
    merges: list[str]
    types: list[int]
    scores: list[float]
    unknown: int | None = None
    add_space_prefix: bool = True


def read_vocabulary(path: str) -> Vocabulary:
    """The tokenizer metadata of a GGUF file (seconds for a big vocabulary: `gguf` reads every field)."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields

    def value(key: str, default: Any = None) -> Any:
        field = fields.get(f"tokenizer.ggml.{key}")
        return default if field is None else field.contents()

    return Vocabulary(
        value("model"),
        value("pre") or "default",
        value("tokens", []),
        value("merges", []),
        value("token_type", []),
        value("scores", []),
        value("unknown_token_id"),
        bool(value("add_space_prefix", True)),
    )


def tokenizer_from_gguf(path: str) -> Any:
    """Build a `tokenizers.Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata (no hub download)."""
    return tokenizer_of(read_vocabulary(path))


def tokenizer_of(vocabulary: Vocabulary) -> Any:
    """A `tokenizers.Tokenizer` that splits text as llama.cpp does for this vocabulary: a byte-level
    BPE one (`model == "gpt2"`) with a pre-tokenizer in `PRE_TOKENIZERS` (Qwen 2 and 3, Llama 3,
    DeepSeek Coder, StarCoder, SmolLM, GPT-2 and their kin), or a SentencePiece one (`"llama"`:
    Llama 2, Mistral 7B, Phi-3 and their kin). Other vocabularies raise `ValueError`, and the caller
    falls back to calibration."""
    from tokenizers import AddedToken

    build = _BUILDERS.get(vocabulary.model or "")
    tokenizer = build(vocabulary) if build is not None else None
    if tokenizer is None:
        raise ValueError(f"cannot rebuild a {vocabulary.model}/{vocabulary.pre} tokenizer from GGUF; use a tokenizer.json")
    tokens, types = vocabulary.tokens, vocabulary.types
    # control tokens, and user-defined ones (MPT's runs of spaces, Qwen's <tool_call>), which llama.cpp
    # takes whole wherever they stand in a text
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == CONTROL])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == USER_DEFINED])
    return tokenizer


def _byte_level(vocabulary: Vocabulary) -> Any:
    """Byte-level BPE: the pre-tokenizer's patterns split the text, its bytes map to printable
    characters, and the vocabulary's merges join them."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    split = PRE_TOKENIZERS.get(vocabulary.pre)
    if split is None:
        return None
    merges = [(left, right) for left, right in (m.split(" ", 1) for m in vocabulary.merges)]
    ids = {t: i for i, t in enumerate(vocabulary.tokens)}
    tokenizer = Tokenizer(models.BPE(ids, merges, fuse_unk=False, ignore_merges=split.ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in split.patterns]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(vocabulary: Vocabulary) -> Any:
    """SentencePiece BPE as llama.cpp runs it: spaces become "▁" (and one leads the text unless
    `add_space_prefix` is off), adjacent pieces join while the joined piece is in the vocabulary,
    the highest scored first, and a character outside it falls back to its UTF-8 bytes (`<0xNN>`).
    A BPE whose merges rank each split of a piece by that piece's score does the same."""
    from tokenizers import Tokenizer, models, normalizers

    tokens, scores = vocabulary.tokens, vocabulary.scores
    ids = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for piece, i in ids.items():
        splits = [(piece[:k], piece[k:], scores[i]) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
        merges += sorted(splits, key=lambda m: (ids[m[0]], ids[m[1]]))
    merges.sort(key=lambda m: m[2], reverse=True)  # stable: a piece's splits stay in the order above
    unknown = tokens[vocabulary.unknown] if vocabulary.unknown is not None else None
    model = models.BPE(ids, [(left, right) for left, right, _ in merges], unk_token=unknown, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    spaces = [normalizers.Replace(" ", "\u2581")]
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), *spaces] if vocabulary.add_space_prefix else spaces)
    return tokenizer


_BUILDERS: dict[str, Callable[[Vocabulary], Any]] = {"gpt2": _byte_level, "llama": _sentencepiece}
"""`tokenizer.ggml.model` -> how its tokenizer is rebuilt (None: not for this pre-tokenizer)."""

CONTROL, USER_DEFINED = 3, 4
"""GGUF's `tokenizer.ggml.token_type` values for the tokens that are matched before the merges."""
