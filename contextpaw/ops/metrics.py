"""What ContextPaw counts, as Prometheus metrics: per backend, route and (bounded) model, with
histograms of compaction time, of tokens evicted and of each proxied request's time, each backend's
up gauge at scrape time, the build's versions and the process's own `process_*` series. Every route
of a configured backend has its series from the first scrape, at 0.

`Stats` is the collector every part of the proxy counts into; `/contextpaw/metrics` (admin.py)
serves it and `/contextpaw/health` shows its unlabelled totals. `FailureLedger` is the one ledger
of backend failures: what is counted, what is logged, and the last error seen at each backend,
whichever part of ContextPaw saw it fail. No I/O here.
"""

from __future__ import annotations

import bisect
import datetime
import itertools
import platform
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import astuple, dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from contextpaw import wire
from contextpaw.core import logs
from contextpaw.ops.evicted import EvictedStore

logger = logs.get(__name__)

COUNTS = {
    "requests": "Requests ContextPaw fitted (or proved to fit) on a compactable route",
    "compacted": "Requests sent on compacted to fit the window: evicted, shrunk or cut middle-out",
    "refused": "Requests answered here with their API's overflow error (413, or 400 where the API says so), never sent",
    "retried_400": "Context-overflow 400s from the backend that ContextPaw answered by sending a compacted retry",
    "recovered_400": "Compacted retries after a context-overflow 400 that the backend then served",
    "errors": "Internal ContextPaw failures; each request or answer concerned went on unchanged (fail open)",
    "unreachable": "Requests answered 502 here because the backend did not accept a connection",
    "too_large": "Requests answered 413 because the body was (or inflated to) over contextpaw_max_body_mb",
    "bad_request": "Requests answered 400 because HTTP does not allow their target (a raw non-ASCII byte), or 415 for a Content-Encoding ContextPaw cannot read",
    "upstream_errors": "Handled requests whose backend failed: 5xx, an answer that is not JSON, a reset or a timeout",
    "upstream_timeouts": "Handled requests whose backend fell silent past contextpaw_header_timeout or contextpaw_idle_timeout",
    "original_tokens": "Prompt tokens of the requests as clients sent them, in the deciding counter's units (counted requests only)",
    "evicted_tokens": "Prompt tokens compaction took out of the model's view (dropped, shrunk or summarized)",
    "upstream_truncated": "Answers whose server evaluated fewer prompt tokens than it was sent: it cut the prompt in silence",
    "upstream_truncation_possible": "Answers whose server may have cut the prompt: an estimated count near the window, which the numbers cannot settle",
    "prompt_tokens_reused": "Prompt tokens llama-server took from its prompt cache (timings.cache_n): what a cut kept in place",
    "prompt_tokens_evaluated": "Prompt tokens llama-server evaluated anew (timings.prompt_n): what each turn cost in prefill",
}
SOURCE_HELP = {
    "runtime_switches": "GPU hand-overs from one runtime to the other that brought the new one up (contextpaw_arbitrate)",
    "runtime_failures": "Runtime start-ups or switches that failed or timed out; the previous owner kept the GPU where it could",
    "runtime_switch_seconds": "Seconds spent bringing runtimes up and taking them down, failed attempts included",
    "runtime_refused": "Requests answered 503 with Retry-After because their runtime could not get the GPU",
    "runtime_wait_timeouts": "Requests that waited contextpaw_arbitrate_wait seconds for their runtime and were answered 503",
    "runtime_cancelled": "Switches abandoned because no request waited for that runtime any more",
    "runtime_loads": "Runtimes brought up on the GPU, with an eviction (a switch) or without",
    "runtime_loaded_beside": "Runtimes brought up beside another one that stayed resident (both fit in memory)",
    "summarizer_digests": "Digests of evicted spans asked for (contextpaw_summarize), cache hits and failures included",
    "summarizer_calls": "Completion calls made to the summarizer model",
    "summarizer_cache_hits": "Digest pieces answered from the summarizer's cache without a call",
    "summarizer_failures": "Digests that could not be made; the plain marker stayed in their place",
    "summarizer_seconds": "Seconds spent making digests, cache hits included",
}
"""Help for the counters other parts of ContextPaw own (`Stats.sources`), which report bare numbers."""

