"""The models Ollama holds on the GPU, through its HTTP API: what ``/api/ps`` lists, unloading them
with ``keep_alive: 0``, and what loading one will take.

ContextPaw never starts or stops Ollama: it loads models for any client, on the request, and the
arbiter only asks it to let them go. What a model held when last listed (``size_vram``) is the best
measure of what it will take again; before it was ever loaded, the GGUF file its Modelfile names is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp

from contextpaw.core.caches import LRU
from contextpaw.gpu.nvml import GpuProbe, NoVram, poll_until, sample
from contextpaw.gpu.placement import Release, SwitchFailed
from contextpaw.gpu.vram import estimate, read_shape
from contextpaw.wire.ollama import ollama_model_file, ollama_show_windows

OLLAMA_DEFAULT_CTX = 4096
"""The window Ollama loads a model with when neither its Modelfile nor the server's setting says."""
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=5)
UNLOAD_TIMEOUT = aiohttp.ClientTimeout(total=30)


class OllamaModels:
    """The Ollama at ``url``, on the proxy's HTTP session; ``release_timeout`` bounds how long an
    unloaded model may stay listed."""

    def __init__(
        self,
        url: str,
        session: Callable[[], aiohttp.ClientSession],
        gpu: GpuProbe,
        *,
        release_timeout: float,
        poll_interval: float,
    ) -> None:
        self.url = url
        self._session = session
        self.gpu = gpu
        self.release_timeout = release_timeout
        self.poll_interval = poll_interval
        self.last_bytes: int | None = None
        """What its models held on the GPU when last seen loaded (``/api/ps`` ``size_vram``)."""
        self._seen: LRU = LRU(64)
        """Model -> its ``size_vram`` when last listed."""
        self._estimates: LRU = LRU(64)
        """Model -> the estimate from the GGUF file its Modelfile names, or None."""

    async def listed(self) -> list[dict[str, Any]]:
        """What ``/api/ps`` lists; an Ollama that is not running holds no memory."""
        try:
            async with self._session().get(f"{self.url}/api/ps", timeout=PROBE_TIMEOUT) as response:
                response.raise_for_status()
                listed = (await response.json())["models"]
        except aiohttp.ClientConnectorError:
            return []
        except (aiohttp.ClientError, TimeoutError, KeyError) as error:
            raise SwitchFailed(f"Ollama /api/ps failed: {error!r}") from error
        return listed

    async def as_json(self) -> list[dict[str, Any]] | None:
        """The listed models for the status page; None when Ollama does not answer sensibly."""
        try:
            return [{"name": m.get("name"), "size_vram": m.get("size_vram")} for m in await self.listed()]
        except SwitchFailed:
            return None

    async def held(self) -> int:
        """Bytes the listed models hold on the GPU, remembered per model and in all for :meth:`need`."""
        listed = await self.listed()
        for model in listed:
            if model.get("size_vram"):
                self._seen.put(model.get("name"), model["size_vram"])
        size = sum(model.get("size_vram") or 0 for model in listed)
        if size:
            self.last_bytes = size
        return size

    async def need(self, model: str | None = None) -> int | None:
        """Bytes loading ``model`` will take: what it held when last listed, else the estimate from
        the GGUF file its Modelfile names (``/api/show``), else what the models held last; None when
        unknown (and without a model name, what the models held last)."""
        if model is None:
            return self.last_bytes
        if model not in self._estimates:
            self._estimates.put(model, await self._estimate(model))
        return self._seen.get(model) or self._estimates.get(model) or self.last_bytes

    async def _estimate(self, model: str) -> int | None:
        """What loading `model` will take, from the GGUF its Modelfile's FROM names (when this machine
        can read it) at its `num_ctx` (else Ollama's default 4096); None when it cannot be told."""
        try:
            async with self._session().post(f"{self.url}/api/show", json={"model": model}, timeout=PROBE_TIMEOUT) as response:
                response.raise_for_status()
                show = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        path, (ctx, _) = ollama_model_file(show), ollama_show_windows(show)
        if path is None:
            return None
        try:
            shape = await asyncio.to_thread(read_shape, path)
        except ValueError:
            return None
        return estimate(shape, ctx or OLLAMA_DEFAULT_CTX).total_bytes

    async def unload(self) -> Release | None:
        """Unload every listed model with ``keep_alive: 0`` and wait until none is listed; the
        expected release is what Ollama says they held on the GPU (``size_vram``)."""
        resident = await self.listed()
        if not resident:
            return None
        before = await sample(self.gpu)
        for model in resident:
            body = {"model": model["name"], "keep_alive": 0}
            try:
                async with self._session().post(f"{self.url}/api/generate", json=body, timeout=UNLOAD_TIMEOUT) as response:
                    response.raise_for_status()
            except (aiohttp.ClientError, TimeoutError) as error:
                raise SwitchFailed(f"Ollama refused to unload {model['name']}: {error!r}") from error

        async def unloaded() -> bool:
            return not await self.listed()

        if not await poll_until(unloaded, self.release_timeout, self.poll_interval):
            names = ", ".join(model["name"] for model in await self.listed())
            raise SwitchFailed(f"Ollama still lists {names} {self.release_timeout:g}s after unloading")
        if isinstance(before, NoVram):
            return None
        return Release(before.used_bytes, sum(model.get("size_vram") or 0 for model in resident))
