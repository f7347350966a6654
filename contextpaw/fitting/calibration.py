"""A counter that learns from the server: how many tokens it counts for every token we estimate.

Per backend and model, from the server's reported prompt counts against our estimate of exactly what
was sent. The learned factor is the largest ratio among recent good samples (plus a small safety
margin), so it never under-counts anything it has seen; old samples age out of the window, so one odd
sample cannot inflate it forever. It learns in both directions: an estimate that counts high scales
down too. Samples are refused when they cannot be trusted: the server may have cut the prompt (the
caller says whether it evaluated all of it), part of it came from a prefix cache the count leaves
out, or it is too small for the template's fixed cost not to dominate. `bounds` says how far the
true size can be from a calibrated count, which the truncation check and the budget use. `state()`/`restore()` give the shell what to persist
in a small JSON file, so the learning survives restarts; this module does no I/O itself.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from contextpaw.core import logs
from contextpaw.core.caches import LRU
from contextpaw.core.conversation import Message
from contextpaw.core.tokens import Counter
from contextpaw.core.truncation import ESTIMATE_BOUNDS
from contextpaw.wire import Backend

logger = logs.get(__name__)

MAX_KEYS = 256
"""(backend kind, model) pairs whose calibration is kept."""
MIN_SAMPLE_TOKENS = 200
SAFETY = 1.03
OUTLIER = 2.5
"""A ratio this many times the median of the window (or this many times below it) is refused as an outlier."""
PHYSICAL = (0.1, 4.0)
"""The ratios of reported to estimated tokens that text can have. The estimate counts a token per
3.2 bytes: a token is at least one byte (3.2 times the estimate, and the template's few), and no
tokenizer spends 32 bytes on one token of text (long runs of whitespace reach about 13). A count
outside is not a count of what was sent: a backend that reports it lies, and is not learned from
(servers have under-reported this way: ollama#16414, #2068)."""
SHAPE_PHYSICAL = (0.025, 10.0)
"""The ratios of reported tokens to the shape count that text can have: a shape count is at least a
token per `LONGEST_TOKEN` (8) bytes and at most about 1.15 a byte, 0.4 to 3.7 times the byte
estimate, so a count within `PHYSICAL` is within these of it. (A live shape sample is learned only
when the byte estimate's checks accept it; a value read back outside these is not one.)"""
EARLY_SAMPLES = 3
EARLY_RANGE = (0.5, 2.0)
"""Until this many samples are learned, the factor stays within this range: no single sample moves it far."""
KIND_SLACK = 1.1
"""How much denser than the densest sample of its kind a text may be, once a kind is known."""
KIND_SPREAD = 1.3
"""A kind whose samples' ratios spread wider than this is not one kind of text: its bound stays wide."""
KIND_SHARES = (0.04, 0.11, 0.24, 0.35, 0.5)
"""Where a share of bytes moves a request to the next level of its kind (prose has a fifth to a
sixth of its bytes spaces, well inside one level)."""
KIND_CLASSES = {"space": b" \t", "digit": b"0123456789", "mark": b"{}[]()<>'=|_-/*#"}
"""The bytes whose shares set a request's kind, with non-ASCII. (Quotes, colons and commas are
left out: the JSON around the texts is made of them.)"""
NON_ASCII = bytes(range(128, 256))
FLOOR_TEXT_TOKENS = 64
"""A text this many estimated tokens long or more says how dense the request can be (a shorter one
says little: "a b" is one-letter words, and costs nothing)."""
FLOOR_CHUNK = 1 << 20
"""Characters split at a time: a long text is split in pieces, so a worker thread never holds the
GIL for more than a few ms."""


@dataclass(frozen=True, slots=True)
class Sample:
    """What calibration learns from once a request's answer counts it: exactly what was sent, as
    the byte estimate and the shape count make it, and its content kind."""

    key: str
    estimated: int
    shaped: int
    kind: str
    least: int = 0
    """The byte estimate of what a server that cuts from the front keeps of it at the least
    (`counters.least_kept`): what tells a count of the whole from one after a cut."""
    droppable: int | None = None
    """The byte estimate of the biggest message such a server could drop (`counters.biggest_droppable`;
    None: no claim)."""


@dataclass(frozen=True, slots=True)
class Guard:
    """What bounds the count of a request on a route where a cut cannot be forbidden: its content
    kind, and the least ratio to the estimate its densest text proves (`word_floor`)."""

    kind: str
    floor: float = 0.0


def word_floor(texts: Iterable[str], estimate: Counter) -> float:
    """The least ratio of tokens to the estimate that the densest of these texts proves.

    Tokenizers split at whitespace before they merge (GPT-2's pre-tokenizer, SentencePiece's
    word boundaries), so a text has at least as many tokens as words. One-letter words reach 1.6
    times the estimate, prose about a third: where a kind's samples (of cut requests, markers in
    them) say less than this, they do not describe this request."""
    floor = 0.0
    for text in texts:
        estimated = estimate.text(text)
        if estimated >= FLOOR_TEXT_TOKENS:
            words = sum(len(text[i : i + FLOOR_CHUNK].split()) for i in range(0, len(text), FLOOR_CHUNK))
            floor = max(floor, (words - len(text) // FLOOR_CHUNK) / estimated)  # a word across a seam counted once
    return floor


def content_kind(body: bytes) -> str:
    """A coarse class of how densely a request's text tokenizes, from the shares of whitespace,
    digits, punctuation and non-ASCII in its body: prose, code, JSON, numbers and other scripts
    land apart. (The JSON around the texts is in every body alike.)

    The byte estimate is off by up to 3.3 times across kinds of text (one-letter words against
    indented code), but by little within one; so what calibration learned of a kind bounds the next
    request of that kind, and a kind it has not seen keeps the estimate's whole width."""
    if not body:
        return "empty"
    shares = {name: sum(body.count(c) for c in members) / len(body) for name, members in KIND_CLASSES.items()}
    wide = len(body) - len(body.translate(None, NON_ASCII)) + 6 * body.count(b"\\u")  # raw, or escaped
    shares["wide"] = wide / len(body)
    return " ".join(f"{name}{bisect.bisect(KIND_SHARES, share)}" for name, share in shares.items())


class CalibratedCounter(Counter):
    """The base estimate scaled by a learned factor."""

    name = "calibrated"

    def __init__(self, base: Counter, factor: float) -> None:
        self.base = base
        self.factor = factor
        self.message_overhead = math.ceil(base.message_overhead * factor)

    def text(self, text: str) -> int:
        return math.ceil(self.base.text(text) * self.factor)

    def message(self, message: Message) -> int:
        return math.ceil(self.base.message(message) * self.factor)


@dataclass(slots=True)
class Verdict:
    accepted: bool
    reason: str


class Calibration:
    """Per (backend, model) ratios of reported to estimated tokens."""

    def __init__(self, window: int = 20) -> None:
        self.window = window
        self.ratios: LRU = LRU(MAX_KEYS)
        """Key -> recent ratios; bounded, since a key holds the model name the client sent."""
        self.kinds: LRU = LRU(MAX_KEYS)
        """(key, content kind) -> recent (estimated size, ratio) of requests of that kind."""
        self.shapes: LRU = LRU(MAX_KEYS)
        """Key -> recent ratios of reported tokens to the `ShapeCounter`'s count, learned beside the
        byte estimate's from the same samples."""
        self.refused = 0
        self.dropped = 0
        """Values the last `restore` left out because no count can have them."""

    def factor(self, key: str) -> float:
        ratios = self.ratios.get(key)
        if not ratios:
            return 1.0
        factor = max(ratios) * SAFETY
        return min(max(factor, EARLY_RANGE[0]), EARLY_RANGE[1]) if len(ratios) < EARLY_SAMPLES else factor

    def counter(self, key: str, base: Counter) -> CalibratedCounter:
        return CalibratedCounter(base, self.factor(key))

    def shape_factor(self, key: str) -> float | None:
        """The learned ratio to the shape count (the largest recent one, plus the margin); None until
        `EARLY_SAMPLES` are learned, since a shape count has no physical bound to hold it in."""
        ratios = self.shapes.get(key)
        return max(ratios) * SAFETY if ratios and len(ratios) >= EARLY_SAMPLES else None

    def bounds(self, key: str) -> tuple[float, float]:
        """How far the true size can be from this key's calibrated count, as (low, high) ratios.

        The estimate's own bounds, moved by the factor: what was learned from one kind of text
        (prose) says little about the next (one-letter words are three times denser), so the
        learning sharpens the count but never narrows what it may be off by."""
        factor = self.factor(key)
        return ESTIMATE_BOUNDS[0] / factor, ESTIMATE_BOUNDS[1] / factor

    def kind_bound(self, key: str, kind: str, estimated: int, floor: float = 0.0) -> float | None:
        """How many times too low this key's calibrated count of a request of `kind`, `estimated`
        tokens by the base estimate, can be: known once enough requests of that kind and at least
        half that size were learned from and they agreed; else None. (A small request says little
        of a big one: the template's fixed cost weighs in its ratio.) Never below what the
        request's own words prove (`floor`, from `word_floor`): a kind is a coarse class, and its
        samples may be of cuts whose markers made them less dense than this request's texts."""
        learned = self.kinds.get((key, kind)) or ()
        ratios = [ratio for size, ratio in learned if 2 * size >= estimated]
        if len(ratios) < EARLY_SAMPLES or max(ratios) > KIND_SPREAD * min(ratios):
            return None
        return max(max(*ratios, floor) * KIND_SLACK / self.factor(key), 1.0)

    def kind_reach(self, key: str, kind: str) -> int:
        """The largest request (in base-estimate tokens) this kind's samples can bound: twice the
        size that enough of them reach (0: too few). A guard held to it learns a bigger sample each
        time, so the bound grows to the window in a few requests instead of never."""
        sizes = sorted((size for size, _ in self.kinds.get((key, kind)) or ()), reverse=True)
        return 2 * sizes[EARLY_SAMPLES - 1] if len(sizes) >= EARLY_SAMPLES else 0

    def observe(
        self, key: str, estimated: int, reported: int | None, *, whole: bool, kind: str | None = None, shaped: int | None = None
    ) -> Verdict:
        """Learn from one response; `estimated` is the base counter's count of what was sent, `kind`
        its `content_kind`, `shaped` the shape count of it, and `whole` says whether the server
        surely evaluated all of it. A sample the byte estimate's checks refuse teaches neither."""
        verdict = self._judge(key, estimated, reported, whole)
        if verdict.accepted and reported is not None:  # an accepted sample has a count
            ratio = reported / estimated
            self._learn(self.ratios, key, ratio)
            if kind is not None:
                self._learn(self.kinds, (key, kind), (estimated, ratio))
            if shaped:
                self._learn(self.shapes, key, reported / shaped)
        else:
            self.refused += 1
        return verdict

    def _learn(self, table: LRU, key: object, ratio: object) -> None:
        ratios = table.get(key)
        if ratios is None:
            table.put(key, ratios := deque(maxlen=self.window))
        ratios.append(ratio)

    def _judge(self, key: str, estimated: int, reported: int | None, whole: bool) -> Verdict:
        if reported is None or reported <= 0:
            return Verdict(False, "no count reported")
        if estimated < MIN_SAMPLE_TOKENS:
            return Verdict(False, "too small to learn from")
        if not whole:
            return Verdict(False, "the server may have cut the prompt")
        ratio = reported / estimated
        if not PHYSICAL[0] <= ratio <= PHYSICAL[1]:
            return Verdict(False, f"impossible count: {reported} tokens for text estimated at {estimated}")
        ratios = self.ratios.get(key)
        if ratios and len(ratios) >= 3 and not 1 / OUTLIER <= ratio / statistics.median(ratios) <= OUTLIER:
            return Verdict(False, "outlier")
        return Verdict(True, "ok")

    def to_json(self) -> dict[str, object]:
        return {
            "factors": {k: round(self.factor(k), 4) for k in list(self.ratios)},  # `factor` reorders the LRU
            "samples": {k: len(v) for k, v in self.ratios.items()},
            "shape_factors": {k: round(f, 4) for k in list(self.shapes) if (f := self.shape_factor(k)) is not None},
            "refused": self.refused,
        }

    def state(self) -> dict[str, object]:
        return {
            "ratios": {k: list(v) for k, v in self.ratios.items()},
            "kinds": [[key, kind, [list(pair) for pair in v]] for (key, kind), v in self.kinds.items()],
            "shapes": {k: list(v) for k, v in self.shapes.items()},
        }

    def restore(self, state: Any) -> bool:
        """Take back a saved state; a damaged one costs the learning, never the proxy.

        Every value read back is held to the bounds a live sample is (`PHYSICAL`; `SHAPE_PHYSICAL`
        for the shape count's ratios; sizes positive integers): an entry outside them is dropped on
        its own, with one log line that says how many went, and its key counts as a fresh one. A
        file that is not this shape at all is damaged (False), and nothing of it is taken."""
        try:
            ratios, kinds, shapes = LRU(MAX_KEYS), LRU(MAX_KEYS), LRU(MAX_KEYS)
            dropped = 0
            for table, saved, bounds in ((ratios, state["ratios"], PHYSICAL), (shapes, state.get("shapes", {}), SHAPE_PHYSICAL)):
                for k, v in saved.items():  # shapes: absent in older files
                    good = [r for r in v if _within(r, bounds)] if isinstance(v, list) else []
                    dropped += (len(v) if isinstance(v, list) else 1) - len(good)
                    if good:
                        table.put(str(k), deque(good, maxlen=self.window))
            for entry in state.get("kinds", []):  # absent in older files
                key, kind, v = entry if isinstance(entry, list) and len(entry) == 3 else (None, None, None)
                good = [(size, r) for size, r in _pairs(v) if _size(size) and _within(r, PHYSICAL)]
                dropped += (len(v) if isinstance(v, list) else 1) - len(good)
                if good and isinstance(key, str) and isinstance(kind, str):
                    kinds.put((key, kind), deque(good, maxlen=self.window))
                else:
                    dropped += len(good)
        except (ValueError, KeyError, TypeError, AttributeError):
            self.ratios, self.kinds, self.shapes = LRU(MAX_KEYS), LRU(MAX_KEYS), LRU(MAX_KEYS)
            return False
        self.ratios, self.kinds, self.shapes = ratios, kinds, shapes
        self.dropped = dropped
        if dropped:
            logger.warning("calibration state: %d saved values outside what a count can be were dropped; their models start fresh", dropped)
        return True


def _within(value: object, bounds: tuple[float, float]) -> bool:
    """Whether a value read back is a real, finite number within `bounds` (a string, a bool, NaN or
    Infinity is not)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and bounds[0] <= value <= bounds[1]


def _size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _pairs(saved: object) -> list[tuple[object, object]]:
    """The (size, ratio) pairs of a saved kind; what is not a pair is left out (and counted dropped)."""
    if not isinstance(saved, list):
        return []
    return [(p[0], p[1]) for p in saved if isinstance(p, list) and len(p) == 2]


def calibration_key(backend: Backend, model: str) -> str:
    """Calibration is learned per kind of server and model: each tokenizes and templates its own way."""
    return f"{backend.kind}/{model}"
