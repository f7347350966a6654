"""What `contextpaw launch` sets for each agent, pure: the agent, the window ContextPaw serves the
model at, the proxy's address and the model in; the environment, the command line and the files to
write out. Nothing here reads or writes anything.

Each agent learns the window its own way, and its own compaction fires from that number: told the
served window, the agent compacts its history with the model's own summary before the window is
reached, and ContextPaw's cut stays the safety net. A user's own config file is never touched: the
settings travel as environment variables and flags, or in a file of ContextPaw's own (in its state
directory) that the agent is pointed at.

Each agent that speaks MCP (Claude Code, Codex, opencode, Qwen Code) also gets `contextpaw mcp`
registered the same way, for this session only: its `contextpaw_retrieve` and `contextpaw_search`
tools give back what ContextPaw evicted (contextpaw/command/mcp.py). Those two tools, and no other,
are granted too, beside the user's own grants: without a terminal, none of the four asks a person,
each refuses a tool it would ask for.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from contextpaw.wire import SESSION_HEADER, USAGE_HEADER, Kind


@dataclass(frozen=True, slots=True)
class Target:
    """What the agent is pointed at: ContextPaw's address, the model, the window the agent is told,
    the kind of backend behind it, and where generated files go."""

    proxy: str
    model: str
    window: int
    kind: Kind
    state_dir: Path
    served: int | None = None
    """The window the backend serves, where the agent is told less (`/contextpaw/window`'s
    `agent_window`: ContextPaw counts the model by estimate); None: the same."""
    contextpaw: tuple[str, ...] = ("contextpaw",)
    """The command that runs ContextPaw, for the agent to start `contextpaw mcp` with."""
    token_dir: Path | None = None
    """The proxy's state directory, where `contextpaw mcp` finds its token; None: the server's own
    default (~/.contextpaw, then ~/.mitmproxy)."""
    session: str = ""
    """This run's session (`wire.SESSION_HEADER`): sent with the agent's requests and given to its
    `contextpaw mcp`, whose searches find what this run evicted and no other's ("": none named)."""

    @property
    def mcp(self) -> tuple[str, ...]:
        """The command line of the MCP server that reads back from this proxy."""
        where = ("--state-dir", str(self.token_dir)) if self.token_dir else ()
        session = (f"--session={self.session}",) if self.session else ()
        return (*self.contextpaw, "mcp", "--url", self.proxy.rstrip("/"), *where, *session)

    @property
    def headers(self) -> dict[str, str]:
        """What every agent that takes headers sends: `USAGE_WHOLE`, and this run's session."""
        return {**USAGE_WHOLE, **({SESSION_HEADER: self.session} if self.session else {})}

    @property
    def num_ctx(self) -> int:
        """The window to ask Ollama for: the one it serves, whatever the agent is told."""
        return self.served or self.window

    @property
    def output(self) -> int:
        """The room an answer gets (`answer_room` of the window)."""
        return answer_room(self.window)

    @property
    def read_room(self) -> int:
        """Room for what one turn adds after the agent last saw its usage (a file read whole, up to
        40 KB: 12,000 tokens): a third of the window, at most 12,000 tokens. An agent that checks
        its usage after each answer compacts this much before the window, so the next read still
        fits (with a quarter, a 40 KB read after a turn just under the threshold overflowed)."""
        return min(self.window // 3, 12_000)

    @property
    def compact_at(self) -> int:
        """Where an agent that takes a token count compacts: nine tenths of what the answer's room
        leaves, so that one more turn fits before the window."""
        return (self.window - self.output) * 9 // 10


def _frozen(values: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(values))


@dataclass(frozen=True, slots=True)
class Launch:
    """One agent's start: `argv` (the agent's own arguments follow it), `env` (set over the user's
    environment), `defaults` (set only where the user's environment has none, such as a key that a
    local server ignores), `files` (path -> text, written before the start) and `notes` (what each
    setting does, for `--print`)."""

    agent: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=lambda: _frozen({}))
    defaults: Mapping[str, str] = field(default_factory=lambda: _frozen({}))
    files: Mapping[Path, str] = field(default_factory=lambda: MappingProxyType({}))
    notes: tuple[str, ...] = ()

    def script(self, args: tuple[str, ...] = ()) -> str:
        """A shell script that does what the launch does: the files, the environment, the command."""
        lines = [f"# {note}" for note in self.notes]
        for path, text in self.files.items():
            lines += [f"mkdir -p {shlex.quote(str(path.parent))}", f"cat > {shlex.quote(str(path))} <<'EOF'", text.rstrip("\n"), "EOF"]
        lines += [f": ${{{name}:={shlex.quote(value)}}}; export {name}" for name, value in self.defaults.items()]
        lines += [f"export {name}={shlex.quote(value)}" for name, value in self.env.items()]
        lines.append("exec " + shlex.join((*self.argv, *args)))
        return "\n".join(lines) + "\n"


