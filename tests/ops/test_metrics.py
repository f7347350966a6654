"""`/contextpaw/metrics` read as Prometheus reads it: parsed with prometheus_client's own parser,
through the addons on mitmproxy's test master; and the Grafana dashboard in docs/ against it."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from mitmproxy.test import taddons
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from contextpaw.ops.evicted import MemoryStore
from contextpaw.ops.metrics import MODEL_LABELS, SOURCE_HELP, Stats, Where
from contextpaw.proxy.compose import make_addons
from support.common import free_port
from support.flows import CLOSED_PORT, get, long_chat, ok_json, post
from support.inprocess import Proxy

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"


PORT = free_port()
"""Where the Ollama of these tests listens: it accepts connections (it answers) and closes them."""


@pytest.fixture
async def proxy() -> AsyncIterator[Proxy]:
    """Ollama configured where something listens, llama-server where nothing does."""
    server = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", PORT)
    addons = make_addons()
    with taddons.context(*addons) as tctx:
        proxy = Proxy(tctx, addons)
        tctx.configure(
            proxy.backends, contextpaw_ollama=[f"http://127.0.0.1:{PORT}"], contextpaw_llamacpp=[f"http://127.0.0.1:{CLOSED_PORT}"]
        )
        yield proxy
    server.close()
    await server.wait_closed()


async def scrape(proxy: Proxy) -> dict[str, Metric]:
    flow = get("/contextpaw/metrics", port=PORT)
    await proxy.send(flow)
    assert flow.response.status_code == 200 and flow.response.headers["content-type"].startswith("text/plain")
    return {family.name: family for family in text_string_to_metric_families(flow.response.text)}


async def compact(proxy: Proxy, model: str = "m") -> dict[str, Any]:
    flow = post("/api/chat", {**long_chat(), "model": model}, port=PORT)
    await proxy.send(flow)
    response = await proxy.answer(flow, ok_json({"message": {"role": "assistant", "content": "ok"}, "done": True}))
    return json.loads(response.content)["contextpaw"]


def samples(family: Metric, name: str | None = None) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples if name is None or s.name == name}


async def test_counters_are_labelled_with_backend_route_and_model(proxy: Proxy) -> None:
    report = await compact(proxy, model="qwen3:8b")
    families = await scrape(proxy)
    labels = (("backend", "ollama"), ("model", "qwen3:8b"), ("route", "ollama.chat"))
    assert samples(families["contextpaw_requests"], "contextpaw_requests_total") == {labels: 1.0}
    assert samples(families["contextpaw_compacted"], "contextpaw_compacted_total") == {labels: 1.0}
    assert samples(families["contextpaw_evicted_tokens"], "contextpaw_evicted_tokens_total") == {labels: report["evicted_tokens"]}
    assert samples(families["contextpaw_original_tokens"], "contextpaw_original_tokens_total") == {labels: report["original_tokens"]}


async def test_each_compaction_is_observed_in_the_time_and_evicted_token_histograms(proxy: Proxy) -> None:
    first, second = await compact(proxy), await compact(proxy, model="other-model")
    families = await scrape(proxy)
    where = (("backend", "ollama"), ("route", "ollama.chat"))
    evicted = families["contextpaw_compaction_evicted_tokens"]
    assert samples(evicted, "contextpaw_compaction_evicted_tokens_count") == {where: 2.0}
    assert samples(evicted, "contextpaw_compaction_evicted_tokens_sum") == {where: first["evicted_tokens"] + second["evicted_tokens"]}
    buckets = {s.labels["le"]: s.value for s in evicted.samples if s.name.endswith("_bucket")}
    assert buckets["+Inf"] == 2.0 and list(buckets.values()) == sorted(buckets.values()), "cumulative buckets"
    below = [le for le, count in buckets.items() if le != "+Inf" and float(le) < min(first["evicted_tokens"], second["evicted_tokens"])]
    assert below and all(buckets[le] == 0 for le in below)
    seconds = families["contextpaw_compaction_seconds"]
    assert samples(seconds, "contextpaw_compaction_seconds_count") == {where: 2.0}
    assert 0 < samples(seconds, "contextpaw_compaction_seconds_sum")[where] < 30


async def test_the_up_gauge_says_which_backend_answers_at_each_scrape(proxy: Proxy) -> None:
    up = samples((await scrape(proxy))["contextpaw_backend_up"])
    assert up == {
        (("backend", "ollama"), ("url", f"http://127.0.0.1:{PORT}")): 1.0,
        (("backend", "llamacpp"), ("url", f"http://127.0.0.1:{CLOSED_PORT}")): 0.0,
    }


async def test_a_refusal_and_an_unreachable_backend_are_counted_with_their_labels(proxy: Proxy) -> None:
    proxy.tctx.configure(proxy.compactor, contextpaw_policy="strict")
    await proxy.send(post("/api/chat", long_chat(), port=PORT))
    down = post("/v1/chat/completions", {"model": "m", "messages": []}, port=CLOSED_PORT)
    down.server_conn.state = down.server_conn.state.CLOSED
    await proxy.send(down)
    families = await scrape(proxy)
    assert samples(families["contextpaw_refused"], "contextpaw_refused_total") == {
        (("backend", "ollama"), ("model", "m"), ("route", "ollama.chat")): 1.0
    }
    assert samples(families["contextpaw_unreachable"], "contextpaw_unreachable_total") == {
        (("backend", "llamacpp"), ("model", "unknown"), ("route", "openai.chat")): 1.0
    }


def test_the_model_label_keeps_the_first_models_and_counts_the_rest_as_other() -> None:
    stats = Stats(MemoryStore(max_items=1, max_bytes=1, max_age_s=1))
    for n in range(MODEL_LABELS + 5):
        stats.add("requests", where=stats.where("ollama", "ollama.chat", f"model-{n}"))
    stats.add("requests", where=stats.where("ollama", "ollama.chat", "model-0"))
    stats.add("requests", where=stats.where("ollama", "ollama.chat", "x" * 1000))
    models = {where.model: value for where, value in stats.series["requests"].items()}
    assert len(models) == MODEL_LABELS + 1 and models["other"] == 6 and models["model-0"] == 2
    assert stats.counts["requests"] == MODEL_LABELS + 7, "the totals keep every request"


MODEL_NAMES = {
    "m\ud800": "m\\ud800",  # a lone surrogate, as JSON's "\\ud800" gives it: UTF-8 cannot encode it
    "\udfff\ud83d": "\\udfff\\ud83d",
    'q"uote\\back\nline': 'q"uote\\back\nline',  # the exposition format escapes these itself
    "nul\x00": "nul\x00",
    "émoji 🐾 \u202eRTL": "émoji 🐾 \u202eRTL",
}


async def test_a_model_name_utf8_cannot_encode_leaves_the_page_answering_with_its_series_escaped(proxy: Proxy) -> None:
    for model in MODEL_NAMES:
        await compact(proxy, model=model)
    for _ in range(2):  # every scrape after it, not only the first
        families = await scrape(proxy)
        requests = samples(families["contextpaw_requests"], "contextpaw_requests_total")
        assert {dict(labels)["model"] for labels in requests} == set(MODEL_NAMES.values())


def test_every_label_is_encodable_utf8() -> None:
    stats = Stats(MemoryStore(max_items=1, max_bytes=1, max_age_s=1))
    where = stats.where("olla\ud800ma", "route\udc00", "m\ud800")
    assert where == Where("olla\\ud800ma", "route\\udc00", "m\\ud800")
    assert stats.where("ollama", "ollama.chat", "m\ud800").model in stats.models
    assert "x\ud800" * 40 not in stats.models and stats.where(None, None, "x\ud800" * 40).model == "other"


async def test_every_metric_has_a_help_text_that_explains_it(proxy: Proxy) -> None:
    families = await scrape(proxy)
    assert any(name.startswith("contextpaw_runtime_") for name in families)
    assert any(name.startswith("contextpaw_summarizer_") for name in families)
    for name, family in families.items():
        words = name.removeprefix("contextpaw_").replace("_", " ")
        assert family.documentation and family.documentation.lower() != words, name
        assert len(family.documentation.split()) >= 5, f"{name}: {family.documentation!r}"
    sourced = {name.removeprefix("contextpaw_") for name in families if name.startswith(("contextpaw_runtime_", "contextpaw_summarizer_"))}
    assert sourced == set(SOURCE_HELP), "every counter another addon reports has its help text"


# -- the dashboard --------------------------------------------------------------------------------------------


def dashboard_expressions() -> list[str]:
    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            for key in ("expr", "definition"):  # a panel's query, a variable's label_values(...)
                if isinstance(node.get(key), str):
                    yield node[key]
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    return list(walk(json.loads(DASHBOARD.read_text())))


async def test_the_grafana_dashboard_queries_only_metrics_the_collector_exports(proxy: Proxy) -> None:
    await compact(proxy)
    families = await scrape(proxy)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    exported = {name + suffix for name, family in families.items() for suffix in suffixes[family.type]}
    expressions = dashboard_expressions()
    assert len(expressions) >= 8
    named = {name for expr in expressions for name in re.findall(r"\bcontextpaw_[a-z0-9_]+", expr)}
    assert named and named <= exported, named - exported
    labels = {label for expr in expressions for label in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)}
    assert {label.strip() for group in labels for label in group.split(",")} <= {"backend", "route", "model", "url", "le"}
