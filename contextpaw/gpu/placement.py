"""Which runtime the GPU holds, decided without I/O: the rule for one request, the readings it reads,
the margins it keeps, and the phases a switch goes through.

Everything that decides where a request goes or what a switch may do next lives here, in the manner
of h11's ``_state.py``: :func:`decide` turns the card's readings into an :data:`Admission`, and
:data:`PHASES` lists every step a switch may take from each phase (``core.lifecycle.advance``
refuses the rest).
:class:`~contextpaw.gpu.arbiter.Arbiter` is the I/O around them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from contextpaw.core.lifecycle import staying
from contextpaw.gpu.vram import MIB
from contextpaw.wire import Kind

RELEASE_MARGIN_BYTES = 256 * MIB
DEFAULT_RETRY_AFTER_S = 5


# --- the rule for one request -------------------------------------------------------------------


@dataclass(frozen=True)
class Admit:
    """Forward the request now."""

    word: ClassVar[str] = "admit"
    """What the status page and the log call it."""


@dataclass(frozen=True)
class Wait:
    """Decide again when something changes, or at ``until`` (a hold that runs out)."""

    reason: str = "a switch is under way"
    until: float | None = None
    word: ClassVar[str] = "wait"


@dataclass(frozen=True)
class Load:
    """Bring ``to`` up; first evict ``evict`` (None: it fits beside what runs)."""

    to: Kind
    evict: Kind | None = None
    word: ClassVar[str] = "load"


@dataclass(frozen=True)
class Decline:
    """The wanted runtime cannot be brought up, so nothing is evicted for it (the request gets a 503)."""

    reason: str
    word: ClassVar[str] = "refuse"


Admission = Admit | Wait | Load | Decline


@dataclass(frozen=True)
class Room:
    """The card as NVML reads it: free bytes (the total less what every process uses, ours and
    others'), and what each resident runtime holds."""

    free_bytes: int
    held_bytes: Mapping[Kind, int] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"free_bytes": self.free_bytes, "held_bytes": {str(k): v for k, v in self.held_bytes.items()}}


def room_left(free_bytes: int, held: Mapping[Kind, int], needs: Mapping[Kind, int | None]) -> Room | None:
    """The room left once every resident runtime (the keys of ``needs``) holds its whole need: one
    still loading will take it. None when one's need and holding are both unknown: then no room can
    be promised beside it."""
    taken = dict(held)
    for kind, need in needs.items():
        if need is None and kind not in taken:
            return None
        if need is not None and need > taken.get(kind, 0):
            free_bytes -= need - taken.get(kind, 0)
            taken[kind] = need
    return Room(max(free_bytes, 0), taken)


def decide(
    resident: Mapping[Kind, float],
    switching_to: Kind | None,
    wanted: Kind,
    cannot_start: str | None,
    *,
    now: float = 0.0,
    min_hold: float = 0.0,
    need: int | None = None,
    room: Room | None = None,
    serving: bool = True,
) -> Admission:
    """What a request for ``wanted`` does now.

    ``resident`` maps each runtime on the GPU to when it won it. While a switch is pending every
    request waits (admitting the outgoing runtime would keep its drain from ending). A runtime that
    is not resident is loaded beside the others when its estimated ``need`` fits the ``room``
    NVML reports; otherwise the other runtime must go, but not before it has held the GPU
    ``min_hold`` seconds (against thrashing), and not when even its memory would not make room
    (an over-commit). Without a reading or an estimate, the other runtime goes: nothing else is safe.

    A resident runtime that does not hold the request's model yet (``serving`` False: a router
    llama-server, which loads one model at a time on the card) loads it beside its others where it
    fits; else its others are unloaded, after their hold, unless only evicting the other runtime
    makes room.
    """
    if switching_to is not None:
        return Wait()
    if wanted in resident and not serving:
        return _swap_model(resident, wanted, now=now, min_hold=min_hold, need=need, room=room)
    if wanted in resident:
        return Admit()
    if cannot_start:
        return Decline(cannot_start)
    others = [kind for kind in resident if kind is not wanted]
    if not others:
        return Load(wanted)
    other = others[0]
    if need is not None and room is not None:
        if need <= room.free_bytes:
            return Load(wanted)
        freed = room.free_bytes + room.held_bytes.get(other, 0)
        if other in room.held_bytes and need > freed:
            return Decline(f"{wanted} needs about {need // MIB} MiB but only {freed // MIB} MiB would be free even without {other}")
    held_until = resident[other] + min_hold
    if now < held_until:
        return Wait(f"{other} keeps the GPU until its {min_hold:g}s hold is over (contextpaw_min_hold)", held_until)
    return Load(wanted, evict=other)