def _slug(model: str) -> str:
    """A model name as a file name: `qwen3:8b` -> `qwen3-8b`."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-") or "model"


def _generated(target: Target, agent: str, suffix: str) -> Path:
    return target.state_dir / "launch" / f"{agent}-{_slug(target.model)}{suffix}"


def _v1(target: Target) -> str:
    return target.proxy.rstrip("/") + "/v1"


MCP_NAME = "contextpaw"
"""The name the MCP server is registered under (Claude Code shows its tools as
`mcp__contextpaw__contextpaw_retrieve`)."""
MCP_TOOLS = ("contextpaw_retrieve", "contextpaw_search")
MCP_STARTUP_S = 30
"""How long an agent waits for the server to start (Codex's default, 10 s, is short for a cold
Python start on a busy machine)."""


MCP_GRANTS = tuple(f"mcp__{MCP_NAME}__{tool}" for tool in MCP_TOOLS)
"""The two tools as Claude Code and Qwen Code name them, granted so that they run without asking:
without a person to ask (`claude -p`, Qwen Code's prompt on stdin) each refuses a tool it would ask
for ("Claude requested permissions to use mcp__contextpaw__contextpaw_retrieve, but you haven't
granted it yet.")."""


USAGE_WHOLE = {USAGE_HEADER: "whole"}
"""Sent by every agent that compacts from the usage it is told (all but aider, which counts its own
history): after a cut, the usage says the whole history's size, so its own compaction fires on the
next turn instead of never (`wire.usage_whole`)."""


def _usage_note(agent: str, how: str) -> str:
    return f"{agent}: after a cut, told its whole history's size in the usage ({USAGE_HEADER}: whole, through {how})"


def _mcp_note(agent: str, how: str) -> str:
    return f"{agent}: contextpaw_retrieve and contextpaw_search (`contextpaw mcp`, MCP server {MCP_NAME!r}) through {how}"


CLAUDE_MODELS = (
    "ANTHROPIC_MODEL",
    "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    "CLAUDE_CODE_SUBAGENT_MODEL",
)
"""Every model name Claude Code may pick (its main model, the aliases, the one for its background
tasks and subagents): all the one local model."""


def claude(target: Target) -> Launch:
    """Claude Code gives a model it does not know a 1,000,000-token window;
    `CLAUDE_CODE_MAX_CONTEXT_TOKENS` is the window of such a model (`CLAUDE_CODE_AUTO_COMPACT_WINDOW`
    takes nothing under 100k). It compacts at the window less its answer's room (at most 20,000)
    less 13,000 tokens for the summary, so the answer's room is set too."""
    env = {
        "ANTHROPIC_BASE_URL": target.proxy.rstrip("/"),
        **{name: target.model for name in CLAUDE_MODELS},
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(target.window),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(target.output),
        "ANTHROPIC_CUSTOM_HEADERS": "\n".join(f"{name}: {value}" for name, value in target.headers.items()),
    }
    compacts = target.window - min(target.output, 20_000) - 13_000
    command, *args = target.mcp
    # alwaysLoad: its two tools in the prompt, not deferred behind Claude Code's ToolSearch (a local model seldom searches)
    servers = {"mcpServers": {MCP_NAME: {"type": "stdio", "command": command, "args": args, "alwaysLoad": True}}}
    notes = (
        f"Claude Code: window {target.window} (CLAUDE_CODE_MAX_CONTEXT_TOKENS), answers up to {target.output} tokens; "
        + (
            f"it compacts its history from {compacts} tokens"
            if compacts > 0
            else "it keeps 13,000 tokens for a summary, more than the window leaves: raise the window"
        ),
        _usage_note("Claude Code", "ANTHROPIC_CUSTOM_HEADERS"),
        _mcp_note("Claude Code", "--mcp-config (this session only, beside your own servers)"),
        f"Claude Code: {' and '.join(MCP_GRANTS)} run without asking (--allowedTools; your own --allowedTools add to it)",
    )
    # One argument each, `--flag=VALUE`: both flags take several values, and would take the user's prompt after them
    # too. Claude Code adds up the values of a flag given again, so the user's own `--allowedTools` keeps ours.
    argv = ("claude", "--mcp-config=" + json.dumps(servers, separators=(",", ":")), "--allowedTools=" + ",".join(MCP_GRANTS))
    return Launch("claude", argv, _frozen(env), _frozen({"ANTHROPIC_AUTH_TOKEN": "contextpaw"}), notes=notes)


def codex(target: Target) -> Launch:
    """Codex: a `contextpaw` provider on the Responses API, and `model_context_window` with
    `model_auto_compact_token_limit`, all as `-c` overrides (its config.toml is left alone)."""
    headers = ", ".join(f"{json.dumps(name)}={json.dumps(value)}" for name, value in target.headers.items())
    provider = f'{{name="ContextPaw", base_url={json.dumps(_v1(target))}, wire_api="responses", http_headers={{{headers}}}}}'
    overrides = {
        "model": json.dumps(target.model),
        "model_provider": '"contextpaw"',
        "model_providers.contextpaw": provider,
        "model_context_window": str(target.window),
        "model_auto_compact_token_limit": str(target.compact_at),
        f"mcp_servers.{MCP_NAME}.command": json.dumps(target.mcp[0]),
        f"mcp_servers.{MCP_NAME}.args": json.dumps(list(target.mcp[1:])),
        f"mcp_servers.{MCP_NAME}.startup_timeout_sec": str(MCP_STARTUP_S),
        # `codex exec` never asks, and fails a call it would ask for ("MCP tool call requires approval, but approval
        # policy is never"): each tool approved by name
        **{f"mcp_servers.{MCP_NAME}.tools.{tool}.approval_mode": '"approve"' for tool in MCP_TOOLS},
    }
    argv = ("codex", *(a for key, value in overrides.items() for a in ("-c", f"{key}={value}")))
    notes = (
        f"Codex: window {target.window} (model_context_window); it compacts its history from "
        f"{target.compact_at} tokens (model_auto_compact_token_limit)",
        _usage_note("Codex", "the provider's http_headers"),
        _mcp_note("Codex", f"-c mcp_servers.{MCP_NAME}.*"),
        f'Codex: {" and ".join(MCP_TOOLS)} run without asking (-c mcp_servers.{MCP_NAME}.tools.<tool>.approval_mode="approve")',
    )
    return Launch("codex", argv, notes=notes)


def opencode(target: Target) -> Launch:
    """opencode: a generated config (`OPENCODE_CONFIG`, merged over the user's own) with a
    `contextpaw` provider whose model has `limit.context`, `limit.input` and `limit.output`. opencode
    compacts after an answer whose usage passes `limit.input` less `compaction.reserved`; reserved
    is the answer's room and a read's (`Target.read_room`), so the turn after its last check still
    fits (with the answer's room alone, a 10,000-token read took it over the window first)."""
    path = _generated(target, "opencode", ".json")
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "contextpaw": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "ContextPaw",
                "options": {"baseURL": _v1(target), "headers": target.headers},
                "models": {
                    target.model: {
                        "name": target.model,
                        "limit": {"context": target.window, "input": target.window, "output": target.output},
                    }
                },
            }
        },
        # it compacts once its usage passes `limit.input` less `compaction.reserved`: the answer's room and a read's
        "compaction": {"reserved": target.output + target.read_room},
        "model": f"contextpaw/{target.model}",
        "small_model": f"contextpaw/{target.model}",
        "mcp": {MCP_NAME: {"type": "local", "command": list(target.mcp), "enabled": True, "timeout": MCP_STARTUP_S * 1000}},
        # run without asking: `opencode run` rejects what it would ask for; the user's other rules stay (merged)
        "permission": {f"{MCP_NAME}_{tool}": "allow" for tool in MCP_TOOLS},
    }
    notes = (
        f"opencode: window {target.window}, answers up to {target.output} (limit.context, limit.input, limit.output) "
        f"in {path}, through OPENCODE_CONFIG; it compacts its history from "
        f"{target.window - target.output - target.read_room} tokens (compaction.reserved)",
        _usage_note("opencode", "the provider's options.headers in the same file"),
        _mcp_note("opencode", f"mcp.{MCP_NAME} in the same file"),
        f"opencode: {' and '.join(f'{MCP_NAME}_{tool}' for tool in MCP_TOOLS)} run without asking (permission in "
        "the same file, over your own rules)",
    )
    return Launch(
        "opencode",
        ("opencode",),
        _frozen({"OPENCODE_CONFIG": str(path)}),
        files=MappingProxyType({path: json.dumps(config, indent=2) + "\n"}),
        notes=notes,
    )


