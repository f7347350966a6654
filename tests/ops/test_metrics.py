"""`/contextpaw/metrics` read as Prometheus reads it: parsed with prometheus_client's own parser,
through the addons on mitmproxy's test master; and the Grafana dashboard in docs/ against it."""

from __future__ import annotations

import asyncio
import json
import platform
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import http
from mitmproxy import version as mitmproxy_version
from mitmproxy.flow import Error
from mitmproxy.test import taddons
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from contextpaw import wire
from contextpaw.ops.evicted import MemoryStore
from contextpaw.ops.metrics import COUNTS, MODEL_LABELS, OUTCOMES, SOURCE_HELP, Stats, Where, package_version
from contextpaw.proxy.compose import make_addons
from support.flows import CLOSED_PORT, get, long_chat, ok_json, post
from support.inprocess import Proxy

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"


LISTENER = socket.create_server(("127.0.0.1", 0))
"""Where the Ollama of these tests listens: it accepts connections (it answers) and closes them.
Bound once, at import: a port only chosen at import was bound minutes later, under xdist, and
another process had taken it meanwhile (CI, 2026-12-05)."""
PORT = LISTENER.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def listener_closed() -> Iterator[None]:
    yield
    LISTENER.close()


@pytest.fixture
async def proxy() -> AsyncIterator[Proxy]:
    """Ollama configured where something listens, llama-server where nothing does."""
    server = await asyncio.start_server(lambda reader, writer: writer.close(), sock=LISTENER.dup())
    addons = make_addons()
    with taddons.context(*addons) as tctx:
        proxy = Proxy(tctx, addons)
        tctx.configure(
            proxy.backends, contextpaw_ollama=[f"http://127.0.0.1:{PORT}"], contextpaw_llamacpp=[f"http://127.0.0.1:{CLOSED_PORT}"]
        )
        yield proxy
        await proxy.close()
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


