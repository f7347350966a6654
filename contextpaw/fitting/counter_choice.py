"""Which counter counts a request: the best source the settings and the backend allow.

A tokenizer file the operator named; llama-server's own tokenizer and template (and its count of a
whole request); the tokenizer in the GGUF file Ollama names for the model; else the estimate,
calibrated by what the backend reported before. What needs the network goes through the fitter's
`Services`, so this stays testable without sockets.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from contextpaw import wire
from contextpaw.core import logs
from contextpaw.core.caches import LRU
from contextpaw.core.tokens import Counter, EstimateCounter, ShapeCounter
from contextpaw.fitting.calibration import MAX_KEYS, CalibratedCounter, Calibration, calibration_key
from contextpaw.fitting.services import AskedCount, InFlight, Services, off_loop
from contextpaw.fitting.windows import BackendWindows
from contextpaw.settings import FitSettings
from contextpaw.wire import ollama as wire_ollama

logger = logs.get(__name__)


class CounterChoice:
    """Picks and asks the counters for one request at a time."""

    def __init__(
        self,
        services: Services,
        windows: BackendWindows,
        calibration: Calibration,
        estimate: EstimateCounter,
        shape: ShapeCounter,
        settings: FitSettings,
    ) -> None:
        self.services = services
        self.windows = windows
        self.calibration = calibration
        self.estimate = estimate
        self.shape = shape
        self.settings = settings
        self._warmed = LRU(MAX_KEYS)
        """(backend, model) whose tokenizer was sent for ahead of need (bounded: the client names
        the model)."""
        self._warming = InFlight()

    def calibrated(self, backend: wire.Backend, parsed: wire.Chat | wire.Prompt, shaped: bool = False) -> Counter:
        """The estimate scaled by what the backend reported before: the byte estimate's, or where
        a miss is refused rather than cut (`shaped`) and enough was learned, the shape count's,
        which prices prose and dense tool output each near its own rate."""
        key = calibration_key(backend, parsed.params.model)
        if shaped and (factor := self.calibration.shape_factor(key)) is not None:
            return CalibratedCounter(self.shape, factor)
        return self.calibration.counter(key, self.estimate)

    async def small(self, backend: wire.Backend, parsed: wire.Chat | wire.Prompt, budget: int, big: bool) -> bool:
        """Whether the estimate puts the request at under half the `budget`: then it cannot
        overflow even if the estimate is off by two, and is not worth a call to the backend."""
        return await off_loop(big, functools.partial(rough_size, parsed, self.calibrated(backend, parsed))) <= budget // 2

    async def best(
        self, backend: wire.Backend, parsed: wire.Chat | wire.Prompt, small: bool = False, big: bool = False, shaped: bool = False
    ) -> tuple[Counter, int]:
        """The best counter for this request, and the template's fixed cost when it is known.

        Best source first: a tokenizer file the operator named; llama-server's own tokenizer and
        template; the tokenizer in the GGUF file Ollama names for the model; the calibrated estimate,
        which alone counts a `small` request (`shaped`: see `calibrated`).
        """
        model = parsed.params.model
        calibrated = self.calibrated(backend, parsed, shaped)
        if small:
            self._warm(backend, model)
            return calibrated, 0
        if self.settings.tokenizer:
            named = await self.services.tokenizer(self.settings.tokenizer)
            if named is not None:
                return named, 0
        if backend.kind == wire.Kind.LLAMACPP:
            counted = await self.services.counting.counter(
                backend.url,
                parsed.texts,
                calibrated,
                chat=isinstance(parsed, wire.Chat),
                has_system=parsed.has_system,
                big=big,
                model=model,
            )
            if counted is not None:
                return counted
        elif (gguf := await self._model_file(backend, model)) is not None:
            local = await self.services.tokenizer(gguf)
            if local is not None:
                return local, 0
        return calibrated, 0

    async def exact_for(self, backend: wire.Backend, model: str) -> bool:
        """Whether a big request for `model` is counted exactly (by a tokenizer or llama-server's
        own count), not by the calibrated estimate."""
        if self.settings.tokenizer and await self.services.tokenizer(self.settings.tokenizer) is not None:
            return True
        if backend.kind == wire.Kind.LLAMACPP:
            return True
        gguf = await self._model_file(backend, model)
        return gguf is not None and await self.services.tokenizer(gguf) is not None

    def _warm(self, backend: wire.Backend, model: str) -> None:
        """Start loading the tokenizer a bigger request of this model will count with (a GGUF
        vocabulary takes seconds to read, and the request that needs it would wait for it): once
        per model, in the background, best effort."""
        key = (backend.url, model)
        if key in self._warmed or (backend.kind == wire.Kind.LLAMACPP and not self.settings.tokenizer):
            return  # llama-server counts with its own
        self._warmed.put(key, True)
        self._warming.task(key, functools.partial(self._load, backend, model))

    async def _load(self, backend: wire.Backend, model: str) -> None:
        try:
            path = self.settings.tokenizer or await self._model_file(backend, model)
            if path:
                await self.services.tokenizer(path)
        except Exception:  # the request that needs it loads it again, and says why it cannot
            logger.exception("loading the tokenizer of %s ahead of need failed", model)

    async def _model_file(self, backend: wire.Backend, model: str) -> str | None:
        """The model's GGUF blob, when Ollama's Modelfile names one (the services say whether this
        machine can read it)."""
        show = await self.windows.show(backend, model)
        return show.model_file if show is not None else None

    async def asked(self, backend: wire.Backend, parsed: wire.Chat, big: bool) -> AskedCount | None:
        """Ollama's own count of a chat, asked on its native route (None: not Ollama, not to be
        asked, or no answer). Never under policy off: it watches, and adds no request of its own."""
        if backend.kind != wire.Kind.OLLAMA or not self.settings.ask_ollama or self.settings.policy == "off":
            return None
        body = await off_loop(big, functools.partial(wire_ollama.counting_chat, parsed))
        return await self.services.asking.count(backend.url, body, big)

    async def exact_total(self, backend: wire.Backend, parsed: wire.Chat | wire.Prompt, sent: Mapping[str, Any], big: bool) -> int | None:
        """llama-server's own count of a whole request: a chat as it renders it (template, system
        blocks and tools included), a raw prompt as `/completion` reads it; None where there is
        none (other backends, a failed call)."""
        if backend.kind != wire.Kind.LLAMACPP:
            return None
        if isinstance(parsed, wire.Prompt):
            prompt = sent.get("prompt")
            model = parsed.params.model
            return await self.services.counting.prompt_total(backend.url, prompt, big, model) if isinstance(prompt, str) else None
        path, counted = parsed.counted(sent)
        if parsed.params.model and "model" not in counted:  # a router counts with the model the request names
            counted = {**counted, "model": parsed.params.model}
        return await self.services.counting.total(backend.url, counted, path=path, big=big)


def least_kept(parsed: wire.Chat | wire.Prompt, counter: Counter) -> int:
    """What a server that cuts a prompt from the front keeps of it at the least, as `counter`
    counts it: Ollama drops whole messages after the system messages, and keeps the latest one and
    the tool definitions (the template renders them). 0 for a raw prompt: no claim."""
    if not isinstance(parsed, wire.Chat) or not parsed.conversation.messages:
        return 0
    messages = parsed.conversation.messages
    kept = [m for m in messages[:-1] if m.pinned] + [messages[-1]]
    return parsed.fixed_cost(counter) + sum(counter.message(m) for m in kept)


def biggest_droppable(parsed: wire.Chat | wire.Prompt, counter: Counter) -> int | None:
    """The biggest message a server that cuts a prompt from the front could drop, as `counter`
    counts it (None for a raw prompt: no claim). Ollama drops the oldest messages one at a time
    until the rest fits: the last one it dropped took the prompt from over the window to what it
    counted, so a count that no droppable message could have been the difference for is of the whole."""
    if not isinstance(parsed, wire.Chat) or not parsed.conversation.messages:
        return None
    return max((counter.message(m) for m in parsed.conversation.messages[:-1] if not m.pinned), default=0)


def rough_size(parsed: wire.Chat | wire.Prompt, counter: Counter) -> int:
    """What the estimate makes of a whole request: cheap (byte lengths), for deciding how to count it.
    A system prompt sent beside the messages (Anthropic's `system`, the Responses `instructions`)
    counts too: alone it can overflow the window, and the server's count must then decide."""
    if isinstance(parsed, wire.Chat):
        return parsed.tokens(counter)
    return counter.text(parsed.fixed_text) + counter.text(parsed.prompt)
