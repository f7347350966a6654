"""The `Upstream` addon: handled requests go to their backend through ContextPaw's own relay
(`contextpaw.relay`), which answers every failure in the caller's API."""

from __future__ import annotations

import asyncio
import functools
import weakref
from typing import Any

from mitmproxy import connection, ctx, exceptions, http

from contextpaw import wire
from contextpaw.calls.session import PROBE_TIMEOUT_S
from contextpaw.core.caches import LRU
from contextpaw.fitting.fitter import Fitter
from contextpaw.ops.metrics import FailureLedger
from contextpaw.proxy.backends import Backends
from contextpaw.proxy.compactor import FlowStates
from contextpaw.relay.exchange import FLOW_HEADER, Failure, Timeouts
from contextpaw.relay.loopback import Relay
from contextpaw.relay.rescue import Decide
from contextpaw.settings import RELAY_OPTIONS, RelaySettings, declare


class Upstream:
    """Sends handled requests to their backend through the relay (`contextpaw.relay.loopback`), so that a
    backend that resets, hangs or breaks off gets an answer in the caller's API within the timeouts,
    counted in the failure ledger and logged. Other flows, HTTPS backends and flows that already go
    via an upstream proxy are left to mitmproxy.

    A flow the fitter may rescue goes to the relay with its key (`X-ContextPaw-Flow`, which the
    relay takes off); when its backend refuses it as too long, the relay asks for the rescue's
    decision by that key, and what the rescue did is in the flow's state, which
    `Compactor.responseheaders` settles.
    """

    def __init__(self, backends: Backends, fitter: Fitter, states: FlowStates, ledger: FailureLedger) -> None:
        self.backends = backends
        self.fitter = fitter
        self.states = states
        self.ledger = ledger
        self.relay = Relay(
            self._failed, Timeouts(PROBE_TIMEOUT_S, (relay := RelaySettings()).header_timeout, relay.idle_timeout), self._rescue
        )
        self._starting: asyncio.Task[None] | None = None
        self.carried: LRU = LRU(4096)
        """The key of a flow the relay carries -> its state (weakly), while its answer is awaited."""

    def load(self, loader: Any) -> None:
        declare(loader, RELAY_OPTIONS)

    def configure(self, updated: set[str]) -> None:
        try:
            relay = RelaySettings.parse(ctx.options)
        except ValueError as e:
            raise exceptions.OptionsError(str(e)) from None
        self.relay.timeouts = Timeouts(connect=PROBE_TIMEOUT_S, headers=relay.header_timeout, idle=relay.idle_timeout)

    def running(self) -> None:
        """Start the relay (sync, as a reloaded script's hooks are called; flows before it listens
        go to their backend directly)."""
        self._starting = asyncio.get_running_loop().create_task(self.relay.start())

    def done(self) -> None:
        self.relay.close()

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live or not self.backends.relayed(flow):
            return
        # A fresh server connection: an eagerly opened one cannot take a `via` any more.
        assert self.relay.address is not None, "the relay carries a flow only while it listens"
        flow.server_conn = connection.Server(address=(flow.request.host, flow.request.port), via=("http", self.relay.address))
        state = self.states.get(flow)
        flow.request.headers.pop(FLOW_HEADER, None)  # the key is ours to give, never the client's
        if state is not None and self.fitter.may_rescue(state):
            flow.request.headers[FLOW_HEADER] = flow.id
            self.carried.put(flow.id, weakref.ref(state))

    def response(self, flow: http.HTTPFlow) -> None:
        self._forget(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._forget(flow)

    def _forget(self, flow: http.HTTPFlow) -> None:
        if self.carried.pop(flow.id, None) is not None:
            flow.request.headers.pop(FLOW_HEADER, None)  # mitmweb and saved flows show the client's request

    def _rescue(self, key: str) -> Decide | None:
        """The rescue's decision for the flow the relay carries under `key` (what the relay carries
        is never compressed: the backends addon inflated it)."""
        carried = self.carried.get(key)
        state = carried and carried()
        return functools.partial(self.fitter.rescue, state) if state is not None else None

    def http_connect_upstream(self, flow: http.HTTPFlow) -> None:
        if self.relay.address is not None and flow.server_conn.address == self.relay.address:
            flow.request.headers["Proxy-Authorization"] = self.relay.authorization

    def _failed(self, failure: Failure) -> None:
        what = f"{failure.method} {failure.path}"
        kind = self.backends.kind_at(failure.target)
        route = wire.route_for(kind, failure.method, failure.path) if kind is not None else None
        where = self.ledger.stats.where(kind, route.name if route is not None else None)
        if not failure.connected:
            self.ledger.unreachable(failure.target, what, failure.reason, where)
            return
        answered = "an error record ended the stream" if failure.streamed else ("504" if failure.timed_out else "502")
        self.ledger.failed(what, failure.reason, target=failure.target, timed_out=failure.timed_out, answered=answered, where=where)