LABELS = ("backend", "route", "model")
ROUTE_LABELS = ("backend", "route")
OUTCOME_LABELS = ("backend", "route", "outcome")
OUTCOMES = ("compacted", "unchanged", "refused", "error")
"""What became of a proxied request, for its time: sent on compacted; sent on as it came (or not
judged); answered here with a refusal; no whole answer (a 5xx, a broken or silent backend, a client
that went away)."""
MODEL_LABELS = 20
"""Distinct `model` label values kept; later models are counted as "other" (clients choose the names)."""
MODEL_NAME_CHARS = 128
PLACES_KEPT = 4096
"""Label sets `Stats.where` keeps found (clients choose the model names: past this, each is made anew)."""
UNKNOWN = "unknown"
OTHER = "other"
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Compaction time: a small chat takes milliseconds; a 10 MB agent history, or one counted by llama-server, seconds."""
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""A proxied request's time: a refusal or a cached prefix in tens of milliseconds; a long prompt's
prefill and a long answer on a local GPU, minutes."""
TOKEN_BUCKETS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576)


def package_version(name: str = "contextpaw") -> str:
    try:
        return version(name)
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown"


def label(value: str) -> str:
    """`value` as a label the page can always carry: what UTF-8 cannot encode (a lone surrogate from a
    client's JSON, `"m\\ud800"`) written as its backslash escape, so a scrape never fails on it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


@dataclass(frozen=True, slots=True)
class Where:
    """The labels of one request's series: the backend's kind, the route, and the model (bounded)."""

    backend: str = UNKNOWN
    route: str = UNKNOWN
    model: str = UNKNOWN


UNPLACED = Where()
"""For counts whose request was not read (a body too large, a backend that failed before an answer)."""


class Histogram:
    """Cumulative bucket counts and a sum for one label set, as the exposition format wants them."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        edges = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        return list(zip(edges, itertools.accumulate(self.counts), strict=True))


