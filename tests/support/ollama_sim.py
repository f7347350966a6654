"""A faithful Ollama simulator over a real, already running llama-server.

Ollama (v0.30 and later) drives llama-server itself, so the simulator is Ollama's HTTP surface
(:func:`support.fake_ollama.ollama_app`) with an engine that does what Ollama asks of its
runner: render through the model's own template (``/apply-template``), count with ``/tokenize``, and
generate from the truncated token list with ``/completion``. ``prompt_eval_count`` is the server's
``cache_n + prompt_n``, so it counts what the model really saw.

One llama-server cannot be restarted per window the way Ollama relaunches its runner, so each
request's ``num_ctx`` is enforced here and capped to the server's per-slot window, which
``/api/show`` then reports as the model's context length.

Run: ``PYTHONPATH=tests python -m support.ollama_sim --upstream http://127.0.0.1:8080 --port 11434``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
from aiohttp import web

from .common import serve
from .fake_ollama import (
    Finish,
    ModelCard,
    OllamaError,
    OllamaSettings,
    ollama_app,
    ollama_arguments,
    ollama_settings,
)

# Ollama options that llama-server's /completion takes under the same name.
SAMPLING = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "seed",
    "stop",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
)


def _to_openai(message: dict[str, Any]) -> dict[str, Any]:
    """An Ollama message as llama-server's template expects it (tool arguments as a JSON string)."""
    converted = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        converted["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": json.dumps(c["function"].get("arguments", {})),
                },
            }
            for c in message["tool_calls"]
        ]
    return converted


class LlamaServerEngine:
    """The runner side of Ollama, delegated to llama-server over HTTP."""

    def __init__(self, upstream: str, architecture: str = "llama") -> None:
        self._upstream = upstream.rstrip("/")
        self._architecture = architecture  # llama-server does not report it
        self._session: aiohttp.ClientSession | None = None
        self._bos: bool | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "engine not opened"
        return self._session

    async def _call(self, method: str, path: str, payload: Any = None) -> Any:
        async with self.session.request(method, self._upstream + path, json=payload) as response:
            if response.status != 200:
                raise OllamaError(response.status, await response.text())
            return await response.json()

    async def open(self) -> ModelCard:
        # A fresh connection per call: llama-server drops idle keep-alive connections, and a
        # pooled one can be reused just as it closes ("Server disconnected").
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)
        )
        props = await self._call("GET", "/props")
        meta = (await self._call("GET", "/v1/models"))["data"][0]["meta"]
        n_params = meta["n_params"]
        return ModelCard(
            architecture=self._architecture,
            context_length=props["default_generation_settings"]["n_ctx"],
            embedding_length=meta["n_embd"],
            parameter_count=n_params,
            parameter_size=f"{n_params / 1e9:.1f}B" if n_params >= 1e9 else f"{n_params / 1e6:.0f}M",
            quantization_level="unknown",
            size=meta["size"],
            template=props.get("chat_template", ""),
            blob=props.get("model_path", ""),
        )

    async def close(self) -> None:
        await self.session.close()

    async def render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
        payload: dict[str, Any] = {"messages": [_to_openai(m) for m in messages]}
        if tools:
            payload["tools"] = tools
        return (await self._call("POST", "/apply-template", payload))["prompt"]

    async def tokenize(self, text: str, add_special: bool) -> list[int]:
        payload = {"content": text, "add_special": add_special, "parse_special": True}
        return (await self._call("POST", "/tokenize", payload))["tokens"]

    async def adds_bos(self) -> bool:
        if self._bos is None:
            self._bos = len(await self.tokenize("a", True)) > len(await self.tokenize("a", False))
        return self._bos

    async def generate(self, tokens: list[int], num_predict: int, options: dict[str, Any]) -> AsyncGenerator[str | Finish]:
        payload = {"prompt": tokens, "n_predict": num_predict, "stream": True, "cache_prompt": True}
        payload |= {key: options[key] for key in SAMPLING if key in options}
        async with self.session.post(self._upstream + "/completion", json=payload) as response:
            if response.status != 200:
                raise OllamaError(response.status, await response.text())
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[len(b"data: ") :])
                if "error" in event:
                    raise OllamaError(500, event["error"].get("message", "llama-server failed"))
                if event.get("content"):
                    yield event["content"]
                if event.get("stop"):
                    yield _finish(event)
                    return
        raise OllamaError(500, "model runner has unexpectedly stopped")


def _finish(event: dict[str, Any]) -> Finish:
    timings = event["timings"]
    return Finish(
        done_reason="length" if event.get("stop_type") == "limit" else "stop",
        prompt_eval_count=timings["cache_n"] + timings["prompt_n"],
        eval_count=timings["predicted_n"],
        prompt_eval_duration=round(timings["prompt_ms"] * 1e6),
        eval_duration=round(timings["predicted_ms"] * 1e6),
    )


DEFAULT_SETTINGS = OllamaSettings(model="smollm2:135m", num_ctx=2048)


def ollama_sim_app(upstream: str, settings: OllamaSettings = DEFAULT_SETTINGS) -> web.Application:
    """Ollama over the llama-server at ``upstream``; it must be up when the app starts."""
    return ollama_app(settings, LlamaServerEngine(upstream))


def main(argv: list[str] | None = None) -> None:
    parser = ollama_arguments("Ollama simulated over a running llama-server.", DEFAULT_SETTINGS.model, DEFAULT_SETTINGS.num_ctx)
    parser.add_argument("--upstream", required=True, help="base URL of the llama-server, e.g. http://127.0.0.1:8080")
    args = parser.parse_args(argv)
    serve(ollama_sim_app(args.upstream, ollama_settings(args)), args.port)


if __name__ == "__main__":
    main()
