"""ContextPaw's addons on mitmproxy's test master (``taddons.context``), a flow taken through their
hooks by mitmproxy's own addon manager (``handle_lifecycle``), as mitmdump would.

An addon that raises is not swallowed as mitmproxy swallows it (it logs "Addon error" and goes on):
the error is raised to the test, so a bug cannot pass as a flow that was merely left alone.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mitmproxy import addonmanager, hooks, http
from mitmproxy.proxy.layers.http import (  # imported for their registration in hooks.all_hooks too
    HttpRequestHeadersHook,
    HttpRequestHook,
    HttpResponseHeadersHook,
    HttpResponseHook,
)
from mitmproxy.test import taddons

if TYPE_CHECKING:
    from contextpaw.proxy.arbitration import Arbitration
    from contextpaw.proxy.backends import Backends
    from contextpaw.proxy.compactor import Compactor
    from contextpaw.proxy.endpoints import AdminEndpoints
    from contextpaw.proxy.upstream import Upstream

ROLES = {
    "arbitration": "arbitration",
    "admin": "adminendpoints",
    "backends": "backends",
    "compactor": "compactor",
    "upstream": "upstream",
}
"""Attribute -> the addon's name in the master's addon manager (its class name, lower-cased)."""


class _AddonErrors(logging.Handler):
    """Collects the exceptions mitmproxy's ``safecall`` logs while a hook runs."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.errors: list[BaseException] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.errors.append(record.exc_info[1])


@dataclass
class Proxy:
    """The addons registered on ``tctx``'s master, each also reachable by its concern."""

    tctx: taddons.context
    addons: list[Any]
    arbitration: Arbitration = field(init=False, repr=False)
    admin: AdminEndpoints = field(init=False, repr=False)
    backends: Backends = field(init=False, repr=False)
    compactor: Compactor = field(init=False, repr=False)
    upstream: Upstream = field(init=False, repr=False)

    def __post_init__(self) -> None:
        manager = self.tctx.master.addons
        for attribute, name in ROLES.items():
            addon = manager.get(name)
            if addon is None:
                raise LookupError(f"no addon named {name!r} on the master: {[type(a).__name__ for a in manager.chain]}")
            setattr(self, attribute, addon)

    async def close(self) -> None:
        """Close the HTTP session the fitter's lookups opened: left open, the collector finds it
        later, in some other test, and warns there."""
        self.compactor.session.close()
        await asyncio.sleep(0)  # the close's first step marks it closed

    async def run(self, hook: hooks.Hook) -> None:
        """``hook`` through every addon on the master, in order; an addon's exception is raised."""
        caught = _AddonErrors()
        addonmanager.logger.addHandler(caught)
        try:
            await self.tctx.master.addons.handle_lifecycle(hook)
        finally:
            addonmanager.logger.removeHandler(caught)
        if caught.errors:
            raise caught.errors[0]

    async def hook(self, name: str, flow: http.HTTPFlow) -> None:
        """The flow hook called ``name`` (``"responseheaders"``, ...), as :meth:`run` runs it."""
        await self.run(hooks.all_hooks[name](flow))

    async def send(self, flow: http.HTTPFlow) -> None:
        """The request's hooks: what the proxy does before the request goes upstream."""
        await self.run(HttpRequestHeadersHook(flow))
        await self.run(HttpRequestHook(flow))

    async def answer(self, flow: http.HTTPFlow, response: http.Response | None = None) -> http.Response:
        """The response's hooks, with ``response`` as the backend's answer when given."""
        if response is not None:
            flow.response = response
        await self.run(HttpResponseHeadersHook(flow))
        await self.run(HttpResponseHook(flow))
        assert flow.response is not None
        return flow.response