def aider(target: Target) -> Launch:
    """aider: a model metadata file (`max_input_tokens`, which sizes its chat-history summary and its
    warning) and, on Ollama, model settings that ask for the served window as `num_ctx` (aider
    would ask for 1.25 times its prompt plus 8,192, and Ollama would load the model again at that
    size); Ollama's native API, or llama-server's OpenAI one."""
    name = f"ollama_chat/{target.model}" if target.kind == Kind.OLLAMA else f"openai/{target.model}"
    metadata_path = _generated(target, "aider", ".metadata.json")
    metadata = {
        name: {
            "max_input_tokens": target.window,
            "max_output_tokens": target.output,
            "max_tokens": target.output,
            "input_cost_per_token": 0,
            "output_cost_per_token": 0,
            "litellm_provider": name.split("/")[0],
            "mode": "chat",
        }
    }
    files = {metadata_path: json.dumps(metadata, indent=2) + "\n"}
    # `--flag=VALUE` wherever a value comes from the backend (the model's name): a name such as `--yes-always`
    # is then a value, never a flag of the agent's own
    argv = ["aider", f"--model={name}", f"--model-metadata-file={metadata_path}"]
    if target.kind == Kind.OLLAMA:
        env = {"OLLAMA_API_BASE": target.proxy.rstrip("/")}
        settings_path = _generated(target, "aider", ".settings.yml")
        files[settings_path] = json.dumps([{"name": name, "extra_params": {"num_ctx": target.num_ctx}}], indent=2) + "\n"
        argv += [f"--model-settings-file={settings_path}"]
        defaults = {}
    else:
        env = {"OPENAI_API_BASE": _v1(target)}
        defaults = {"OPENAI_API_KEY": "contextpaw"}
    notes = (
        f"aider: window {target.window} (max_input_tokens in {metadata_path})"
        + (f", num_ctx {target.num_ctx} on every request" if target.kind == Kind.OLLAMA else ""),
        "aider: no MCP, so no contextpaw_retrieve; what ContextPaw evicts is read back with the curl command its marker names",
    )
    return Launch("aider", tuple(argv), _frozen(env), _frozen(defaults), MappingProxyType(files), notes)