class Stats(Collector):
    """Counts for /health (totals) and /metrics (per backend, route and model), with histograms of
    compactions and of proxied requests' times, and whether each backend answers, in a registry of
    their own (one per addon instance) beside the process's own series. Fed on the event loop only.

    A series is rendered from the first scrape, at 0, for every route of each backend kind a scrape
    was told of (`answering`), model `unknown`; and every label set any counter has is in every
    counter, so that a ratio of two of them reads 0, not nothing. The bound stays that of the labels:
    kinds x routes x (`MODEL_LABELS` + 2) models."""

    def __init__(self, store: EvictedStore) -> None:
        self.counts = dict.fromkeys(COUNTS, 0)
        self.series: dict[str, dict[Where, float]] = {name: {} for name in COUNTS}
        self.seconds: dict[tuple[str, str], Histogram] = {}
        self.evicted: dict[tuple[str, str], Histogram] = {}
        """Per (backend, route): a model label would multiply every bucket by the models."""
        self.latency: dict[tuple[str, str, str], Histogram] = {}
        """Per (backend, route, outcome): each proxied request's time, from its start to its answer's end."""
        self.kinds: set[str] = set()
        """The backend kinds the scrapes were told of: their routes' series are rendered from 0."""
        self.models: set[str] = set()
        self._places: dict[tuple[str | None, str | None, str | None], Where] = {}
        """`where`'s answers: a request's labels are looked up twice or more (as it came, once its
        model is read), and a model's label never changes once it is given."""
        self.store = store
        self.sources: list[Callable[[], dict[str, float]]] = []
        """More counters owned by other addons (the GPU arbiter's), read at each scrape."""
        self.answering: list[tuple[str, str, bool]] = []
        """(kind, url, answers) per backend, as the last health probe found them (set before each scrape)."""
        self.kept: tuple[int, int] | None = (0, 0)
        """(items, bytes) the archive keeps, read off the loop before each scrape (None: it did not answer)."""
        self.build = {"version": package_version(), "mitmproxy": package_version("mitmproxy"), "python": platform.python_version()}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ... (Linux)

    def where(self, kind: str | None, route: str | None, model: str | None = None) -> Where:
        """The labels for a request, each one encodable (`label`); the first `MODEL_LABELS` models
        keep their names."""
        place = (kind, route, model)
        if (found := self._places.get(place)) is not None:
            return found
        found = self._where(kind, route, model)
        if len(self._places) < PLACES_KEPT:
            self._places[place] = found
        return found

    def _where(self, kind: str | None, route: str | None, model: str | None) -> Where:
        if not model:
            model = UNKNOWN
        else:
            model = label(model)
            if model not in self.models:
                if len(self.models) < MODEL_LABELS and len(model) <= MODEL_NAME_CHARS:
                    self.models.add(model)
                else:
                    model = OTHER
        return Where(label(str(kind)) if kind else UNKNOWN, label(route) if route else UNKNOWN, model)

    def add(self, name: str, amount: int = 1, where: Where = UNPLACED) -> None:
        self.counts[name] += amount
        series = self.series[name]
        series[where] = series.get(where, 0) + amount

    def compaction(self, where: Where, seconds: float, evicted_tokens: int) -> None:
        """One compacted request sent on: counted, its time and its evicted tokens observed."""
        self.add("compacted", where=where)
        self.add("evicted_tokens", evicted_tokens, where)
        place = (where.backend, where.route)
        self.seconds.setdefault(place, Histogram(SECONDS_BUCKETS)).observe(seconds)
        self.evicted.setdefault(place, Histogram(TOKEN_BUCKETS)).observe(evicted_tokens)

    def proxied(self, where: Where, outcome: str, seconds: float) -> None:
        """One proxied request is over: its time, from its start to its answer's end (`OUTCOMES`)."""
        place = (where.backend, where.route, outcome)
        self.latency.setdefault(place, Histogram(REQUEST_BUCKETS)).observe(max(seconds, 0.0))

    def _routes(self) -> list[Where]:
        """Every route of the backend kinds the scrapes were told of, model unknown."""
        kinds = self.kinds | {label(str(kind)) for kind, _, _ in self.answering if kind}
        self.kinds = kinds
        known = {kind.value: kind for kind in wire.Kind}
        return [Where(name, route, UNKNOWN) for name in sorted(kinds) if name in known for route in wire.route_names(known[name])]

    def collect(self) -> Iterator[Metric]:
        routes = self._routes()
        places = dict.fromkeys(itertools.chain(routes, *(self.series[name] for name in COUNTS)))
        for name, text in COUNTS.items():
            family = CounterMetricFamily(f"contextpaw_{name}", text, labels=LABELS)
            series = self.series[name]
            for where in places:
                family.add_metric(astuple(where), series.get(where, 0))
            yield family
        route_places = [(where.backend, where.route) for where in routes]
        yield self._histogram(
            "compaction_seconds",
            "Seconds from the start of fitting a request to its compacted body, the backend's counting calls included (a rescue's refit on its own)",
            self.seconds,
            route_places,
            SECONDS_BUCKETS,
        )
        yield self._histogram(
            "compaction_evicted_tokens", "Prompt tokens evicted from each compacted request", self.evicted, route_places, TOKEN_BUCKETS
        )
        yield self._histogram(
            "request_duration_seconds",
            "Seconds from the start of each proxied request to the end of its answer (streams included), by what became of it",
            self.latency,
            [(*place, outcome) for place in route_places for outcome in OUTCOMES],
            REQUEST_BUCKETS,
            OUTCOME_LABELS,
        )
        info = GaugeMetricFamily(
            "contextpaw_build_info",
            "Always 1: the versions of ContextPaw, mitmproxy and Python this process runs",
            labels=tuple(self.build),
        )
        info.add_metric(tuple(self.build.values()), 1)
        yield info
        for source in self.sources:
            for name, value in source().items():
                yield CounterMetricFamily(f"contextpaw_{name}", SOURCE_HELP.get(name, name.replace("_", " ")), value=value)
        up = GaugeMetricFamily(
            "contextpaw_backend_up", "1 if the backend accepted a connection when this scrape asked, else 0", labels=("backend", "url")
        )
        for kind, url, answers in self.answering:
            up.add_metric((label(kind) if kind else UNKNOWN, label(url)), float(answers))
        yield up
        yield GaugeMetricFamily(
            "contextpaw_evicted_store_up",
            "1 if the evicted archive said what it keeps when this scrape asked, else 0",
            value=float(self.kept is not None),
        )
        if self.kept is not None:
            items, size = self.kept
            yield GaugeMetricFamily("contextpaw_evicted_store_items", "Evicted contents kept for /contextpaw/evicted/<id>", value=items)
            yield GaugeMetricFamily(
                "contextpaw_evicted_store_bytes", "Bytes of evicted content kept for /contextpaw/evicted/<id>", value=size
            )

    @staticmethod
    def _histogram(
        name: str,
        text: str,
        observed: dict[Any, Histogram],
        known: Iterable[tuple[str, ...]],
        bounds: tuple[float, ...],
        labels: tuple[str, ...] = ROUTE_LABELS,
    ) -> HistogramMetricFamily:
        """The observed histograms, and an empty one for each `known` label set not observed yet."""
        family = HistogramMetricFamily(f"contextpaw_{name}", text, labels=labels)
        for values in dict.fromkeys(itertools.chain(known, observed)):
            histogram = observed.get(values) or Histogram(bounds)
            family.add_metric(values, histogram.buckets(), histogram.sum)
        return family


