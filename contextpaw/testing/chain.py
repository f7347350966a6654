"""ContextPaw's addons in a `taddons` master, and a flow pushed through their hooks as mitmproxy would."""

from __future__ import annotations

from typing import Any

from mitmproxy import http
from mitmproxy.test import taddons

from contextpaw.addon import AdminEndpoints, Backends, Compactor
from contextpaw.arbitration import Arbitration


def _one(addons: list[Any], kind: type) -> Any:
    return next(a for a in addons if isinstance(a, kind))


class AddonChain:
    """The addons in hook order, each also reachable by its concern."""

    def __init__(self, tctx: taddons.context, addons: list[Any]) -> None:
        self.tctx = tctx
        self.addons = addons
        self.arbitration: Arbitration = _one(addons, Arbitration)
        self.admin: AdminEndpoints = _one(addons, AdminEndpoints)
        self.backends: Backends = _one(addons, Backends)
        self.compactor: Compactor = _one(addons, Compactor)

    async def hook(self, name: str, flow: http.HTTPFlow) -> None:
        for addon in self.addons:
            if hasattr(addon, name):
                result = getattr(addon, name)(flow)
                if hasattr(result, "__await__"):
                    await result

    async def send(self, flow: http.HTTPFlow) -> None:
        await self.hook("requestheaders", flow)
        await self.hook("request", flow)

    async def answer(self, flow: http.HTTPFlow, response: http.Response | None = None) -> http.Response:
        if response is not None:
            flow.response = response
        await self.hook("responseheaders", flow)
        await self.hook("response", flow)
        assert flow.response is not None
        return flow.response