def qwen(target: Target) -> Launch:
    """Qwen Code: OpenAI's API through ContextPaw; the window as `model.generationConfig.
    contextWindowSize` in a generated system defaults file (`QWEN_CODE_SYSTEM_DEFAULTS_PATH`: the
    settings of lowest precedence, under the user's and the project's own) and the answer's room as
    `QWEN_CODE_MAX_OUTPUT_TOKENS` (it would ask for 32,000). It compacts at 85% of the window, or
    33,000 tokens below it where that is lower and positive."""
    path = _generated(target, "qwen", ".defaults.json")
    settings = {
        "model": {"generationConfig": {"contextWindowSize": target.window, "customHeaders": target.headers}},
        "mcpServers": {MCP_NAME: {"command": target.mcp[0], "args": list(target.mcp[1:])}},
        # declared up front, not deferred behind its tool_search (a local model seldom searches); a union over scopes
        "tools": {"visible": list(MCP_GRANTS)},
        # run without asking: without a prompt (-p, stdin) Qwen Code declines a tool it would ask for; a union over
        # scopes, under the user's own deny and ask rules
        "permissions": {"allow": list(MCP_GRANTS)},
    }
    env = {
        "OPENAI_BASE_URL": _v1(target),
        "OPENAI_MODEL": target.model,
        "QWEN_CODE_SYSTEM_DEFAULTS_PATH": str(path),
        "QWEN_CODE_MAX_OUTPUT_TOKENS": str(target.output),
    }
    notes = (
        f"Qwen Code: window {target.window} (model.generationConfig.contextWindowSize in {path}, through "
        f"QWEN_CODE_SYSTEM_DEFAULTS_PATH), answers up to {target.output} (QWEN_CODE_MAX_OUTPUT_TOKENS)",
        _usage_note("Qwen Code", "model.generationConfig.customHeaders in the same file"),
        _mcp_note("Qwen Code", f"mcpServers.{MCP_NAME} in the same file"),
        f"Qwen Code: {' and '.join(MCP_GRANTS)} run without asking (permissions.allow in the same file, beside your own rules)",
    )
    return Launch(
        "qwen",
        ("qwen", "--auth-type", "openai", f"--model={target.model}"),
        _frozen(env),
        _frozen({"OPENAI_API_KEY": "contextpaw"}),
        MappingProxyType({path: json.dumps(settings, indent=2) + "\n"}),
        notes,
    )


