"""The composition root: every addon, built once and wired to what they share (the counts, the
evicted store, the failure ledger, the HTTP session, each flow's state), in hook order."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

from mitmproxy import contentviews

from contextpaw.calls.session import HttpServices, Session
from contextpaw.fitting.fitter import Fitter
from contextpaw.gpu.arbiter import Arbiter, ArbiterSettings
from contextpaw.ops.archive import Archive
from contextpaw.ops.metrics import FailureLedger, Stats
from contextpaw.proxy.arbitration import Arbitration
from contextpaw.proxy.backends import Backends, located
from contextpaw.proxy.compactor import Compactor
from contextpaw.proxy.deadlines import RequestDeadlines
from contextpaw.proxy.endpoints import AdminEndpoints
from contextpaw.proxy.heap import ReturnedMemory, StartupHeap
from contextpaw.proxy.model_routes import ModelRoutes
from contextpaw.proxy.request_log import RequestLog
from contextpaw.proxy.upstream import Upstream
from contextpaw.proxy.views import ContextPawView
from contextpaw.settings import FitSettings


def make_addons(new_arbiter: Callable[[ArbiterSettings], Arbiter] | None = None) -> list[object]:
    """The addons in hook order; and the content view. ``new_arbiter`` makes the GPU arbiter (a
    fake one in tests; by default the real one, on the shared session)."""
    contentviews.add(ContextPawView())
    defaults = FitSettings()  # until mitmproxy configures the options
    store = Archive(max_items=defaults.evicted_items, max_bytes=defaults.evicted_bytes, max_age_s=defaults.evicted_ttl)
    stats = Stats(store)
    session = Session()
    services = HttpServices(session)
    fitter = Fitter(services, stats, store, defaults)
    ledger = FailureLedger(stats, broken=lambda target: fitter.windows.forget(functools.partial(located, target)))
    states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    backends = Backends(ledger, session)
    gpu = Arbitration(backends, new_arbiter or functools.partial(Arbiter, session=session.get))
    compactor = Compactor(backends, fitter, states, ledger, session, store)
    stats.sources += [gpu.metrics, compactor.summary_metrics]
    upstream = Upstream(backends, fitter, states, ledger)
    backends.relay = upstream.relay
    endpoints = AdminEndpoints(backends, fitter, services, ledger, store, gpu.status)
    models = ModelRoutes(backends, fitter)
    log = RequestLog(states, stats, backends)
    return [StartupHeap(), ReturnedMemory(), RequestDeadlines(), gpu, endpoints, backends, compactor, models, upstream, log]