def counted(family: Metric, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples that counted something (every known series is there from 0)."""
    return {labels: value for labels, value in samples(family, name).items() if value}


def new_stats() -> Stats:
    return Stats(MemoryStore(max_items=1, max_bytes=1, max_age_s=1))


def rendered(stats: Stats) -> dict[str, Metric]:
    """The page `/contextpaw/metrics` serves for these stats, parsed."""
    return {family.name: family for family in text_string_to_metric_families(generate_latest(stats.registry).decode())}


BOTH = [("ollama", "http://127.0.0.1:11434", True), ("llamacpp", "http://127.0.0.1:8080", False)]


async def test_counters_are_labelled_with_backend_route_and_model(proxy: Proxy) -> None:
    report = await compact(proxy, model="qwen3:8b")
    families = await scrape(proxy)
    labels = (("backend", "ollama"), ("model", "qwen3:8b"), ("route", "ollama.chat"))
    assert counted(families["contextpaw_requests"], "contextpaw_requests_total") == {labels: 1.0}
    assert counted(families["contextpaw_compacted"], "contextpaw_compacted_total") == {labels: 1.0}
    assert counted(families["contextpaw_evicted_tokens"], "contextpaw_evicted_tokens_total") == {labels: report["evicted_tokens"]}
    assert counted(families["contextpaw_original_tokens"], "contextpaw_original_tokens_total") == {labels: report["original_tokens"]}


async def test_each_compaction_is_observed_in_the_time_and_evicted_token_histograms(proxy: Proxy) -> None:
    first, second = await compact(proxy), await compact(proxy, model="other-model")
    families = await scrape(proxy)
    where = (("backend", "ollama"), ("route", "ollama.chat"))
    evicted = families["contextpaw_compaction_evicted_tokens"]
    assert counted(evicted, "contextpaw_compaction_evicted_tokens_count") == {where: 2.0}
    assert counted(evicted, "contextpaw_compaction_evicted_tokens_sum") == {where: first["evicted_tokens"] + second["evicted_tokens"]}
    buckets = {s.labels["le"]: s.value for s in evicted.samples if s.name.endswith("_bucket") and s.labels["route"] == "ollama.chat"}
    assert buckets["+Inf"] == 2.0 and list(buckets.values()) == sorted(buckets.values()), "cumulative buckets"
    below = [le for le, count in buckets.items() if le != "+Inf" and float(le) < min(first["evicted_tokens"], second["evicted_tokens"])]
    assert below and all(buckets[le] == 0 for le in below)
    seconds = families["contextpaw_compaction_seconds"]
    assert counted(seconds, "contextpaw_compaction_seconds_count") == {where: 2.0}
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
    assert counted(families["contextpaw_refused"], "contextpaw_refused_total") == {
        (("backend", "ollama"), ("model", "m"), ("route", "ollama.chat")): 1.0
    }
    assert counted(families["contextpaw_unreachable"], "contextpaw_unreachable_total") == {
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
        requests = counted(families["contextpaw_requests"], "contextpaw_requests_total")
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


# -- series from 0, bounded ------------------------------------------------------------------------------------


async def test_every_route_of_each_configured_backend_is_exported_at_0_from_the_first_scrape(proxy: Proxy) -> None:
    families = await scrape(proxy)
    for kind in wire.Kind:
        routes = wire.route_names(kind)
        assert routes
        for route in routes:
            where = (("backend", kind.value), ("model", "unknown"), ("route", route))
            for name in COUNTS:  # compacted / requests, refused / requests, evicted / original: 0 %, not nothing
                assert samples(families[f"contextpaw_{name}"], f"contextpaw_{name}_total")[where] == 0, (name, where)
            for outcome in OUTCOMES:
                timed = (("backend", kind.value), ("outcome", outcome), ("route", route))
                assert samples(families["contextpaw_request_duration_seconds"], "contextpaw_request_duration_seconds_count")[timed] == 0
            place = (("backend", kind.value), ("route", route))
            assert samples(families["contextpaw_compaction_seconds"], "contextpaw_compaction_seconds_count")[place] == 0
    requests = samples(families["contextpaw_requests"], "contextpaw_requests_total")
    assert {dict(labels)["route"] for labels in requests} == {route for kind in wire.Kind for route in wire.route_names(kind)}


def test_a_label_set_one_counter_has_is_in_every_counter_from_0() -> None:
    stats = new_stats()
    stats.add("requests", where=stats.where("ollama", "openai.chat", "qwen3"))
    families = rendered(stats)
    where = (("backend", "ollama"), ("model", "qwen3"), ("route", "openai.chat"))
    for name in COUNTS:
        assert samples(families[f"contextpaw_{name}"], f"contextpaw_{name}_total") == {where: 1.0 if name == "requests" else 0.0}


def test_the_series_stay_bounded_by_the_backends_routes_and_the_model_cap() -> None:
    stats = new_stats()
    stats.answering = BOTH
    for n in range(3 * MODEL_LABELS):
        for kind in wire.Kind:
            for route in wire.route_names(kind):
                stats.add("requests", where=stats.where(kind, route, f"model-{n}"))
                stats.proxied(stats.where(kind, route, f"model-{n}"), "unchanged", 1.0)
    families = rendered(stats)
    routes = sum(len(wire.route_names(kind)) for kind in wire.Kind)
    assert len(samples(families["contextpaw_requests"], "contextpaw_requests_total")) == routes * (MODEL_LABELS + 2), "+ other, unknown"
    timed = samples(families["contextpaw_request_duration_seconds"], "contextpaw_request_duration_seconds_count")
    assert len(timed) == routes * len(OUTCOMES), "no model label on a histogram"


# -- request time, the process, the build ----------------------------------------------------------------------


def latency(families: dict[str, Metric]) -> dict[tuple[str, str, str], float]:
    """(backend, route, outcome) -> requests timed, where any were."""
    counts = counted(families["contextpaw_request_duration_seconds"], "contextpaw_request_duration_seconds_count")
    return {(d["backend"], d["route"], d["outcome"]): value for labels, value in counts.items() for d in [dict(labels)]}


async def test_each_proxied_request_is_timed_from_its_start_to_its_answer_by_route_and_outcome(proxy: Proxy) -> None:
    long = post("/api/chat", {**long_chat(), "model": "m"}, port=PORT)
    long.request.timestamp_start = time.time() - 30  # it came in 30 s ago
    await proxy.send(long)
    await proxy.answer(long, ok_json({"message": {"role": "assistant", "content": "ok"}, "done": True}))
    small = post("/api/generate", {"model": "m", "prompt": "hi"}, port=PORT)
    await proxy.send(small)
    await proxy.answer(small, ok_json({"response": "ok", "done": True}))
    failing = post("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, port=PORT)
    await proxy.send(failing)
    await proxy.answer(failing, http.Response.make(500, b"{}", {"content-type": "application/json"}))
    broken = post("/api/generate", {"model": "m", "prompt": "hi"}, port=PORT)
    await proxy.send(broken)
    broken.error = Error("the connection was reset")
    await proxy.hook("error", broken)
    down = post("/v1/chat/completions", {"model": "m", "messages": []}, port=CLOSED_PORT)
    down.server_conn.state = down.server_conn.state.CLOSED
    await proxy.send(down)  # answered 502 before the fitting read it
    await proxy.answer(down)
    proxy.tctx.configure(proxy.compactor, contextpaw_policy="strict")
    refused = post("/api/chat", long_chat(), port=PORT)
    await proxy.send(refused)
    await proxy.answer(refused)
    families = await scrape(proxy)
    assert latency(families) == {
        ("ollama", "ollama.chat", "compacted"): 1.0,
        ("ollama", "ollama.generate", "unchanged"): 1.0,
        ("ollama", "openai.chat", "error"): 1.0,
        ("ollama", "ollama.generate", "error"): 1.0,
        ("llamacpp", "openai.chat", "error"): 1.0,
        ("ollama", "ollama.chat", "refused"): 1.0,
    }
    compacted = [s for s in families["contextpaw_request_duration_seconds"].samples if s.labels.get("outcome") == "compacted"]
    by_name = {(s.name, s.labels.get("le")): s.value for s in compacted if s.labels["route"] == "ollama.chat"}
    assert by_name[("contextpaw_request_duration_seconds_sum", None)] >= 30
    assert by_name[("contextpaw_request_duration_seconds_bucket", "20.0")] == 0
    assert by_name[("contextpaw_request_duration_seconds_bucket", "+Inf")] == 1


def test_a_request_time_falls_in_the_buckets_above_it() -> None:
    stats = new_stats()
    stats.proxied(stats.where("llamacpp", "llamacpp.completion"), "unchanged", 3.0)
    family = rendered(stats)["contextpaw_request_duration_seconds"]
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    assert buckets["0.05"] == buckets["2.5"] == 0 and buckets["5.0"] == buckets["600.0"] == buckets["+Inf"] == 1


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="prometheus_client reads the process from /proc")
async def test_the_process_and_the_build_are_exported(proxy: Proxy) -> None:
    families = await scrape(proxy)
    for name in ("process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds", "process_start_time_seconds"):
        assert name in families and families[name].samples[0].value > 0, name
    (info,) = families["contextpaw_build_info"].samples
    assert info.value == 1
    assert info.labels == {"version": package_version(), "mitmproxy": mitmproxy_version.VERSION, "python": platform.python_version()}


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


PROMQL_WORDS = {"and", "or", "unless", "bool", "offset"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a variable's `label_values(...)`) reads."""
    expr = re.sub(r"label_values\(\s*([^,)]*)[^)]*\)", r"\1", expr)  # the metric, not the label
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\$\w+", " ", expr)  # label matchers, ranges, variables
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    return {name for name in re.findall(r"\b[A-Za-z_:][A-Za-z0-9_:]*\b(?!\s*\()", expr) if name not in PROMQL_WORDS}


def fed() -> Stats:
    """Stats fed one request of each kind, at both backends, with every other addon's counters."""
    stats = new_stats()
    stats.answering = BOTH
    stats.sources.append(lambda: dict.fromkeys(SOURCE_HELP, 0.0))
    where = stats.where("ollama", "ollama.chat", "m")
    for name in COUNTS:
        stats.add(name, where=where)
    stats.compaction(where, 0.2, 500)
    for outcome in OUTCOMES:
        stats.proxied(where, outcome, 1.0)
    return stats


def exported(families: dict[str, Metric]) -> set[str]:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {name + suffix for name, family in families.items() for suffix in suffixes[family.type]}


def test_every_metric_the_dashboard_reads_is_exported() -> None:
    expressions = dashboard_expressions()
    assert len(expressions) >= 8
    assert metric_names('sum by (le, route) (rate(x_bucket{a="b"}[$__rate_interval])) and on (job) y') == {"x_bucket", "y"}
    named = {name for expr in expressions for name in metric_names(expr)}
    assert {"contextpaw_request_duration_seconds_bucket", "process_resident_memory_bytes", "contextpaw_backend_up"} <= named
    assert named <= exported(rendered(fed())), named - exported(rendered(fed()))
    labels = {label for expr in expressions for label in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)}
    assert {label.strip() for group in labels for label in group.split(",")} <= {"backend", "route", "model", "url", "le", "outcome"}