INSTALL: Mapping[str, str] = MappingProxyType(
    {
        "claude": "npm install -g @anthropic-ai/claude-code",
        "codex": "npm install -g @openai/codex",
        "opencode": "npm install -g opencode-ai",
        "qwen": "npm install -g @qwen-code/qwen-code",
        "aider": "pipx install aider-chat",
    }
)
"""How each agent is installed, for launch to say where one is missing (the versions tested are in docs/agents.md)."""


PLANS: Mapping[str, Callable[[Target], Launch]] = MappingProxyType(
    {"claude": claude, "codex": codex, "opencode": opencode, "aider": aider, "qwen": qwen}
)
FIXED_TOKENS: Mapping[str, int] = MappingProxyType({"claude": 12_000, "codex": 8_900, "opencode": 7_400, "aider": 1_000, "qwen": 16_800})
"""What each pinned agent sends besides the conversation (system prompt, tools, environment), in
tokens: its first request as recorded in tests/agents/fixtures/, counted with SmolLM2's tokenizer
(a model's own counts a little more or less). aider's repository map comes on top."""


def answer_room(window: int) -> int:
    """The room an answer gets: an eighth of the window, at least 1,024 and at most 16,384 tokens
    (an agent's own default, 32,000 for Claude Code and Qwen Code, would leave no window to a local
    model)."""
    return max(1024, min(16384, window // 8))


def least_window(agent: str, window: int) -> int:
    """The smallest window from `window` on, in whole KiB of tokens, that holds the agent's fixed
    part and the answer's room at that window: the room grows with the window, so a window that
    only holds the room of a smaller one is stepped past (Qwen Code at 4,096: not 17,408, where
    launch would warn again, but 19,456)."""
    while (need := -(-(FIXED_TOKENS[agent] + answer_room(window)) // 1024) * 1024) > window:
        window = need
    return window


LIVING_WINDOWS: Mapping[str, int] = MappingProxyType(
    {"claude": 65_536, "codex": 32_768, "opencode": 24_576, "qwen": 65_536, "aider": 32_768}
)
"""The least window in which each pinned agent, launched, lives through a long session of file reads
on its own compaction: it finishes, and ContextPaw cuts nothing. Measured with
`scripts/bench/agent_sessions.py --via launch --files 20` (20 reads of 20-40 KB files, 5,000-12,000
tokens each; docs/measurements.md), aider with `tests/agents/test_launch_compaction.py` (its own
history summary, 16 files of 2,500 tokens). One step below, each failed: Claude Code keeps 13,000
tokens for its summary and reads its last files back after it (at 49,152, `autocompact_thrashing`);
Qwen Code keeps 33,000 free (20,000 for its summary, 13,000 more) and stops when its history after
compressing is still over the window less 23,000 (at 49,152 after one read, at 32,768 after two);
Codex at 24,576 compacted 2,900 times in eight minutes, its fixed part and one file over its limit."""


def living_window(agent: str, window: int) -> int:
    """The least window the agent lives in: the measured one, or the one its fixed part and an
    answer need (`least_window`), whichever is more."""
    return max(LIVING_WINDOWS[agent], least_window(agent, window))


def too_small(agent: str, target: Target) -> str | None:
    """Why the agent cannot live in the window served (None: it can), with the window it needs
    and how the backend gives it."""
    need = living_window(agent, target.window)
    if target.num_ctx >= need:
        return None
    how = (
        f"start llama-server with -c {need}"
        if target.kind == Kind.LLAMACPP
        else f"start Ollama with OLLAMA_CONTEXT_LENGTH={need}, or give {target.model} a Modelfile with PARAMETER num_ctx {need} "
        "(`contextpaw doctor` says which applies)"
    )
    fixed = FIXED_TOKENS[agent]
    return (
        f"{agent} needs a window of at least {need:,} to keep working through a long session on its own compaction "
        f"(its tools and instructions take about {fixed:,} tokens, then its summary, the files it reads again and an "
        f"answer); {target.model} is served at {target.num_ctx:,}. To serve it at {need:,}: {how}"
    )


def plan(agent: str, target: Target) -> Launch:
    """The launch of `agent` at `target` (KeyError: not an agent `launch` knows), with a note where
    the window cannot hold the agent's own fixed part and an answer: every request would be refused."""
    chosen = PLANS[agent](target)
    least = least_window(agent, target.window)
    if target.window >= least:
        return chosen
    warning = (
        f"the agent's tools and instructions alone take about {FIXED_TOKENS[agent]:,} tokens: at a window of "
        f"{target.window:,} ContextPaw refuses every request; give the model a window of at least {least:,}"
    )
    return dataclasses.replace(chosen, notes=(*chosen.notes, warning))
