"""The report: plots, the goals table (each measure beside its floor) and the markdown."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import bench_agent_loop
import measure_window_use

from sections import fuzz_cpu, pressure, sessions
from sections.common import REPO, console, pct
from sections.compaction import WINDOW_GOAL
from sections.loop_health import COMPACTION_CTX
from sections.overhead import OVERHEAD_GOAL, PATHS, STREAM_PATHS
from sections.scaling import SCALING_ROUNDS

README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"
"""Where --docs writes the goals table into docs/results.md."""
CEILING_SLACK = 0.02
"""A turn within this share of the prompt of its ceiling is at it (the last few tokens of a prompt are
evaluated again whatever is cached: llama-server re-evaluates the last token)."""


def plots(result: dict[str, Any], img: Path) -> list[str]:
    """Small PNGs for the sections that have data; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    made = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(img / name, dpi=72)
        plt.close(fig)
        made.append(name)

    if "small" in (over := result["overhead"]):
        fig, ax = plt.subplots(figsize=(6, 3))
        cases = [("small", over["small"]), ("1 MB", over["big"]), ("stream TTFB", {p: over["stream"][p]["ttfb"] for p in PATHS})]
        for j, p in enumerate(PATHS):
            width = 0.8 / len(PATHS)
            ax.bar([i + (j - (len(PATHS) - 1) / 2) * width for i in range(len(cases))], [c[p]["p50_ms"] for _, c in cases], width, label=p)
        ax.set_xticks(range(len(cases)), [c for c, _ in cases])
        ax.set_yscale("log")
        ax.set_ylabel("p50 latency, ms")
        ax.legend(fontsize=8)
        save(fig, "bench-overhead.png")
    if comp := result["compaction"].get("counters"):
        for name, key, label, scale in (
            ("bench-compaction.png", "ms", "time, ms", "log"),
            ("bench-window-use.png", "use", "final / budget", "linear"),
        ):
            fig, ax = plt.subplots(figsize=(6, 3.2))
            for counter, rows in comp.items():
                for kind, style in (("chat", "-"), ("prompt", "--")):
                    pts = [(r["tokens"], r[key]) for r in rows if r["kind"] == kind]
                    ax.plot(*zip(*pts), style, marker=".", label=f"{counter} {kind}")
            ax.set_xscale("log")
            ax.set_yscale(scale)
            ax.set_xlabel("conversation tokens")
            ax.set_ylabel(label)
            if key == "use":
                ax.axhline(WINDOW_GOAL, color="grey", lw=0.8)
            ax.legend(fontsize=7, ncol=2)
            save(fig, name)
    if turns := result["agent_loop"].get("turns"):
        fig, ax = plt.subplots(figsize=(6, 3))
        labels = {
            "contextpaw": "ContextPaw (sticky plan)",
            "baseline": "from scratch each turn",
            "uncut": "uncut, window holds all (ceiling)",
        }
        for path, label in labels.items():
            if path in turns[0]:
                ax.plot([r["turn"] for r in turns], [r[path]["cached"] for r in turns], marker=".", label=label)
        ax.axhline(bench_agent_loop.CACHE_GOAL, color="grey", lw=0.8)
        ax.set_xlabel("turn")
        ax.set_ylabel("prompt served from cache")
        ax.legend(fontsize=8)
        save(fig, "bench-agent-loop.png")
    for loop in result.get("agent_loops") or []:  # per window: reuse per turn against the ceiling
        if table := loop.get("table"):
            name = f"agent-loop-{table['window']}.png"
            bench_agent_loop.plot(loop, img / name)
            made.append(name)
    return made


