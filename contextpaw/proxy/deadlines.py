"""A client has a bounded time to send each whole request; then its connection is closed.

mitmproxy's `tcp_timeout` is an idle timeout: a client that sends one byte every few seconds
(slowloris) resets it forever, and under the `contextpaw` command it is two hours anyway, so a
handful of such clients could hold every connection a machine allows. The clock here runs while a
connection owes us a request: from the connection's start, or from the end of its last answer,
until the request's body has arrived. It stops while the answer is made and sent, however long a
stream takes, and a connection that became a WebSocket or a raw TCP tunnel is no longer timed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import connection, ctx, exceptions, http, tcp
from mitmproxy.utils import human

from contextpaw.core import logs

logger = logs.get(__name__)

OPTION = "contextpaw_request_read_timeout"
DEFAULT_S = 120
"""Seconds for an idle keep-alive wait, the headers and the body together: a 256 MB body needs
only 2 MB/s to arrive in time, and an answer, which is not timed, may stream for hours."""

STALL_S = 0.1
"""A deadline met this late fell in a stall of the proxy's own loop; the client gets that time back."""


@dataclass
class _Client:
    reading: set[str] = field(default_factory=set)
    """Flows whose headers came and whose body has not."""
    in_flight: set[str] = field(default_factory=set)
    """Flows begun and not yet answered."""
    timer: asyncio.TimerHandle | None = None
    """Set while the connection owes a request, and left to run out when it stops owing one: it
    finds then what is owed, and since when (a timer cancelled and made again for every request
    cost each request two of the event loop's heap operations)."""
    owed_since: float | None = None
    """When (the loop's clock) the connection came to owe the request it owes; None: it owes none."""
    untimed: bool = False
    """The connection carries something other than HTTP requests now (WebSocket, TCP)."""

    @property
    def owes_request(self) -> bool:
        return not self.untimed and (bool(self.reading) or not self.in_flight)


class RequestDeadlines:
    """Closes a client connection that has not sent a whole request within the deadline."""

    def __init__(self) -> None:
        self.timeout_s = DEFAULT_S
        self.clients: dict[str, _Client] = {}

    def load(self, loader: Any) -> None:
        loader.add_option(
            OPTION,
            int,
            DEFAULT_S,
            "Seconds a client connection may take to send a whole request (headers and body, and the idle wait "
            "before them on a kept-alive connection); then it is closed. Answers, streamed or not, are not timed.",
        )

    def configure(self, updated: set[str]) -> None:
        if OPTION in updated:
            value = getattr(ctx.options, OPTION)
            if value < 1:
                raise exceptions.OptionsError(f"{OPTION} must be at least 1, not {value}")
            self.timeout_s = value

    def client_connected(self, client: connection.Client) -> None:
        if client.transport_protocol == "tcp":
            self.clients[client.id] = watched = _Client()
            self._follow(client, watched)

    def client_disconnected(self, client: connection.Client) -> None:
        watched = self.clients.pop(client.id, None)
        if watched and watched.timer:
            watched.timer.cancel()

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self._change(flow.client_conn, begun=flow.id)

    def request(self, flow: http.HTTPFlow) -> None:
        self._change(flow.client_conn, read=flow.id)

    def response(self, flow: http.HTTPFlow) -> None:
        if flow.websocket is not None:
            self._change(flow.client_conn, untimed=True)
        self._change(flow.client_conn, ended=flow.id)

    def error(self, flow: http.HTTPFlow) -> None:
        self._change(flow.client_conn, ended=flow.id)

    def tcp_start(self, flow: tcp.TCPFlow) -> None:
        self._change(flow.client_conn, untimed=True)

    def _change(self, client: connection.Client, *, begun: str = "", read: str = "", ended: str = "", untimed: bool = False) -> None:
        watched = self.clients.get(client.id)
        if watched is None:
            return
        if begun:
            watched.reading.add(begun)
            watched.in_flight.add(begun)
        watched.reading.discard(read or ended)
        watched.in_flight.discard(ended)
        watched.untimed |= untimed
        self._follow(client, watched)

    def _follow(self, client: connection.Client, watched: _Client) -> None:
        """Start the clock when the connection comes to owe a request; a clock already running
        keeps its deadline, and the time owed is counted from when it came to owe this one."""
        if not watched.owes_request:
            watched.owed_since = None
            return
        if watched.owed_since is None:
            watched.owed_since = asyncio.get_running_loop().time()
        if watched.timer is None:
            watched.timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, client)

    def _expire(self, client: connection.Client) -> None:
        watched = self.clients.get(client.id)
        if watched is None or watched.timer is None:
            return
        loop = asyncio.get_running_loop()
        late = loop.time() - watched.timer.when()
        if late > STALL_S:  # the proxy was busy, not the client: what it sent meanwhile is still unread
            watched.timer = loop.call_later(late, self._expire, client)
            return
        watched.timer = None
        if watched.owed_since is None:
            return  # it owes nothing now: the clock starts again when it does
        left = watched.owed_since + self.timeout_s - loop.time()
        if left > 0:  # the request owed now came to be owed after the clock started
            watched.timer = loop.call_later(left, self._expire, client)
            return
        handler = ctx.master.addons.get("proxyserver").connections.get(client.id)
        if handler is None or client not in handler.transports:
            return  # closing already
        logger.warning(
            "closed the connection of %s: no whole request in %d s (%s)", human.format_address(client.peername), self.timeout_s, OPTION
        )
        handler.close_connection(client)