async def test_the_grafana_dashboard_queries_only_metrics_the_proxy_exports(proxy: Proxy) -> None:
    await compact(proxy)
    named = {name for expr in dashboard_expressions() for name in metric_names(expr)}
    assert named <= exported(await scrape(proxy)), named - exported(await scrape(proxy))


def test_the_dashboard_asks_for_its_prometheus_on_import_and_every_panel_queries_it() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    inputs = {given["name"]: given for given in dashboard.get("__inputs", [])}
    assert "DS_PROMETHEUS" in inputs, "Grafana's Import page asks for a data source only for an input"
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource" and inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    prometheus = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert len(panels) >= 10
    for panel in panels:
        assert panel.get("datasource") == prometheus, panel["title"]
        assert panel["targets"] and all(target.get("datasource", prometheus) == prometheus for target in panel["targets"]), panel["title"]
    for variable in dashboard["templating"]["list"]:
        assert variable["type"] != "query" or variable["datasource"] == prometheus, variable["name"]

    def sources(node: Any) -> Any:
        if isinstance(node, dict):
            if "datasource" in node:
                yield node["datasource"]
            for value in node.values():
                yield from sources(value)
        elif isinstance(node, list):
            for value in node:
                yield from sources(value)

    assert all(source == prometheus for source in sources(dashboard)), "no other data source, no ${datasource} left"