def _swap_model(
    resident: Mapping[Kind, float], wanted: Kind, *, now: float, min_hold: float, need: int | None, room: Room | None
) -> Admission:
    """`decide` for a model the resident runtime `wanted` must load: beside its others, or in their place."""
    if need is not None and room is not None:
        if need <= room.free_bytes:
            return Load(wanted)
        others = [kind for kind in resident if kind is not wanted]
        if others and need > room.free_bytes + room.held_bytes.get(wanted, 0):
            return decide(
                {k: v for k, v in resident.items() if k is not wanted}, None, wanted, None, now=now, min_hold=min_hold, need=need, room=room
            )
    held_until = resident[wanted] + min_hold
    if now < held_until:
        return Wait(f"{wanted}'s models keep the GPU until their {min_hold:g}s hold is over (contextpaw_min_hold)", held_until)
    return Load(wanted, evict=wanted)


def blocking(in_flight: Mapping[Kind, int], evicted: Kind | None) -> int:
    """Requests that must finish before ``evicted`` goes: evicting under them would cut their
    responses off."""
    return in_flight[evicted] if evicted is not None else 0


@dataclass(frozen=True)
class Release:
    """What an eviction should give back: total used memory before it, and what the evicted runtime
    held (Ollama's ``size_vram``, or the server process's share)."""

    before_bytes: int
    held_bytes: int

    @property
    def ceiling_bytes(self) -> int:
        """Used memory at which the release counts as done; the margin absorbs the driver's own
        bookkeeping and other programs' drift."""
        margin = max(RELEASE_MARGIN_BYTES, self.held_bytes // 20)
        return self.before_bytes - self.held_bytes + margin

    def done(self, used_bytes: int) -> bool:
        return used_bytes <= self.ceiling_bytes


def retry_after(mean_switch_seconds: float | None) -> int:
    """Seconds a caller turned away during a switch should wait: about one switch."""
    if mean_switch_seconds is None:
        return DEFAULT_RETRY_AFTER_S
    return max(1, math.ceil(mean_switch_seconds))


# --- the phases of a switch ---------------------------------------------------------------------


class SwitchFailed(Exception):
    """A switch step did not succeed; the message is what the operator needs to fix it."""


class SwitchCancelled(Exception):
    """Every request that waited for the switch gave up (a 503, or the client went away)."""


class Phase(StrEnum):
    """What the arbiter is doing; the value is what ``/contextpaw/runtime`` shows as ``state``."""

    IDLE = "idle"
    """No switch, and no runtime won the GPU through one."""
    READY = "ready"
    """No switch; the last one left a runtime resident."""
    DRAINING = "draining"
    UNLOADING_OLLAMA = "unloading ollama"
    RELEASING_OLLAMA = "waiting for Ollama to release VRAM"
    STOPPING_SERVER = "stopping llama-server"
    RELEASING_SERVER = "waiting for llama-server to release VRAM"
    STARTING_SERVER = "starting llama-server"
    UNLOADING_MODELS = "unloading llama-server's models"
    RELEASING_MODELS = "waiting for llama-server's models to release VRAM"
    LOADING_MODEL = "loading a model in llama-server"


_SETTLED = frozenset({Phase.IDLE, Phase.READY})
"""Where every switch ends: done, failed or cancelled."""

PHASES: Mapping[Phase, frozenset[Phase]] = staying(
    {
        Phase.IDLE: frozenset({Phase.DRAINING, Phase.READY}),  # READY: a switch cancelled before its first step
        Phase.READY: frozenset({Phase.DRAINING, Phase.IDLE}),  # IDLE: the only resident runtime exited on its own
        Phase.DRAINING: frozenset(
            {Phase.UNLOADING_OLLAMA, Phase.STOPPING_SERVER, Phase.UNLOADING_MODELS, Phase.STARTING_SERVER, Phase.LOADING_MODEL}
        )
        | _SETTLED,
        Phase.UNLOADING_OLLAMA: frozenset({Phase.RELEASING_OLLAMA, Phase.STARTING_SERVER, Phase.LOADING_MODEL}) | _SETTLED,
        Phase.RELEASING_OLLAMA: frozenset({Phase.STARTING_SERVER, Phase.LOADING_MODEL}) | _SETTLED,
        Phase.STOPPING_SERVER: frozenset({Phase.RELEASING_SERVER}) | _SETTLED,
        Phase.RELEASING_SERVER: _SETTLED,
        Phase.UNLOADING_MODELS: frozenset({Phase.RELEASING_MODELS, Phase.LOADING_MODEL}) | _SETTLED,
        Phase.RELEASING_MODELS: frozenset({Phase.LOADING_MODEL}) | _SETTLED,
        Phase.STARTING_SERVER: frozenset({Phase.LOADING_MODEL}) | _SETTLED,
        Phase.LOADING_MODEL: _SETTLED,
    }
)
"""From each phase, the phases a switch may go to next: drain, evict (unload or stop, then wait for
the memory), start, load, and settle; staying is no step. A switch to Ollama starts nothing: Ollama
loads on the request. A router llama-server is evicted by unloading its models and brought in by
loading the request's one (started first if it is not running). Checked by
:func:`~contextpaw.core.lifecycle.advance`, as every state table is."""