class FailureLedger:
    def __init__(self, stats: Stats, broken: Callable[[str], None] = lambda target: None) -> None:
        self.stats = stats
        self.broken = broken
        """Told the "host:port" of a backend that refused or broke a connection (not one that was
        only slow): it may have restarted, with another window."""
        self.last_error: dict[str, str] = {}
        """"host:port" -> the last failure seen there; cleared when a connection opens again."""
        self.last_error_at: dict[str, float] = {}
        """"host:port" -> when its last failure was seen (epoch seconds); kept after it clears."""
        self.last_ok_at: dict[str, float] = {}
        """"host:port" -> when a connection to it last opened (epoch seconds)."""

        self.unanswered: set[str] = set()
        """The targets whose last error is that they did not take a connection."""

    def _fails(self, target: str, reason: str, *, unanswered: bool = False) -> None:
        self.last_error[target] = reason
        self.last_error_at[target] = time.time()
        (self.unanswered.add if unanswered else self.unanswered.discard)(target)

    def connect_failed(self, target: str, reason: str) -> None:
        """mitmproxy could not connect (its own answer, or ours, says so to the client)."""
        self._fails(target, reason, unanswered=True)
        self.broken(target)

    def connected(self, target: str) -> None:
        self.last_error.pop(target, None)
        self.unanswered.discard(target)
        self.last_ok_at[target] = time.time()

    def probed(self, target: str, answers: bool) -> None:
        """A probe of ContextPaw's own (at start, or health's) found the backend taking a connection
        or not. Taking one clears a failure to take one, never a bad answer (a 5xx, a stall), which
        only a request can clear."""
        if not answers:
            if target not in self.unanswered:
                self._fails(target, "does not answer (the connection was refused or timed out)", unanswered=True)
        elif target in self.unanswered or target not in self.last_error:
            self.connected(target)
        else:
            self.last_ok_at[target] = time.time()

    def times(self, target: str) -> dict[str, str | None]:
        """The target's last failure and last success, as ISO times (null: never seen)."""
        return {"last_error_at": _iso(self.last_error_at.get(target)), "last_ok_at": _iso(self.last_ok_at.get(target))}

    def unreachable(self, target: str, what: str, reason: str, where: Where = UNPLACED) -> None:
        """A handled request answered 502 because its backend does not answer."""
        self._fails(target, reason, unanswered=True)
        self.broken(target)
        self.stats.add("unreachable", where=where)
        logger.warning("%s: answered 502: %s", what, reason)

    def failed(
        self, what: str, reason: str, *, target: str | None = None, timed_out: bool = False, answered: str = "", where: Where = UNPLACED
    ) -> None:
        """A backend that answered badly: a 5xx, an answer that is not JSON, a reset or a stall."""
        if target is not None:
            self._fails(target, reason)
            if not timed_out:
                self.broken(target)
        self.stats.add("upstream_errors", where=where)
        self.stats.add("upstream_timeouts", timed_out, where)
        logger.warning("%s: upstream failure: %s%s", what, reason, f" ({answered})" if answered else "")


def _iso(at: float | None) -> str | None:
    return None if at is None else datetime.datetime.fromtimestamp(at, datetime.UTC).isoformat(timespec="seconds")