def goals(result: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """Issue 29's table from one run: (measure, floor, ContextPaw, goal, met), each beside its floor
    (bare mitmdump, direct, or the uncut ceiling) as measured in the same run; a goal not met says
    the measured reason."""
    rows: list[tuple[str, str, str, str, str]] = []

    def met(ok: bool | None) -> str:
        return "-" if ok is None else ("met" if ok else "not met")

    over = result.get("overhead", {})
    if "small" in over:
        bare, paw, plain = (over["small"][p] for p in ("mitmdump", "ContextPaw", "ContextPaw, no relay"))
        ratio = paw["req_per_s"] / bare["req_per_s"]
        plain_ratio = plain["req_per_s"] / bare["req_per_s"]
        relay = (
            f"{paw['p50_ms'] - bare['p50_ms']:+.2f} ms p50 over bare mitmdump, in ContextPaw's hooks; the relay's share "
            f"{paw['p50_ms'] - plain['p50_ms']:+.2f} ms (a buffered request is sent from the request hook; relay off: {plain_ratio:.2f}x)"
        )
        rows.append(
            (
                "small fitting POST, c=1",
                f"{bare['req_per_s']:.0f} req/s, p50 {bare['p50_ms']:.2f} ms",
                f"{paw['req_per_s']:.0f} req/s ({ratio:.2f}x), p50 {paw['p50_ms']:.2f} ms",
                "≥ 0.9x",
                "met" if ratio >= 0.9 else f"not met: {relay}",
            )
        )
        rows.append(
            (
                "the relay's share (c=1, relay off vs on; a buffered request does not take its hop)",
                f"no relay: {plain['req_per_s']:.0f} req/s ({plain_ratio:.2f}x), p50 {plain['p50_ms']:.2f} ms",
                f"relay: {paw['p50_ms'] - plain['p50_ms']:+.2f} ms p50",
                "reported",
                "-",
            )
        )
        floor = over["verdict"].get("streaming_floor_ttfb_p50_vs_direct_ms")
        ours = over["verdict"]["stream_ttfb_p50_vs_direct_ms"]
        rows.append(
            (
                "first streamed record over direct, p50",
                "-" if floor is None else f"{floor:+.2f} ms (mitmdump streaming)",
                f"{ours:+.2f} ms",
                "≤ floor + 1 ms",
                "-"
                if floor is None
                else "met"
                if ours <= floor + 1
                else f"not met: {ours - floor:+.2f} ms over the floor, through the relay",
            )
        )
    if health := result.get("loop_health"):
        bare, paw = health["mitmdump"], health["ContextPaw"]
        ratio = paw["c8_req_per_s"] / bare["c8_req_per_s"]
        plain = health.get("ContextPaw, no relay")
        why = (
            f"ContextPaw's hooks (the CPU row); relay off: {plain['c8_req_per_s'] / bare['c8_req_per_s']:.2f}x"
            if plain
            else relay
            if "small" in over
            else "see the CPU row"
        )
        rows.append(
            (
                "small fitting POST, c=8",
                f"{bare['c8_req_per_s']:.0f} req/s",
                f"{paw['c8_req_per_s']:.0f} req/s ({ratio:.2f}x)",
                "≥ 0.9x",
                "met" if ratio >= 0.9 else f"not met: {why}",
            )
        )
        if "cpu_ms_per_request" in paw:
            cost = paw["cpu_ms_per_request"] / bare["cpu_ms_per_request"]
            hooks = health.get("hooks") or {}
            exchange = (
                f"; the exchange with the backend in Upstream.request {hooks['exchange_us'] / 1000:.2f} ms, in place of "
                "mitmproxy's own upstream leg"
                if "exchange_us" in hooks
                else ""
            )
            own = f"; ContextPaw's hooks {hooks['total_us'] / 1000:.2f} ms of it" if hooks else ""
            relay = (
                f"; the relay's share {paw['cpu_ms_per_request'] - plain['cpu_ms_per_request']:.2f} ms of it (relay off: "
                f"{plain['cpu_ms_per_request'] / bare['cpu_ms_per_request']:.2f}x)"
                if plain
                else ""
            )
            rows.append(
                (
                    "proxy CPU per request at c=8",
                    f"{bare['cpu_ms_per_request']:.2f} ms",
                    f"{paw['cpu_ms_per_request']:.2f} ms ({cost:.2f}x{own})",
                    "≤ 1.11x (that is 0.9x throughput)",
                    "met"
                    if cost <= 1 / 0.9
                    else f"not met: {paw['cpu_ms_per_request'] - bare['cpu_ms_per_request']:.2f} ms more"
                    + (f", {hooks['total_us'] / 1000:.2f} ms of it in our hooks" if hooks else "")
                    + exchange
                    + relay,
                )
            )
        rows.append(
            (
                f"worst small-request latency during one {health['compaction_tokens'] // 1000}k/{health['compaction_messages']} compaction",
                f"{bare['worst_during_big_request_ms']:.1f} ms",
                f"{paw['worst_during_big_request_ms']:.1f} ms",
                "≤ 10 ms, and within 1.5x of bare",
                stall_verdict(paw["worst_during_big_request_ms"], bare["worst_during_big_request_ms"]),
            )
        )
        rows.append(
            (
                "worst small-request latency while idle",
                f"{bare['worst_idle_ms']:.1f} ms",
                f"{paw['worst_idle_ms']:.1f} ms",
                "no cause of ours",
                met(paw["worst_idle_ms"] <= max(10.0, 1.5 * bare["worst_idle_ms"])),
            )
        )
        steps = health.get("rss_by_import") or []
        where = ", ".join(f"{b['step'].lstrip('+ ')} {b['rss_mib'] - a['rss_mib']:+.1f}" for a, b in zip(steps, steps[1:]))
        rows.append(
            (
                "RSS after the run",
                f"{bare['rss_mib']:.0f} MiB",
                f"{paw['rss_mib']:.0f} MiB" + (f" (imports alone, MiB: {where})" if where else ""),
                "say where it goes",
                "-",
            )
        )
    if scale := result.get("scaling"):
        grown = [r["per_doubling"] for r in scale["rows"] if "per_doubling" in r]
        sizes = " / ".join(f"{r['messages']:,}" for r in scale["rows"])
        rows.append(
            (
                f"engine, {scale['tokens'] // 1000}k tokens at {sizes} messages",
                "-",
                " / ".join(f"{r['ms']:.0f}" for r in scale["rows"]) + " ms; per doubling " + ", ".join(f"{g:.2f}x" for g in grown),
                "≤ 2.2x per doubling",
                met(all(g <= 2.2 for g in grown)),
            )
        )
    for loop in result.get("agent_loops") or [result.get("agent_loop", {})]:
        if table := loop.get("table"):
            gaps = [
                r
                for r in loop["turns"]
                if "failed" not in r["contextpaw"]
                and "ceiling" in r
                and table["first_compacted_turn"] is not None
                and r["turn"] >= table["first_compacted_turn"]
                and r["contextpaw"]["cached"] < r["ceiling"] - CEILING_SLACK
            ]
            rows.append(
                (
                    f"agent loop on real llama-server ({table['turns']} turns, -c {table['window']}), prompt from cache",
                    f"ceiling (all but what each turn adds): {pct(table['ceiling_mean'])} mean, {pct(table['ceiling_worst'])} worst",
                    f"{pct(table['reuse_mean'])} mean, {pct(table['reuse_worst'])} worst; {table['recut_turns']} re-cut turns at "
                    f"{pct(table['recut_reuse_mean'])} against {pct(table['recut_ceiling_mean'])}",
                    "every turn at its ceiling",
                    "met" if not gaps else f"not met: {len(gaps)} turns below; {recut_reasons(gaps)}",
                )
            )
    if prefix := result.get("prefix"):
        for w in prefix["windows"]:
            unnoted = sum(1 for c in w["recuts"] if c["before_last_marker"] and not c["earlier_cut_noted"])
            noted = sum(1 for c in w["recuts"] if c["before_last_marker"] and c["earlier_cut_noted"])
            rows.append(
                (
                    f"prefix through the last marker, turn to turn (engine, {prefix['turns']} turns, {w['window'] // 1024}k)",
                    f"ceiling {pct(w['ceiling_mean'])} mean",
                    f"reuse {pct(w['reuse_mean'])} mean, {w['recut_turns']} re-cuts, "
                    f"{noted} before the last marker (the budget forced it, noted)",
                    "identical unless the budget forces a cut (noted)",
                    "met" if unnoted == 0 else f"not met: {unnoted} unnoted",
                )
            )
    if chats := result.get("growing_chat"):
        rows += growing_chat_rows(chats)
    use = result.get("window_use_through", {}).get("summary") or {}
    for path, label in (
        ("llama-server", "llama-server's counts"),
        ("ollama /api/chat", "calibrated shape count, Ollama /api/chat"),
        ("ollama /v1", "calibrated estimate, Ollama /v1 (no truncate: false)"),
        ("ollama /v1, model file read", "the model's tokenizer from the GGUF Ollama names, Ollama /v1"),
    ):
        if (u := use.get(path)) and u["measured"]:
            rows.append(
                (
                    f"real-token window use, {label} (the server's count of what was sent / budget)",
                    "-",
                    f"{u['min']:.1%} to {u['max']:.1%}, mean {u['mean']:.1%} over {u['measured']} chats",
                    f"≥ {u['goal']:.0%}, never over 100%",
                    "met"
                    if u["met"]
                    else f"not met: {u['below_goal']} below, {u['over_100']} over 100%"
                    + "".join(f"; {why}" for why in u.get("shortfalls", [])),
                )
            )
    rows += pressure.goals(result)
    if f := result.get("fuzz_cpu"):
        rows += fuzz_cpu.goals(f)
    if s := result.get("sessions"):
        rows += sessions.goals(s)
    return rows


def recut_reasons(gaps: list[dict[str, Any]]) -> str:
    """Why the turns below their ceiling fell short, counted: a re-cut after the last marker (what
    follows the changed message is evaluated again), one the budget forced before it (the report
    notes it), one before it not noted; and the worst turn."""
    details = [t.get("recut_detail") or {} for t in gaps]
    after = sum(1 for d in details if d and not d.get("before_last_marker") and not d.get("earlier_cut_noted"))
    forced = sum(1 for d in details if d.get("earlier_cut_noted"))
    unnoted = sum(1 for d in details if d and d.get("before_last_marker") and not d.get("earlier_cut_noted"))
    worst = min(gaps, key=lambda t: t["contextpaw"]["cached"])
    return (
        f"{after} re-cut after the last marker (what follows the change is evaluated again), {forced} forced "
        f"before it by the budget (noted), {unnoted} before it unnoted, {len(gaps) - after - forced - unnoted} other; "
        f"worst turn {worst['turn']}: {pct(worst['contextpaw']['cached'])} of {pct(worst['ceiling'])}"
    )


def stall_verdict(ours_ms: float, bare_ms: float) -> str:
    """The stall goal (at most 10 ms, and within 1.5x of bare mitmdump), with the reason when missed."""
    within = ours_ms <= 1.5 * bare_ms
    if within and ours_ms <= 10:
        return "met"
    if within:
        return f"met within 1.5x of bare; not ≤ 10 ms: bare mitmdump itself stalls {bare_ms:.1f} ms relaying the same body"
    return "not met"


def growing_chat_rows(chats: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """One row per window of scripts/bench/bench_growing_chat.py: every turn answered, the markers'
    worst share of a prompt, merges against re-cuts, and what each turn re-reads beside the least."""
    rows = []
    for window in sorted({c["window"] for c in chats["chats"]}):
        runs = [c for c in chats["chats"] if c["window"] == window]
        turns = sum(c["turns"] for c in runs)
        answered = sum(c["answered"] for c in runs)
        worst = max(runs, key=lambda c: c["marker_share_worst"])
        over = [c for c in runs if c["marker_share_worst"] > 0.05]
        rare = [c for c in runs if c["merges"] * 10 > max(c["recuts"], 1)]
        shares = f"{pct(min(c['share'] for c in runs))} to {pct(max(c['share'] for c in runs))}"
        reeval = ", ".join(f"{pct(c['reeval_per_turn'])} vs {pct(c['least_per_turn'])}" for c in runs)
        missed = [f"{turns - answered} turns refused"] if answered < turns else []
        missed += (
            [f"markers over 5% at messages of {', '.join(pct(c['share']) for c in over)} (worst {pct(worst['marker_share_worst'])})"]
            if over
            else []
        )
        missed += [f"merges more often than one a ten re-cuts at messages of {', '.join(pct(c['share']) for c in rare)}"] if rare else []
        rows.append(
            (
                f"growing chat, engine, {window:,} tokens, messages of {shares} of it, {runs[0]['turns']} turns",
                f"re-read a turn, least any cut could: {reeval}",
                f"{answered} of {turns} turns answered; markers at most {pct(worst['marker_share_worst'])} of a prompt; "
                f"merges {sum(c['merges'] for c in runs)} in {sum(c['recuts'] for c in runs)} re-cut turns",
                "every turn answered, markers <= 5% of every prompt, a merge at most once a ten cuts",
                "met" if not missed else "not met: " + "; ".join(missed),
            )
        )
    return rows


def goals_table(result: dict[str, Any]) -> list[str]:
    lines = ["| measure | floor, same run | ContextPaw | goal | |", "|---|---|---|---|---|"]
    return lines + [f"| {' | '.join(row)} |" for row in goals(result)]


def reused_note(result: dict[str, Any]) -> str:
    """Which sections came from an earlier run (--reuse), and its date; nothing for a whole run."""
    reused = result.get("reused")
    return f"; {', '.join(reused['sections'])} from the run of {reused['date']}" if reused and reused["sections"] else ""


def markdown(result: dict[str, Any], images: list[str]) -> str:
    """The README fragment: one table per section, with the goals and the plots."""
    m = result["machine"]
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `scripts/bench/bench.py{' --quick' if result['quick'] else ''}` on {m['date']}: "
        f"{m['cpus']} CPUs (load {m['load_average'][0]:.1f} at start, shared machine), Python {m['python']}, "
        f"mitmproxy {m['mitmproxy']}{reused_note(result)}. Absolute numbers are this machine's; compare within a table.",
        "",
        "## Goals, side by side",
        "",
        *goals_table(result),
        "",
    ]

    def image(name: str) -> None:
        if name in images:
            lines.extend([f"![{name}](img/{name})", ""])

    def skipped(section: dict[str, Any]) -> bool:
        if "skipped" in section and isinstance(section["skipped"], str):
            lines.extend([f"Skipped: {section['skipped']}.", ""])
            return True
        return False

    over = result["overhead"]
    lines += ["## 1. Proxy overhead", ""]
    if not skipped(over):
        lines += [
            f"Fake llama-server on loopback, one keep-alive client, sequential; {over['rounds']} rounds in which the "
            f"paths take turns. Big body: {over['big_body_bytes'] / 1e6:.2f} MB that fits (nothing compacted). "
            f"Streams: {over['stream_chunk_delay_s'] * 1000:.0f} ms between tokens.",
            "",
            "| case | path | n | req/s | p50 ms | p99 ms |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for case, label in (("small", "small body"), ("big", "1 MB body")):
            for p in PATHS:
                s = over[case][p]
                lines.append(f"| {label} | {p} | {s['n']} | {s['req_per_s']:.0f} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} |")
        lines += ["", "| stream | n | TTFB p50 ms | TTFB p99 ms | whole p50 ms | events/s |", "|---|---:|---:|---:|---:|---:|"]
        for p in (q for q in STREAM_PATHS if q in over["stream"]):
            s = over["stream"][p]
            lines.append(
                f"| {p} | {s['ttfb']['n']} | {s['ttfb']['p50_ms']:.2f} | {s['ttfb']['p99_ms']:.2f} | "
                f"{s['total']['p50_ms']:.1f} | {'buffered' if s['events_per_s'] is None else f'{s["events_per_s"]:.0f}'} |"
            )
        v = over["verdict"]
        lines += [
            "",
            f"ContextPaw vs bare mitmdump (goal: within {OVERHEAD_GOAL:.0%}): small p50 {v['small']['p50_vs_mitmdump']:+.0%}, "
            f"req/s {v['small']['req_per_s_vs_mitmdump']:+.0%}; 1 MB p50 {v['big']['p50_vs_mitmdump']:+.0%}, "
            f"req/s {v['big']['req_per_s_vs_mitmdump']:+.0%}. Stream TTFB p50 vs direct: "
            f"{v['stream_ttfb_p50_vs_direct_ms']:+.2f} ms. Bare mitmdump buffers a response unless a hook streams "
            "it, so its TTFB is the whole stream.",
            "",
            f"ContextPaw's own exchange with the backend (on by default; it answers a backend that resets or hangs in "
            f"the caller's API) costs {v['small']['relay_p50_ms']:+.2f} ms p50 on a small body and "
            f"{v['big']['relay_p50_ms']:+.2f} ms on 1 MB (ContextPaw vs ContextPaw, relay off). These requests ask for a "
            "buffered answer, so they are sent from the request hook; a request that may stream takes the relay's "
            "loopback hop.",
            "",
            f"Of ContextPaw's time, asking llama-server to count (`/tokenize` for new texts, "
            f"`/v1/chat/completions/input_tokens` to check every chat): {over['contextpaw_counting']['calls']} calls, "
            f"{over['contextpaw_counting']['ms_per_request']:.2f} ms per request on average.",
            "",
        ]
        image("bench-overhead.png")

    comp = result["compaction"]
    lines += ["## 2. Compaction cost", ""]
    if not skipped(comp):
        h = comp["headline"]
        lines += [
            f"Each conversation compacted into a quarter of its size (at least 1k); median of {comp['repeat']} runs, "
            f"peak traced memory of one. Headline: {h['tokens']:,} tokens in {h['messages']} messages into 32k: "
            f"{h['ms']:.0f} ms, {h['peak_mib']:.1f} MiB.",
            "",
            "| counter | kind | tokens | budget | final | use | ms | peak MiB |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, rows in comp["counters"].items():
            for r in rows:
                lines.append(
                    f"| {name} | {r['kind']} | {r['tokens']:,} | {r['budget']:,} | {r['final']:,} | {r['use']:.1%} | "
                    f"{r['ms']:.1f} | {r['peak_mib']:.1f} |"
                )
        if "tokenizer_load_s" in comp:
            lines += ["", f"Loading the SmolLM2 tokenizer from its GGUF: {comp['tokenizer_load_s']:.2f} s (once per process)."]
        if counts := comp.get("backend_counting"):
            lines += [
                "",
                "Fetching llama-server's counts (`/tokenize` per text, template measured once):",
                "",
                "| tokens | distinct texts | first call ms | cached ms |",
                "|---:|---:|---:|---:|",
            ]
            lines += [f"| {c['size']:,} | {c['texts']} | {c['uncached_ms']:.0f} | {c['cached_ms']:.1f} |" for c in counts]
        for name, why in comp["skipped"].items():
            lines.append(f"\nCounter {name} skipped: {why}.")
        lines.append("")
        image("bench-compaction.png")

    use = result["window_use"]
    lines += ["## 3. Window use", ""]
    if not skipped(use):
        lines += [
            f"Final tokens / budget over the sweep's cases that overflowed, goal at least {use['goal']:.0%}.",
            "",
            "| counter/kind | min | mean | max |",
            "|---|---:|---:|---:|",
        ]
        lines += [f"| {k} | {v['min']:.1%} | {v['mean']:.1%} | {v['max']:.1%} |" for k, v in use["by_counter"].items()]
        lines += ["", f"Below the goal: {', '.join(use['below_goal']) or 'none'}.", ""]
        if real := result.get("real_window_use", {}).get("rows"):
            lines += [
                "In real tokens: agent chats compacted into a quarter of their size with the estimate, raw and "
                f"calibrated on five other chats by llama-server's counts (factor {result['real_window_use']['factor']:.2f}), "
                "and with llama-server's per-text counts, "
                "then what was sent counted by llama-server (over 100% would overflow the window):",
                "",
                "| counter | chat tokens | budget | real tokens sent | use |",
                "|---|---:|---:|---:|---:|",
                *(f"| {r['counter']} | {r['tokens']:,} | {r['budget']:,} | {r['real_tokens']:,} | {r['use']:.1%} |" for r in real),
                "",
            ]
        image("bench-window-use.png")
    if (through := result.get("window_use_through", {})).get("rows"):
        lines += [
            "### Real tokens through ContextPaw",
            "",
            "`scripts/bench/measure_window_use.py`: agent chats four times the window sent through ContextPaw to a real "
            "llama-server, and to the Ollama simulator over it (the calibrated estimate); the server's count of what "
            "it was sent over the budget.",
            "",
            measure_window_use.table(through),
            "",
        ]
    if rows := result.get("agent_sessions", {}).get("rows"):
        columns = list(rows[0])
        lines += [
            "### Agent sessions: what the model sees",
            "",
            "`scripts/bench/agent_sessions.py`: Claude Code, Codex, opencode and Qwen Code each read twelve 20-40 KB files, one a "
            "turn, with their own tools, on a scripted model with a 32,768-token window that cuts in silence like "
            "Ollama or refuses like llama-server; direct and through ContextPaw, with and without the model's "
            "tokenizer. Re-eval is the share of each prompt the server evaluates again; least, the share the turn's "
            "new messages take (what any cut must evaluate, set beside the sessions that die direct).",
            "",
            "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns),
            *("| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows),
            "",
        ]
    for loop in result.get("agent_loops", []):
        if table := loop.get("table"):
            lines += [
                f"### Agent loop at -c {table['window']}: reuse per turn against its ceiling",
                "",
                f"{table['turns']} turns; first cut at turn {table['first_compacted_turn']}; after it, reuse "
                f"{pct(table['reuse_mean'])} mean ({pct(table['reuse_worst'])} worst) against a ceiling of "
                f"{pct(table['ceiling_mean'])} ({pct(table['ceiling_worst'])} worst); {table['recut_turns']} re-cut turns.",
                "",
                *(
                    f"- turn {c['turn']}: {pct(c['reuse'])} of {pct(c['ceiling'])}"
                    + (f"; message {c['first_difference']} first differs: {c['why']}" if c.get("why") else "")
                    for c in table["recuts"]
                ),
                "",
                f"![agent loop -c {table['window']}](img/agent-loop-{table['window']}.png)",
                "",
            ]

    loop = result["agent_loop"]
    lines += ["## 4. Prefix-cache reuse in an agent loop", ""]
    if not skipped(loop):
        lines += [
            f"{len(loop['turns'])} turns, SmolLM2-135M on llama-server -c {loop['n_ctx']} -np 1, max_tokens "
            f"{bench_agent_loop.MAX_TOKENS}; per turn `timings.cache_n / (cache_n + prompt_n)`. Baseline: `compact_chat` "
            "without the previous plan, same counter and budget, sent straight to an identical server. Uncut: "
            f"the same turns to a server with -c {loop.get('uncut_ctx', '-')}, nothing cut: what each turn adds "
            "is evaluated on every path, so this is the ceiling. Figures over the turns after ContextPaw's "
            f"first compaction; goals: mean ≥ {loop['goal']:.0%}, no turn under {loop.get('turn_floor', 0.75):.0%}.",
            "",
            f"| path | first compacted turn | turns after | mean cached | min cached | turns ≥ {loop['goal']:.0%} | "
            f"turns < {loop.get('turn_floor', 0.75):.0%} | tokens evaluated | tokens from cache |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for path, s in loop["summary"].items():
            if path == "ceiling":
                after = loop["summary"]["contextpaw"]["turns_after"]
                lines.append(
                    f"| ceiling in this window (ContextPaw's prompt less what the turn adds) | - | {after} | "
                    f"{pct(s['mean_cached'])} | {pct(s['min_cached'])} | {s['turns_at_goal']}/{after} | "
                    f"{s['turns_under_floor']}/{after} | - | - |"
                )
                continue
            lines.append(
                f"| {path} | {s['first_compacted_turn'] or '-'} | {s['turns_after']} | {pct(s['mean_cached'])} | "
                f"{pct(s['min_cached'])} | {s['turns_at_goal']}/{s['turns_after']} | "
                f"{s.get('turns_under_floor', '-')}/{s['turns_after']} | {s['evaluated_tokens']:,} | "
                f"{s['cached_tokens']:,} |"
            )
        paths = [p for p in bench_agent_loop.PATHS if p in loop["turns"][0]]
        lines += [
            "",
            "| turn | budget | " + " | ".join(f"{p} cache_n / prompt_n" for p in paths) + " |",
            "|---:|---:|" + "---:|" * len(paths),
        ]
        for r in loop["turns"]:
            cells = " | ".join(f"{r[p]['cache_n']} / {r[p]['prompt_n']} ({r[p]['cached']:.0%})" for p in paths)
            lines.append(f"| {r['turn']}{'*' if r['contextpaw']['compacted'] else ''} | {r['budget']} | {cells} |")
        lines += ["", "\\* compacted by ContextPaw.", ""]
        image("bench-agent-loop.png")

    rec = result["recall"]
    lines += ["## 5. Recall", ""]
    if not skipped(rec):
        lines += ["| script | path | recalled | exit |", "|---|---|---:|---:|"]
        for name, r in rec.items():
            for path, (k, n) in r["recalled"].items() or [("-", ("-", "-"))]:
                lines.append(f"| {name} | {path} | {k}/{n} | {r['exit']} |")
        for name, r in rec.items():
            if r["table"]:
                lines += ["", f"{name}:", "", *r["table"]]
        lines.append("")
    if health := result.get("loop_health"):
        lines += [
            "## 6. Concurrency, stalls and memory",
            "",
            f"One fake llama-server (window {COMPACTION_CTX:,}); {health['clients']} clients sending small fitting "
            f"chats for {health['seconds']:g} s; a small request every 10 ms while idle and while one "
            f"{health['compaction_tokens']:,}-token, {health['compaction_messages']}-message chat goes through "
            "(compacted by ContextPaw, relayed by bare mitmdump).",
            "",
            "| path | c=8 req/s | worst idle ms | worst during the big request ms | RSS MiB |",
            "|---|---:|---:|---:|---:|",
        ]
        for name in ("mitmdump", "ContextPaw"):
            h = health[name]
            lines.append(
                f"| {name} | {h['c8_req_per_s']:.0f} | {h['worst_idle_ms']:.1f} | {h['worst_during_big_request_ms']:.1f} | {h['rss_mib']:.0f} |"
            )
        lines += ["", f"c=8 ContextPaw vs bare mitmdump: {health['verdict']['c8_vs_mitmdump']:.2f}x (goal 0.9x).", ""]
        lines += [
            "| path | proxy CPU per request at c=8, ms |",
            "|---|---:|",
            *(
                f"| {name} | {health[name].get('cpu_ms_per_request', float('nan')):.2f} |"
                for name in ("mitmdump", "ContextPaw", "ContextPaw, no relay")
                if name in health
            ),
            "",
        ]
        if hooks := health.get("hooks"):
            lines += [
                f"ContextPaw's own CPU in its hooks, {hooks['requests']} small fitting requests one at a time "
                f"(scripts/bench/hook_timing.py): {hooks['total_us']:.0f} µs per request"
                + (
                    f", and {hooks['exchange_us']:.0f} µs in Upstream.request's exchange with the backend "
                    "(mitmproxy's own upstream leg does that work on the bare path)."
                    if "exchange_us" in hooks
                    else "."
                ),
                "",
                "| hook | calls | mean µs |",
                "|---|---:|---:|",
                *(f"| {name} | {h['n']} | {h['mean_us']:.1f} |" for name, h in hooks["by_hook"].items()),
                "",
            ]
        if steps := health.get("rss_by_import"):
            lines += [
                "RSS of a fresh interpreter after each step of imports (before any request):",
                "",
                "| imports | RSS MiB |",
                "|---|---:|",
                *(f"| {r['step']} | {r['rss_mib']:.1f} |" for r in steps),
                "",
            ]
        if handoff := health.get("process_handoff"):
            lines += [
                f"A process for the big compaction instead of the worker thread: pickling the parsed request there and "
                f"back costs {handoff['pickle_request_ms']:.1f} ms and the fitted result {handoff['pickle_result_ms']:.1f} ms, "
                f"against {handoff['parse_ms']:.1f} ms to parse and {handoff['fit_ms']:.1f} ms to fit "
                f"({handoff['body_bytes'] / 1e6:.2f} MB body).",
                "",
            ]
    if scale := result.get("scaling"):
        lines += [
            "## 7. The engine at 1,200 to 10,000 messages",
            "",
            f"{scale['tokens']:,} tokens compacted into {scale['budget']:,} with the estimate; each size's fastest of "
            f"{scale.get('rounds', SCALING_ROUNDS)} runs, the sizes taking turns (the median beside it).",
            "",
            "| messages | ms | median ms | growth per doubling |",
            "|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['messages']:,} | {r['ms']:.0f} | {r.get('median_ms', r['ms']):.0f} | "
            + (f"{r['per_doubling']:.2f}x |" if "per_doubling" in r else "|")
            for r in scale["rows"]
        ]
        lines.append("")
    if "burst" in result or "big_answer" in result:
        lines += pressure.markdown(result)
    if f := result.get("fuzz_cpu"):
        lines += fuzz_cpu.markdown(f)
    if s := result.get("sessions"):
        lines += sessions.markdown(s)
    return "\n".join(lines)


def report(result: dict[str, Any], out: Path, docs: bool) -> int:
    """Plots and markdown for a result; with `docs`, into docs/benchmarks.md and docs/img/, and the
    goals table into docs/results.md (the README links there)."""
    images = plots(result, out / "img")
    text = markdown(result, images)
    (out / "bench.md").write_text(text)
    console.print("\n".join(goals_table(result)))
    if docs:
        (REPO / "docs" / "img").mkdir(parents=True, exist_ok=True)
        (REPO / "docs" / "benchmarks.md").write_text(text)
        (REPO / "docs" / "bench.json").write_text(json.dumps(result, indent=2))  # what a later --reuse starts from
        readme = REPO / "docs" / "results.md"
        before, start, rest = readme.read_text().partition(README_START)
        _, end, after = rest.partition(README_END)
        if start and end:
            m = result["machine"]
            made = f"From `scripts/bench/bench.py --docs` on {m['date']} ({m['cpus']} CPUs, Python {m['python']}, mitmproxy {m['mitmproxy']}){reused_note(result)}:"
            readme.write_text(before + start + "\n" + made + "\n\n" + "\n".join(goals_table(result)) + "\n" + end + after)
        for name in images:
            shutil.copy(out / "img" / name, REPO / "docs" / "img" / name)
    print(text)
    return 0
