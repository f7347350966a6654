"""The `Upstream` addon: handled requests go to their backend through ContextPaw's own exchange
(`contextpaw.relay`), which answers every failure in the caller's API: a request that asks for a
buffered answer is sent from the request hook itself, and one that may stream through the relay's
loopback tunnel."""

from __future__ import annotations

import asyncio
import functools
import time
import weakref
from collections.abc import Callable
from typing import Any

import h11
from mitmproxy import connection, ctx, exceptions, http

from contextpaw import wire
from contextpaw.calls.session import PROBE_TIMEOUT_S
from contextpaw.core.caches import LRU
from contextpaw.fitting.fitter import Fitter
from contextpaw.fitting.flow import FlowState
from contextpaw.ops.metrics import FailureLedger
from contextpaw.proxy.backends import HOP_HEADER, Backends
from contextpaw.proxy.compactor import FlowStates
from contextpaw.relay.exchange import ClientGone, Exchange, Failure, Head, Idle, Timeouts, answer_headers
from contextpaw.relay.loopback import FLOW_HEADER, Relay
from contextpaw.relay.rescue import Decide
from contextpaw.settings import RELAY_OPTIONS, RelaySettings, declare

WATCH_S = 0.25
"""How often a flow answered in the request hook looks at its client's connection."""


class Answer:
    """The answer of an exchange made in the request hook, gathered for the flow (the `Sink` of
    the hop-less path). mitmproxy holds a connection's events while a hook runs, so a client that
    goes away is seen in its connection's state, looked at every `WATCH_S`."""

    def __init__(self, client: connection.Client) -> None:
        self.client = client
        self.head: h11.Response | None = None
        self.pieces: list[bytes] = []
        self._look: asyncio.TimerHandle | None = None

    async def send(self, *events: h11.Event) -> None:
        for event in events:
            if isinstance(event, h11.Response):
                self.head = event
            elif isinstance(event, h11.Data):
                self.pieces.append(event.data)

    async def send_whole(self, response: h11.Response, pieces: list[bytes]) -> None:
        self.head, self.pieces = response, pieces

    def watch(self, gone: Callable[[], None]) -> None:
        self._look = asyncio.get_running_loop().call_later(WATCH_S, self._looked, gone)

    def _looked(self, gone: Callable[[], None]) -> None:
        if self.client.state & connection.ConnectionState.CAN_READ:
            self.watch(gone)
        else:
            self._look = None
            gone()

    async def unwatch(self) -> None:
        if self._look is not None:
            self._look.cancel()
            self._look = None

    def response(self) -> http.Response:
        """The whole answer, framed by its length (a stream the backend sent anyway, too)."""
        assert self.head is not None, "an exchange answers, or its client is gone"
        body = b"".join(self.pieces)
        now = time.time()
        headers = http.Headers(answer_headers(self.head, len(body)))
        return http.Response(b"HTTP/1.1", self.head.status_code, self.head.reason, headers, body, None, now, now)


class Upstream:
    """Sends handled requests to their backend through ContextPaw's own exchange
    (`contextpaw.relay.exchange`), so that a backend that resets, hangs or breaks off gets an answer
    in the caller's API within the timeouts, counted in the failure ledger and logged. Other flows,
    HTTPS backends and flows that already go via an upstream proxy are left to mitmproxy.

    A request whose body says it asks for a buffered answer is sent here, in the request hook, on
    a kept backend connection, and its answer set on the flow: mitmproxy's request is used as it was
    read, and no second loopback connection carries it. One that may stream goes through the relay
    (`contextpaw.relay.loopback`), as through an upstream proxy: mitmproxy's hooks cannot pass on a
    stream made here.

    A flow the fitter may rescue is given the rescue's decision: sent from here, directly; carried
    by the relay, by its key (`X-ContextPaw-Flow`, which the tunnel takes off). What the rescue did is
    in the flow's state, which `Compactor.responseheaders` settles.
    """

    def __init__(self, backends: Backends, fitter: Fitter, states: FlowStates, ledger: FailureLedger) -> None:
        self.backends = backends
        self.fitter = fitter
        self.states = states
        self.ledger = ledger
        relay = RelaySettings()
        timeouts = Timeouts(PROBE_TIMEOUT_S, relay.header_timeout, relay.idle_timeout)
        self.relay = Relay(self._failed, timeouts, self._rescue, mark=(HOP_HEADER.encode(), backends.mark.encode()))
        """It sends every handled request it carries with the loop mark (the flow is not marked)."""
        self.idle = Idle()
        """Backend connections kept for requests sent from the request hook."""
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
        self.idle.close()

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live or not self.backends.relayed(flow):
            return
        state = self.states.get(flow)
        if FLOW_HEADER in flow.request.headers:
            del flow.request.headers[FLOW_HEADER]  # the key is ours to give, never the client's
        if state is not None:
            decide = functools.partial(self.fitter.rescue, state) if self.fitter.may_rescue(state) else None
            if self._buffered(flow, state):
                return await self._exchange(flow, decide)
            if decide is not None:
                flow.request.headers[FLOW_HEADER] = flow.id
                self.carried.put(flow.id, weakref.ref(state))
        # A fresh server connection: an eagerly opened one cannot take a `via` any more.
        assert self.relay.address is not None, "the relay carries a flow only while it listens"
        flow.server_conn = connection.Server(address=(flow.request.host, flow.request.port), via=("http", self.relay.address))

    def _buffered(self, flow: http.HTTPFlow, state: FlowState) -> bool:
        """Whether the request surely asks for a buffered answer: as parsed, else as its bytes say."""
        asked = self.fitter.answers.asked_stream(state)
        if asked is None:
            asked = state.route.streams(flow.request.raw_content or b"")
        return asked is False

    async def _exchange(self, flow: http.HTTPFlow, decide: Decide | None) -> None:
        """Send the request from here and set its answer (a failure's too) on the flow; a flow whose
        client went away meanwhile is killed, and the backend's connection closed."""
        request = flow.request
        target = (request.host, request.port)
        answer = Answer(flow.client_conn)
        head = Head(request.data.method, request.data.path, request.headers.fields)
        exchange = Exchange(self.relay, target, head, request.raw_content or b"", self.idle.take(target), answer, decide)
        try:
            await exchange.run()
        except (ClientGone, OSError):
            flow.kill()
            return
        finally:
            self.idle.keep(target, exchange.spare)
        flow.response = answer.response()

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
