"""The real agent CLIs through long file-reading sessions, direct and through ContextPaw (issue 38).

For each agent (Claude Code, Codex, opencode, Qwen Code) x backend behaviour (``ollama``: cuts in
silence; ``llamacpp``: 400 on overflow) x tokenizer (on Ollama: with the model's GGUF readable, or with none,
so ContextPaw estimates; llama-server always counts with its own): one session straight at the
scripted model (tests/support/scripted_model.py) and one through ContextPaw (mitmdump with
contextpaw_addon.py in reverse mode, recorders on both sides: ``support.agents.start_contextpaw_stack``).

Each session runs in a scratch project of N generated files of 20-40 KB, each holding one unique
``FACT-NN: the key is WORD`` line (in its middle), with the task "read files 1..N one per turn with
your read tool, then list the facts". The scripted model answers each turn with one read call for
the next file, then with the facts it can see. Per session it measures:

- ``finished``: the CLI exited 0 and printed the model's final answer; ``turns``: agent requests
  answered; ``facts``: how many of the N facts the final answer named correctly (what the model
  could still see at the end);
- ``cuts``: requests cut anew by ContextPaw (a turn that repeats the last cuts and appends is not
  one) or by the server, and for each the share of the window used (the server's count / the
  window) and, through ContextPaw, the target share (`X-ContextPaw-Target`, the budget less the
  headroom, / window); ``cuts on target``: ContextPaw's cuts the server counted within 5% of it;
  ``use_after_first_cut``: the mean share of the window the prompts used from the first cut on;
- ``fresh_whole``: turns where the file just read reached the model whole (every line of it in the
  prompt the model saw), of the turns that followed a read where it could (through ContextPaw, a
  turn whose head and file alone are over the budget is counted apart, as ``cannot fit``);
- ``head_identical``: requests whose head (system, tools, every message up to and including the
  first user message) reached the model as the client sent it (compared as parsed JSON);
- ``pairs_intact``: requests where every tool call the model saw has its result and every result
  its call;
- ``markers_reported``: requests with ``[ContextPaw:`` markers whose every retrieval id is in the
  report the client got (the stream's or body's ``contextpaw`` object), with ``X-ContextPaw-Compacted:
  true``;
- ``silent_cuts``: cuts made by the server that the client was not told of (every server cut direct;
  through ContextPaw, one without ``upstream_truncated``/``upstream_truncation_possible`` in its report);
- ``reeval``: per turn, the share of the prompt a prefix cache must evaluate again (tokens after the
  longest prefix shared with one of the session's last 4 evaluated prompts), averaged over the
  session's turns after its first; ``least``: per turn, the share of the prompt that the turn's new
  messages take (the least any cut could re-evaluate), averaged the same way: where direct dies,
  ContextPaw's re-evaluation is set beside this.

Usage:

    PYTHONPATH=tests .venv/bin/python scripts/bench/agent_sessions.py                      # the whole matrix, 12 files, 32k window
    PYTHONPATH=tests .venv/bin/python scripts/bench/agent_sessions.py --agents claude --behaviours llamacpp --files 4 --n-ctx 16384

It prints a markdown table and writes the JSON (every session's numbers) to ``--out``; the sessions'
logs (the model's, the recorders', mitmdump's) stay under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support import agents as agent_cli  # noqa: E402
from support import scripted_model as sm  # noqa: E402
from support.backends import start_module  # noqa: E402
from support.recorder import read_log  # noqa: E402

AGENTS = ("claude", "codex", "opencode", "qwen")
BEHAVIOURS = ("ollama", "llamacpp")
MODEL_ROUTES = {"/v1/messages": "anthropic", "/v1/chat/completions": "chat", "/v1/responses": "responses"}
RETRIEVAL_ID = re.compile(r"ref (cp-[0-9a-f]+(?:\.[0-9a-f]+)?)")
MARKER_TEXT = re.compile(r"\[ContextPaw:[^\]]*\]")
"""A marker as the model reads it (a digest aside, none holds a bracket of its own)."""
MARKER = "[ContextPaw:"
WORDS = (
    "alpha bravo cedar delta ember falcon garnet harbor indigo juniper kettle lantern meadow nectar orchid pepper "
    "quartz raven saffron timber umber velvet willow xenon yarrow zephyr anchor beacon copper dune eagle fern "
    "glacier hazel island jasper kelp lotus marble nickel onyx prairie quill ripple sable tundra utopia violet "
    "walnut yonder zinc amber basil clover drift estuary fjord grove heron iris jade knoll larch moss"
).split()


# --- the project ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProjectFile:
    path: Path
    text: str
    fact: str


def make_project(folder: Path, count: int, seed: int = 38) -> list[ProjectFile]:
    """``count`` files of 20-40 KB of numbered prose lines (under 100 characters each), each with one
    ``FACT-NN: the key is WORD`` line in its middle."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for number in range(1, count + 1):
        size = rng.randint(20_000, 40_000)
        lines, length = [], 0
        while length < size:
            line = f"note {number:02d}.{len(lines) + 1:04d}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12)))
            lines.append(line)
            length += len(line) + 1
        fact = f"FACT-{number:02d}: the key is {rng.choice(WORDS)}{rng.choice(WORDS)}"
        lines.insert(len(lines) // 2, fact)
        path = folder / f"file-{number:02d}.txt"
        text = "\n".join(lines) + "\n"
        path.write_text(text)
        files.append(ProjectFile(path, text, fact))
    return files


def task_text(files: Sequence[ProjectFile]) -> str:
    listed = "\n".join(f"{i}. {f.path}" for i, f in enumerate(files, 1))
    return (
        f"Read these {len(files)} files in this order, one file per turn, each with your own file-reading tool "
        f"(no other tool), then list every FACT line you found:\n{listed}\n"
    )


# --- one session --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    agent: str
    behaviour: str
    tokenizer: bool
    via: str
    """direct | contextpaw | launch (`contextpaw launch AGENT`: the agent told the window and its settings)"""
    files: int
    n_ctx: int

    @property
    def name(self) -> str:
        return f"{self.agent}-{self.behaviour}-{'tok' if self.tokenizer else 'est'}-{self.via}"


@dataclass
class Result:
    spec: Spec
    exit_code: int | None
    seconds: float
    final_answer: str
    finished: bool = False
    turns: int = 0
    requests: int = 0
    refused: int = 0
    facts: int = 0
    cuts: list[dict[str, Any]] = field(default_factory=list)
    use_after_first_cut: float | None = None
    fresh_whole: int = 0
    fresh_turns: int = 0
    fresh_unfit: int = 0
    """Turns whose file just read could not reach the model whole: the head and it alone are over
    the budget (they are not counted in ``fresh_turns``)."""
    fresh_sizes: list[int] = field(default_factory=list)
    """Per turn after a read: how many characters of the fresh file reached the model."""
    head_identical: int = 0
    head_checked: int = 0
    head_changes: list[str] = field(default_factory=list)
    pairs_intact: int = 0
    pairs_checked: int = 0
    marked: int = 0
    markers_reported: int = 0
    silent_cuts: int = 0
    server_cuts: int = 0
    reeval: float | None = None
    reeval_tokens: int = 0
    least: float | None = None
    """Per turn, the share of the prompt that is new (the messages the turn adds): the least any
    cut could re-evaluate, what a session that dies direct is set beside."""
    evaluated_tokens: int = 0
    rewritten: int = 0
    """References whose marker read otherwise in a later request (one reference, one text)."""
    marker_share: float = 0.0
    """The most of a prompt's characters that ContextPaw's markers took."""
    compactions: int = 0
    """The agent's own summary requests (the scripted model answered them as summaries)."""
    files_read: int = 0
    """Files whose FACT line reached the model in some request (each file was read)."""
    largest_share: float = 0.0
    """The largest prompt the server counted, as a share of the window."""
    asked_seconds: float = 0.0
    asked_calls: int = 0
    """What asking Ollama to count took (`contextpaw_ask_ollama`), from ContextPaw's health page."""
    notes: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        shares = [c["share"] for c in self.cuts if c.get("share") is not None]
        aimed = [c for c in self.cuts if c.get("by") == "contextpaw" and c.get("target_tokens")]
        on_target = sum(abs(c["evaluated"] - c["target_tokens"]) <= 0.05 * c["target_tokens"] for c in aimed)
        targets = [c["target"] for c in self.cuts if c.get("target") is not None]
        pct = lambda v: "-" if v is None else f"{100 * v:.0f}%"  # noqa: E731
        return {
            "agent": self.spec.agent, "backend": self.spec.behaviour, "tokenizer": "yes" if self.spec.tokenizer else "no",
            "path": self.spec.via, "finished": "yes" if self.finished else f"no ({self.exit_code})",
            "turns": self.turns, "facts": f"{self.facts}/{self.spec.files}", "cuts": len(self.cuts),
            "window at cuts": "-" if not shares else f"{pct(min(shares))}-{pct(max(shares))}",
            "target": "-" if not targets else f"{pct(min(targets))}-{pct(max(targets))}",
            "cuts on target": f"{on_target}/{len(aimed)}",
            "use from 1st cut": pct(self.use_after_first_cut),
            "fresh whole": f"{self.fresh_whole}/{self.fresh_turns}" + (f" ({self.fresh_unfit} cannot fit)" if self.fresh_unfit else ""),
            "head identical": f"{self.head_identical}/{self.head_checked}",
            "pairs intact": f"{self.pairs_intact}/{self.pairs_checked}",
            "markers reported": f"{self.markers_reported}/{self.marked}",
            "silent cuts": f"{self.silent_cuts}/{self.server_cuts}",
            "re-eval / turn": pct(self.reeval),
            "least / turn": pct(self.least),
            "markers rewritten": self.rewritten,
            "markers, most of a prompt": pct(self.marker_share),
            "own compactions": self.compactions,
            "files read": f"{self.files_read}/{self.spec.files}",
            "largest prompt": pct(self.largest_share),
            "asking": f"{self.asked_calls} in {self.asked_seconds:.1f} s",
        }  # fmt: skip


def run_agent(agent: str, binary: Path, base: str, task: str, home: Path, project: Path, spec: Spec, timeout: float) -> agent_cli.AgentRun:
    if agent == "claude":
        return agent_cli.run_claude(binary, base, task, home=home, cwd=project, timeout=timeout)
    if agent == "codex":
        return run_codex(binary, base, task, home=home, cwd=project, timeout=timeout)
    if agent == "opencode":
        return agent_cli.run_opencode(binary, base, task, home=home, cwd=project, context=spec.n_ctx, output=4096,
                                      timeout=timeout)  # fmt: skip
    if agent == "qwen":  # told no window, as Claude Code and Codex: it assumes 200,000 and never compacts here
        return agent_cli.run_qwen(binary, base, task, home=home, cwd=project, timeout=timeout,
                                  settings={"tools": {"truncateToolOutputThreshold": agent_cli.QWEN_TOOL_OUTPUT_LIMIT}})  # fmt: skip
    raise ValueError(agent)


def run_codex(binary: Path, base: str, task: str, *, home: Path, cwd: Path, timeout: float) -> agent_cli.AgentRun:
    """``support.agents.run_codex``'s run, with the same provider block and the tool output limit
    raised (``tool_output_token_limit`` in its config.toml)."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "fake-model"\nmodel_provider = "local"\ntool_output_token_limit = {agent_cli.CODEX_TOOL_OUTPUT_LIMIT}\n\n'
        f'[model_providers.local]\nname = "local"\nbase_url = "{base.rstrip("/")}/v1"\nwire_api = "responses"\n'
        'env_key = "LOCAL_KEY"\nrequest_max_retries = 0\nstream_max_retries = 0\n\n[analytics]\nenabled = false\n'
    )
    env = agent_cli.scratch_env(home, {"CODEX_HOME": str(codex_home), "LOCAL_KEY": "local"})
    argv = [str(binary), "exec", "--json", "--skip-git-repo-check", "-"]
    cwd.mkdir(parents=True, exist_ok=True)
    code, out, err, seconds = agent_cli.run_process(argv, env, cwd, timeout, stdin=task)
    events = [e for e in (_json_line(line) for line in out.splitlines() if line.strip()) if isinstance(e, dict)]
    return agent_cli.AgentRun(argv, code, out, err, events, seconds, home)


def _json_line(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


def final_text(agent: str, run: agent_cli.AgentRun) -> str:
    if agent == "claude":
        return str(run.result.get("result") or "") if isinstance(run.result, dict) else ""
    if agent == "codex":
        return "".join(
            e["item"].get("text", "") for e in run.result or []
            if e.get("type") == "item.completed" and (e.get("item") or {}).get("type") == "agent_message"
        )  # fmt: skip
    return str(run.extra.get("text") or "")


def run_session(spec: Spec, binary: Path, work: Path, options: Sequence[str] = (), timeout: float | None = None) -> Result:
    """One session: the project, the scripted model, ContextPaw if ``spec.via`` says so, the CLI."""
    work.mkdir(parents=True, exist_ok=True)
    project = work / "project"
    files = make_project(project / "notes", spec.files)
    log = work / "model.jsonl"
    args = ["--n-ctx", str(spec.n_ctx), "--behaviour", spec.behaviour, "--log", str(log),
            *(["--tokenizer-visible"] if spec.tokenizer else [])]  # fmt: skip
    timeout = timeout or 90 + 30 * spec.files
    with ExitStack() as exits:
        model = exits.enter_context(start_module("support.scripted_model", args, "/", work / "model.out", timeout=180))
        stack = None
        base = model.url
        if spec.via in ("contextpaw", "launch"):
            stack, stops = agent_cli.start_contextpaw_stack(work / "stack", model.url, options)
            exits.enter_context(stops)
            base = stack.front
        if spec.via == "launch":
            run = agent_cli.run_launched(spec.agent, binary, base, task_text(files), home=work / "home", cwd=project,
                                         state=work / "state", timeout=timeout, force=True)  # fmt: skip
        else:
            run = run_agent(spec.agent, binary, base, task_text(files), work / "home", project, spec, timeout)
        (work / "agent.out").write_text(run.describe())
        asked = asked_of(stack.proxy.url) if stack else {}
    result = Result(spec, run.returncode, round(run.seconds, 1), final_text(spec.agent, run))
    result.asked_calls, result.asked_seconds = int(asked.get("calls", 0)), float(asked.get("seconds", 0.0))
    analyse(result, files, read_log(log), read_log(stack.front_log) if stack else None)
    return result


def asked_of(proxy: str) -> dict[str, Any]:
    """What ContextPaw's health page says of asking Ollama to count (calls, seconds)."""
    import urllib.request

    with urllib.request.urlopen(proxy + "/contextpaw/health", timeout=30) as answer:
        return dict(json.loads(answer.read())["counter"].get("ollama_asked") or {})


# --- the measures -------------------------------------------------------------------------------


def conversation(api: str, body: Mapping[str, Any]) -> sm.Conversation:
    return {"chat": sm.from_chat, "anthropic": sm.from_anthropic, "responses": sm.from_responses}[api](dict(body))


def last_key(api: str, body: Mapping[str, Any]) -> str:
    """What pairs a request the model received with the one the client sent: its last message (a
    tool result by its call's id, which no cut changes; else the role and the text's two ends, which
    a cut middle-out keeps: Qwen Code's first message is its reminders, then the task, and a cut may
    shorten the first reminder)."""
    talk = conversation(api, body)
    tools = len(talk.tools)  # opencode's title request ends in the same task as its first agent request
    if not talk.messages:
        return f"{tools}:-"
    last = talk.messages[-1]
    return f"{tools}:r:{last.result_of}" if last.result_of else f"{tools}:m:{last.role}:{last.text[:40]}:{last.text[-80:]}"


def head(api: str, body: Mapping[str, Any]) -> str:
    """The head as canonical JSON: system, tools, every message up to and including the first user
    message."""
    items = body.get("input") if api == "responses" else body.get("messages")
    items = items if isinstance(items, list) else []
    first_user = next((i for i, m in enumerate(items) if isinstance(m, dict) and m.get("role") == "user"), len(items) - 1)
    kept = {"system": body.get("system"), "instructions": body.get("instructions"), "tools": body.get("tools"),
            "messages": items[: first_user + 1]}  # fmt: skip
    return json.dumps(kept, sort_keys=True, ensure_ascii=False)


def report_of(entry: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``contextpaw`` object of a recorded answer (body or stream), the last one found."""
    found = None
    for line in ((entry.get("response") or {}).get("body") or "").splitlines():
        line = line.strip().removeprefix("data:").strip()
        if '"contextpaw"' not in line or not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        stack = [record]
        while stack:
            value = stack.pop()
            if isinstance(value, dict):
                if isinstance(value.get("contextpaw"), dict):
                    found = value["contextpaw"]
                stack.extend(value.values())
            elif isinstance(value, list):
                stack.extend(value)
    return found


def whole_in(text: str, seen: str) -> int:
    """How many characters of ``text`` reached ``seen`` line by line, in order (a line number in
    front of each, as the read tools print them, does not matter); all of them when whole."""
    position, found = 0, 0
    for line in text.splitlines():
        if not line:
            continue
        at = seen.find(line, position)
        if at < 0:
            continue
        position, found = at + len(line), found + len(line) + 1
    return found


def asked_count(entry: Mapping[str, Any]) -> bool:
    """Whether a request the model received is ContextPaw asking Ollama for a count (its native
    chat, `truncate: false`, one token), not the agent's."""
    body = entry.get("body") or {}
    return entry.get("api") == "ollama" and body.get("truncate") is False and (body.get("options") or {}).get("num_predict") == 1


def analyse(result: Result, files: Sequence[ProjectFile], model_log: list[dict[str, Any]], front_log: list[dict[str, Any]] | None) -> None:
    n_ctx = result.spec.n_ctx
    model_log = [e for e in model_log if not asked_count(e)]
    agent_turns = [e for e in model_log if e.get("reply", {}).get("kind") in ("tool", "final", "lost") or e["status"] != 200]
    agent_turns = [e for e in agent_turns if (e.get("body") or {}).get("tools")]
    result.requests = len(model_log)
    result.refused = sum(1 for e in model_log if e["status"] != 200)
    result.turns = sum(1 for e in agent_turns if e["status"] == 200)
    final = [e for e in agent_turns if e.get("reply", {}).get("kind") == "final"]
    # opencode prints every text part of the run: a compaction's summary and its "Continue" come first
    result.final_answer = result.final_answer[max(result.final_answer.rfind("Done."), 0) :]
    result.finished = result.exit_code == 0 and bool(final) and result.final_answer.startswith("Done.")
    answer = result.final_answer if result.final_answer else (final[-1]["reply"]["text"] if final else "")
    result.facts = sum(1 for f in files if f.fact in answer)
    result.compactions = sum(1 for e in model_log if (e.get("reply") or {}).get("kind") == "summary")
    seen = "\n".join(json.dumps(e.get("body"), ensure_ascii=False) for e in model_log)
    result.files_read = sum(1 for f in files if f.fact in seen)
    result.largest_share = max((e.get("prompt_tokens") or 0 for e in model_log), default=0) / n_ctx
    # the client's requests, by their last message, for pairing
    sent: dict[str, list[dict[str, Any]]] = {}
    for entry in front_log or []:
        path = entry["path"].split("?")[0]
        if entry["method"] == "POST" and path in MODEL_ROUTES and isinstance(entry.get("body"), dict):
            sent.setdefault(last_key(MODEL_ROUTES[path], entry["body"]), []).append(entry)
    used: dict[str, int] = {}
    shares_from_cut: list[float] = []
    cut_seen = False
    last_removed: list[tuple[Any, Any]] = []
    reevals, leasts, last_file, first_answered = [], [], None, True
    marker_texts: dict[str, set[str]] = {}
    texts = {i + 1: f.text for i, f in enumerate(files)}
    for entry in agent_turns:
        api, body = entry["api"], entry["body"]
        talk = conversation(api, body)
        client = None
        if front_log is not None:
            key = last_key(api, body)
            candidates = sent.get(key) or []
            if candidates:
                index = min(used.get(key, 0), len(candidates) - 1)
                used[key] = index + 1
                client = candidates[index]
        report = report_of(client) if client else None
        headers = agent_cli.contextpaw_headers(client) if client else {}
        compacted = headers.get("x-contextpaw-compacted") == "true"
        if entry["status"] == 200:
            evaluated = entry["evaluated_tokens"]
            server_cut = bool(entry.get("cut"))
            removed = [(r.get("index"), r.get("action")) for r in (report or {}).get("removals") or []]
            new_cut = server_cut or (compacted and removed != last_removed)
            if compacted:
                last_removed = removed
            if new_cut:  # a turn that only repeats the last cuts and appends is not a cut
                cut_seen = True
                aim = headers.get("x-contextpaw-target") or headers.get("x-contextpaw-budget")
                result.cuts.append({
                    "request": entry["n"], "by": "server" if server_cut else "contextpaw", "evaluated": evaluated,
                    "share": evaluated / n_ctx, "target": int(aim) / n_ctx if aim and aim.isdigit() else None,
                    "target_tokens": int(aim) if aim and aim.isdigit() else None, "sent_tokens": entry["prompt_tokens"],
                })  # fmt: skip
            if cut_seen:
                shares_from_cut.append(evaluated / n_ctx)
            if server_cut:
                result.server_cuts += 1
                told = report is not None and (report.get("upstream_truncated") or report.get("upstream_truncation_possible"))
                result.silent_cuts += 0 if told else 1
            if first_answered:
                first_answered = False
            else:
                reevals.append(entry["reevaluated_tokens"] / max(1, evaluated))
                leasts.append(min(entry["new_tokens"], evaluated) / max(1, evaluated))
            result.reeval_tokens += entry["reevaluated_tokens"]
            result.evaluated_tokens += evaluated
            # what the model saw: the whole rendering, or what was left after the server's cut
            seen = sm.render(talk) if not server_cut else str(entry.get("seen_text") or "")
            if last_file is not None and talk.messages and talk.messages[-1].result_of is not None:
                reached = whole_in(texts[last_file], seen)
                result.fresh_sizes.append(reached)
                budget = headers.get("x-contextpaw-budget")
                if reached < whole_size(texts[last_file]) and budget and budget.isdigit() and entry["kept_tokens"] > int(budget):
                    result.fresh_unfit += 1  # the head and the file alone are over the budget: it cannot reach the model whole
                else:
                    result.fresh_turns += 1
                    result.fresh_whole += reached >= whole_size(texts[last_file])
            if entry["reply"].get("file"):
                last_file = entry["reply"]["file"]
        # the pairs
        calls = {c.id for m in talk.messages for c in m.calls}
        results_ = {m.result_of for m in talk.messages if m.result_of is not None}
        result.pairs_checked += 1
        result.pairs_intact += calls == results_
        # the head: what the client sent against what the model received, and what the model saw
        seen_head = True
        if entry["status"] == 200 and entry.get("cut"):
            first_user = next((i for i, m in enumerate(talk.messages) if m.role == "user"), len(talk.messages) - 1)
            seen_head = str(entry.get("seen_text") or "").startswith(
                sm.render_head(talk) + sm.render_messages(talk.messages[: first_user + 1])
            )
        same = seen_head
        if front_log is not None and client is not None:
            same = same and head(api, client["body"]) == head(api, body)
        if front_log is None or client is not None:
            result.head_checked += 1
            result.head_identical += same
            if not same and len(result.head_changes) < 5:
                change = _head_change(api, client["body"], body) if client is not None else ""
                result.head_changes.append(f"request {entry['n']}: {change or 'the server cut into the head'}")
        text = json.dumps(body, ensure_ascii=False)
        for marker in MARKER_TEXT.findall(text):
            for ref in RETRIEVAL_ID.findall(marker):
                marker_texts.setdefault(ref, set()).add(marker)
        result.marker_share = max(result.marker_share, sum(map(len, MARKER_TEXT.findall(text))) / max(len(text), 1))
        if MARKER in text:
            result.marked += 1
            ids = set(RETRIEVAL_ID.findall(text))
            listed = set((report or {}).get("markers") or [])
            if compacted and ids <= listed:
                result.markers_reported += 1
            elif len(result.notes) < 8:
                result.notes.append(f"request {entry['n']}: markers {sorted(ids - listed)} not in the report "
                                    f"(compacted header {headers.get('x-contextpaw-compacted')})")  # fmt: skip
    result.rewritten = sum(1 for texts_ in marker_texts.values() if len(texts_) > 1)
    result.use_after_first_cut = sum(shares_from_cut) / len(shares_from_cut) if shares_from_cut else None
    result.reeval = sum(reevals) / len(reevals) if reevals else None
    result.least = sum(leasts) / len(leasts) if leasts else None


def whole_size(text: str) -> int:
    """What :func:`whole_in` finds of ``text`` when all of it is there."""
    return sum(len(line) + 1 for line in text.splitlines() if line)


def _head_change(api: str, sent: Mapping[str, Any], received: Mapping[str, Any]) -> str:
    a, b = json.loads(head(api, sent)), json.loads(head(api, received))
    changed = [k for k in a if a[k] != b[k]]
    if not changed:
        return ""
    if "messages" in changed:
        ma, mb = a["messages"], b["messages"]
        which = [i for i in range(max(len(ma), len(mb))) if i >= len(ma) or i >= len(mb) or ma[i] != mb[i]]
        return f"messages {which} of {len(ma)} changed ({len(json.dumps(ma))} -> {len(json.dumps(mb))} chars)"
    return f"{changed} changed"


# --- the matrix ---------------------------------------------------------------------------------


def matrix(
    agents: Iterable[str], behaviours: Iterable[str], tokenizers: Iterable[str], vias: Sequence[str], files: int, n_ctx: int
) -> list[Spec]:
    specs = []
    for agent in agents:
        for behaviour in behaviours:
            # llama-server always counts with its own tokenizer: only Ollama runs without one
            for tokenizer in [True] if behaviour == "llamacpp" else [t == "yes" for t in tokenizers]:
                for via in vias:
                    specs.append(Spec(agent, behaviour, tokenizer, via, files, n_ctx))
    return specs


COLUMNS = ("agent", "backend", "tokenizer", "path", "finished", "turns", "facts", "cuts", "window at cuts", "target",
           "cuts on target", "use from 1st cut", "fresh whole", "head identical", "pairs intact", "markers reported", "silent cuts",
           "re-eval / turn", "least / turn")  # fmt: skip
LAUNCH_COLUMNS = ("agent", "backend", "tokenizer", "window", "finished", "files read", "own compactions", "cuts",
                  "largest prompt", "asking")  # fmt: skip
"""The launch sessions' table (issue 55): does the agent's own compaction keep it under the window."""


def table(results: Sequence[Result]) -> str:
    launched = all(r.spec.via == "launch" for r in results)
    columns = LAUNCH_COLUMNS if launched else COLUMNS
    rows = [{**r.row(), "window": r.spec.n_ctx} for r in results]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", default=",".join(AGENTS), help="comma-separated: claude,codex,opencode,qwen")
    parser.add_argument("--behaviours", default=",".join(BEHAVIOURS), help="comma-separated: ollama,llamacpp")
    parser.add_argument("--tokenizers", default="no,yes", help="on Ollama: no (ContextPaw estimates), yes (the GGUF)")
    parser.add_argument("--via", default="direct,contextpaw", help="comma-separated: direct,contextpaw,launch")
    parser.add_argument("--files", type=int, default=12)
    parser.add_argument("--n-ctx", type=int, default=32768)
    parser.add_argument("--set", dest="options", action="append", default=[], help="a ContextPaw option, name=value")
    parser.add_argument("--work", type=Path, default=None, help="where the sessions run (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/agent_sessions.json"))
    parser.add_argument("--commit", default=None,
                        help="run ContextPaw as committed at this revision (git archive), not the working tree")  # fmt: skip
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    names = [a for a in args.agents.split(",") if a]
    found = agent_cli.locate_agents(*names)
    if not found.paths:
        print(f"no agent CLIs: {found.reason}", file=sys.stderr)
        return 1
    work = (args.work or Path(__import__("tempfile").mkdtemp(prefix="agent-sessions-"))).resolve()
    if args.commit:
        use_commit(args.commit, work)
    specs = matrix(names, args.behaviours.split(","), args.tokenizers.split(","), args.via.split(","), args.files, args.n_ctx)
    results = []
    for spec in specs:
        started = time.monotonic()
        result = run_session(spec, found.paths[spec.agent], work / spec.name, args.options)
        results.append(result)
        print(f"{spec.name}: {json.dumps(result.row())} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
        args.out.write_text(json.dumps([_json(r) for r in results], indent=1) + "\n")
    print(table(results))
    print(f"\nJSON: {args.out}; logs: {work}")
    return 0


def use_commit(revision: str, work: Path) -> None:
    """ContextPaw's package as committed at ``revision``, first on the path of every process this
    one starts (mitmdump runs ``python -c``, which puts its working directory first: so the sessions
    run from ``work``, not from the checkout)."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", revision], capture_output=True, text=True, check=True).stdout.strip()
    print(f"ContextPaw as committed at {commit}", file=sys.stderr)
    tree = work / f"contextpaw-{commit[:12]}"
    tree.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", revision, "contextpaw", "contextpaw_addon.py"],
                             capture_output=True, check=True)  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    agent_cli.ADDON = tree / "contextpaw_addon.py"  # mitmdump puts a script's folder first while loading it
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    os.chdir(work)


def _json(result: Result) -> dict[str, Any]:
    out = asdict(result)
    out["row"] = result.row()
    return out


if __name__ == "__main__":
    raise SystemExit(main())
