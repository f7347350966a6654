"""`contextpaw launch`'s core: what each agent is told, as a frozen value (contextpaw/command/launch.py).

That each setting takes effect in the real agent is tests/agents/test_launch_compaction.py's; here, that each
agent gets the served window in its own setting, that nothing is written outside ContextPaw's state
directory, and that `--print`'s script says all of it. The `/contextpaw/window` endpoint's refusals
are checked on `admin.Admin` directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from contextpaw.command import launch
from contextpaw.ops import admin
from contextpaw.ops.evicted import MemoryStore
from contextpaw.ops.metrics import Stats
from contextpaw.wire import USAGE_HEADER, Backend, Kind

STATE = Path("/home/u/.contextpaw")


def target(window: int = 32768, kind: Kind = Kind.LLAMACPP, model: str = "qwen3:8b") -> launch.Target:
    return launch.Target("http://127.0.0.1:8092", model, window, kind, STATE)


def overrides(plan: launch.Launch) -> dict[str, str]:
    """Codex's `-c key=value` pairs."""
    pairs = [plan.argv[i + 1] for i, a in enumerate(plan.argv) if a == "-c"]
    return dict(p.split("=", 1) for p in pairs)


def test_the_answer_room_is_an_eighth_of_the_window_within_bounds() -> None:
    assert [target(w).output for w in (4096, 32768, 262144)] == [1024, 4096, 16384]
    assert target(32768).compact_at == (32768 - 4096) * 9 // 10


def test_claude_code_gets_the_window_of_a_model_it_does_not_know() -> None:
    plan = launch.plan("claude", target(65536))
    assert plan.env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "65536"
    assert plan.env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "8192"
    assert plan.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8092"
    assert {plan.env[name] for name in launch.CLAUDE_MODELS} == {"qwen3:8b"}
    assert plan.defaults == {"ANTHROPIC_AUTH_TOKEN": "contextpaw"} and not plan.files
    assert "from 44344 tokens" in plan.notes[0]


def test_claude_code_is_told_when_its_summary_room_leaves_no_window() -> None:
    assert "raise the window" in launch.plan("claude", target(8192)).notes[0]


def test_a_window_under_the_agents_fixed_part_is_named_with_the_least_that_holds_it() -> None:
    small = launch.plan("qwen", target(16384)).notes
    assert "about 16,800 tokens" in small[-1] and "at least 19,456" in small[-1]
    tiny = launch.plan("qwen", target(4096)).notes  # the answer's room at 4,096 is less than at the window it names
    assert "at least 19,456" in tiny[-1] and launch.plan("qwen", target(19456)).notes == launch.qwen(target(19456)).notes
    assert launch.plan("qwen", target(32768)).notes == launch.qwen(target(32768)).notes


def test_the_fixed_parts_are_those_of_the_recorded_first_requests() -> None:
    """Each agent's fixture (its first request), system, tools and the messages before the task,
    counted as the scripted model counts them: within a tenth of `FIXED_TOKENS`."""
    from support import scripted_model as sm

    tokenizer = sm.load_tokenizer(sm.default_gguf(), Path.home() / ".cache" / "contextpaw" / "scripted-model")
    readers = {"claude-code": sm.from_anthropic, "codex": sm.from_responses, "opencode": sm.from_chat, "aider": sm.from_chat,
               "qwen-code": sm.from_chat}  # fmt: skip
    fixtures = Path(__file__).parents[1] / "agents" / "fixtures"
    counted = {}
    for client, agent in (
        ("claude-code", "claude"),
        ("codex", "codex"),
        ("opencode", "opencode"),
        ("aider", "aider"),
        ("qwen-code", "qwen"),
    ):
        (fixture,) = [f for f in fixtures.glob(f"{client}-[0-9]*.json") if "count-tokens" not in f.name]
        talk = readers[client](json.loads(fixture.read_text())["request"]["body"])
        counted[agent] = len(tokenizer.encode(sm.render(talk), add_special_tokens=False).ids)
    assert all(abs(counted[a] - launch.FIXED_TOKENS[a]) <= launch.FIXED_TOKENS[a] / 10 for a in counted), counted


def test_codex_gets_a_provider_and_the_window_as_overrides_only() -> None:
    plan = launch.plan("codex", target(32768))
    given = overrides(plan)
    assert given["model_context_window"] == "32768"
    assert given["model_auto_compact_token_limit"] == str(target(32768).compact_at)
    assert given["model"] == '"qwen3:8b"' and given["model_provider"] == '"contextpaw"'
    assert 'base_url="http://127.0.0.1:8092/v1"' in given["model_providers.contextpaw"]
    assert not plan.env and not plan.files


def test_opencode_reads_a_generated_config_in_the_state_dir() -> None:
    plan = launch.plan("opencode", target(24576))
    ((path, text),) = plan.files.items()
    assert plan.env == {"OPENCODE_CONFIG": str(path)} and path.parent == STATE / "launch"
    config = json.loads(text)
    model = config["provider"]["contextpaw"]["models"]["qwen3:8b"]
    assert model["limit"] == {"context": 24576, "input": 24576, "output": 3072}
    # opencode compacts from limit.input less reserved: the answer's room and a read of 8,192 (a third of the window)
    assert config["compaction"] == {"reserved": 3072 + 8192}
    assert any("compacts its history from 13312 tokens" in note for note in plan.notes)
    assert path.name == "opencode-qwen3-8b.json"


def given(argv: tuple[str, ...], flag: str) -> str:
    """The value of `--flag=VALUE` in `argv` (launch writes a value the backend chose so)."""
    return next(a.split("=", 1)[1] for a in argv if a.startswith(flag + "="))


def test_aider_on_ollama_asks_for_the_served_window_as_num_ctx() -> None:
    plan = launch.plan("aider", target(16384, Kind.OLLAMA))
    metadata, settings = (Path(given(plan.argv, flag)) for flag in ("--model-metadata-file", "--model-settings-file"))
    assert given(plan.argv, "--model") == "ollama_chat/qwen3:8b"
    assert json.loads(plan.files[metadata])["ollama_chat/qwen3:8b"]["max_input_tokens"] == 16384
    assert json.loads(plan.files[settings]) == [{"name": "ollama_chat/qwen3:8b", "extra_params": {"num_ctx": 16384}}]
    assert plan.env == {"OLLAMA_API_BASE": "http://127.0.0.1:8092"}


def test_aider_on_llama_server_speaks_openai_without_num_ctx() -> None:
    plan = launch.plan("aider", target(16384, Kind.LLAMACPP))
    assert given(plan.argv, "--model") == "openai/qwen3:8b"
    assert not any(a.startswith("--model-settings-file") for a in plan.argv)
    assert plan.env == {"OPENAI_API_BASE": "http://127.0.0.1:8092/v1"} and plan.defaults == {"OPENAI_API_KEY": "contextpaw"}


def test_qwen_code_reads_a_generated_system_defaults_file() -> None:
    plan = launch.plan("qwen", target(32768))
    path = Path(plan.env["QWEN_CODE_SYSTEM_DEFAULTS_PATH"])
    assert json.loads(plan.files[path])["model"] == {
        "generationConfig": {"contextWindowSize": 32768, "customHeaders": {USAGE_HEADER: "whole"}}
    }
    assert plan.env["QWEN_CODE_MAX_OUTPUT_TOKENS"] == "4096"
    assert plan.env["OPENAI_BASE_URL"] == "http://127.0.0.1:8092/v1" and plan.argv[-1] == "--model=qwen3:8b"


@pytest.mark.parametrize("agent", sorted(launch.PLANS))
def test_every_file_is_written_under_the_state_dir_and_the_plan_is_frozen(agent: str) -> None:
    plan = launch.plan(agent, target())
    assert all(path.is_relative_to(STATE / "launch") for path in plan.files)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.argv = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.env["X"] = "y"  # type: ignore[index]


@pytest.mark.parametrize("agent", sorted(launch.PLANS))
def test_the_printed_script_sets_what_the_launch_sets(agent: str, tmp_path: Path) -> None:
    """The script run by a shell, with a stand-in agent that dumps what it got: the generated files,
    the environment (a default only where the user's is unset) and the command line."""
    plan = launch.plan(agent, dataclasses.replace(target(), state_dir=tmp_path / "state"))
    stand_in = tmp_path / "bin" / plan.argv[0]
    stand_in.parent.mkdir()
    stand_in.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$DUMP.args"; env > "$DUMP.env"\n')
    stand_in.chmod(0o755)
    env = {"PATH": f"{stand_in.parent}:{os.environ['PATH']}", "DUMP": str(tmp_path / "dump")}
    subprocess.run(["sh", "-c", plan.script(("--their", "arg s"))], env=env, check=True, timeout=30)
    assert (tmp_path / "dump.args").read_text().splitlines() == [*plan.argv[1:], "--their", "arg s"]
    got = dict(line.split("=", 1) for line in (tmp_path / "dump.env").read_text().splitlines() if "=" in line)
    assert {k: got.get(k) for k in (*plan.env, *plan.defaults)} == {**plan.defaults, **plan.env}
    assert {path: path.read_text() for path in plan.files} == dict(plan.files)


MCP = ("/venv/bin/contextpaw", "mcp", "--url", "http://127.0.0.1:8092")
"""The MCP server's command line for `target()`, started by the `contextpaw` that launched."""


def mcp_target(token_dir: Path | None = None) -> launch.Target:
    return dataclasses.replace(target(), contextpaw=("/venv/bin/contextpaw",), token_dir=token_dir)


def test_claude_code_gets_the_mcp_server_for_this_session_only_in_one_argument() -> None:
    """`--mcp-config` takes several values: given as one `--mcp-config=JSON` argument, the user's
    prompt after it stays a prompt; without `--strict-mcp-config`, the user's own servers stay."""
    plan = launch.plan("claude", mcp_target())
    (given,) = [a for a in plan.argv if a.startswith("--mcp-config")]
    assert given.startswith("--mcp-config={")
    server = json.loads(given.partition("=")[2])["mcpServers"]["contextpaw"]
    assert server == {"type": "stdio", "command": MCP[0], "args": list(MCP[1:]), "alwaysLoad": True}
    assert "--strict-mcp-config" not in plan.argv and not plan.files
    assert any("contextpaw_retrieve" in note and "--mcp-config" in note for note in plan.notes)


def test_codex_gets_the_mcp_server_as_overrides_only() -> None:
    plan = launch.plan("codex", mcp_target())
    given = overrides(plan)
    assert given["mcp_servers.contextpaw.command"] == json.dumps(MCP[0])
    assert json.loads(given["mcp_servers.contextpaw.args"]) == list(MCP[1:])
    assert given["mcp_servers.contextpaw.startup_timeout_sec"] == "30"
    assert not plan.env and not plan.files


def test_opencode_gets_the_mcp_server_in_its_generated_config() -> None:
    plan = launch.plan("opencode", mcp_target())
    ((_, text),) = plan.files.items()
    server = json.loads(text)["mcp"]["contextpaw"]
    assert server == {"type": "local", "command": list(MCP), "enabled": True, "timeout": 30000}


def test_qwen_code_gets_the_mcp_server_in_its_generated_defaults() -> None:
    plan = launch.plan("qwen", mcp_target())
    defaults = json.loads(plan.files[Path(plan.env["QWEN_CODE_SYSTEM_DEFAULTS_PATH"])])
    assert defaults["mcpServers"] == {"contextpaw": {"command": MCP[0], "args": list(MCP[1:])}}
    assert defaults["tools"]["visible"] == ["mcp__contextpaw__contextpaw_retrieve", "mcp__contextpaw__contextpaw_search"]


GRANTED = ["mcp__contextpaw__contextpaw_retrieve", "mcp__contextpaw__contextpaw_search"]


def test_claude_code_is_granted_exactly_the_two_tools_in_one_argument_that_adds_to_the_users_own() -> None:
    """`claude -p` refuses a tool it would ask for. `--allowedTools` takes several values: as one
    `--allowedTools=A,B` argument it cannot take the user's prompt after it, and Claude Code adds a
    user's own `--allowedTools` (after it) to it instead of replacing it."""
    plan = launch.plan("claude", mcp_target())
    (given,) = [a for a in plan.argv if a.startswith("--allowedTools") or a.startswith("--allowed-tools")]
    assert given.split("=", 1) == ["--allowedTools", ",".join(GRANTED)]
    assert plan.argv[0] == "claude" and "=" in plan.argv[-1]  # the user's arguments follow a flag that takes no more
    assert any("--allowedTools" in note and "contextpaw_retrieve" in note and "your own" in note for note in plan.notes)


def test_codex_approves_exactly_the_two_tools_by_name() -> None:
    """`codex exec` never asks, and fails a tool call it would ask for."""
    given = overrides(launch.plan("codex", mcp_target()))
    approvals = {key: value for key, value in given.items() if "approval" in key}
    assert approvals == {f"mcp_servers.contextpaw.tools.{tool}.approval_mode": '"approve"'
                         for tool in ("contextpaw_retrieve", "contextpaw_search")}  # fmt: skip
    assert any("approval_mode" in note for note in launch.plan("codex", mcp_target()).notes)


def test_opencode_allows_exactly_the_two_tools_in_its_generated_config() -> None:
    """`opencode run` rejects what it would ask for; the permission rules merge over the user's own."""
    plan = launch.plan("opencode", mcp_target())
    ((_, text),) = plan.files.items()
    assert json.loads(text)["permission"] == {"contextpaw_contextpaw_retrieve": "allow", "contextpaw_contextpaw_search": "allow"}
    assert any("permission" in note for note in plan.notes)


def test_qwen_code_allows_exactly_the_two_tools_in_its_generated_defaults() -> None:
    """Qwen Code without a terminal declines what it would ask for; `permissions.allow` is a union
    over its settings' scopes, under the user's own deny and ask rules."""
    plan = launch.plan("qwen", mcp_target())
    defaults = json.loads(plan.files[Path(plan.env["QWEN_CODE_SYSTEM_DEFAULTS_PATH"])])
    assert defaults["permissions"] == {"allow": GRANTED}
    assert "--yolo" not in plan.argv and any("permissions.allow" in note for note in plan.notes)


def test_aider_has_no_mcp_and_its_notes_say_so() -> None:
    plan = launch.plan("aider", mcp_target())
    assert any("no MCP" in note and "curl" in note for note in plan.notes)
    assert not any("mcp" in a for a in plan.argv) and not any("mcp" in text for text in plan.files.values())


def test_the_mcp_server_reads_the_token_where_launch_was_told_the_state_dir() -> None:
    assert mcp_target().mcp == MCP
    assert mcp_target(Path("/srv/cp")).mcp == (*MCP, "--state-dir", "/srv/cp")
    assert launch.Target("http://h:1/", "m", 8192, Kind.OLLAMA, STATE).mcp == ("contextpaw", "mcp", "--url", "http://h:1")


@pytest.mark.parametrize("agent", ["claude", "codex", "opencode", "qwen"])
def test_the_printed_script_registers_the_mcp_server(agent: str) -> None:
    script = launch.plan(agent, mcp_target()).script()
    assert "/venv/bin/contextpaw" in script and "http://127.0.0.1:8092" in script
    assert "contextpaw_retrieve" in script  # the note, as a comment
    assert "run without asking" in script


def test_a_default_yields_to_the_users_own_value(tmp_path: Path) -> None:
    plan = dataclasses.replace(launch.plan("claude", target()), argv=("claude",))  # its environment only
    env = {"PATH": os.environ["PATH"], "ANTHROPIC_AUTH_TOKEN": "mine"}
    script = plan.script().replace("exec claude", 'printf %s "$ANTHROPIC_AUTH_TOKEN"')
    done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=True, timeout=30)
    assert done.stdout == "mine" and shlex.quote("contextpaw") in script


def _admin(window: tuple[int, str] = (8192, "backend")) -> admin.Admin:
    async def nothing() -> dict:
        return {}

    async def served(backend: Backend, model: str) -> dict:
        return {"window": window[0], "source": window[1], "counted": "exactly", "agent_window": window[0]}

    store = MemoryStore(max_items=1, max_bytes=1, max_age_s=1)
    return admin.Admin(Stats(store), store, nothing, nothing, served)


async def test_the_window_endpoint_names_the_served_window_and_the_backend() -> None:
    async def llamacpp() -> Backend:
        return Backend.parse(Kind.LLAMACPP, "http://127.0.0.1:8091")

    reply = await _admin().answer("GET", "/contextpaw/window", llamacpp)
    assert reply.status == 200
    assert json.loads(reply.body) == {"model": "", "backend": {"kind": "llamacpp", "url": "http://127.0.0.1:8091"},
                                      "window": 8192, "source": "backend", "counted": "exactly", "agent_window": 8192}  # fmt: skip


async def test_the_window_endpoint_asks_for_the_model_on_ollama_and_for_a_backend() -> None:
    async def ollama() -> Backend:
        return Backend.parse(Kind.OLLAMA, "http://127.0.0.1:11435")

    async def none() -> None:
        return None

    unnamed = await _admin().answer("GET", "/contextpaw/window", ollama)
    assert unnamed.status == 400 and b"model=NAME" in unnamed.body
    named = await _admin().answer("GET", "/contextpaw/window?model=qwen3%3A8b", ollama)
    assert json.loads(named.body)["model"] == "qwen3:8b"
    assert (await _admin().answer("GET", "/contextpaw/window?model=m", none)).status == 404


@pytest.mark.parametrize("agent", sorted(launch.PLANS))
def test_a_model_name_the_backend_chose_never_becomes_an_argument_of_its_own(agent: str) -> None:
    """A backend that lists one model named `--yolo`: `qwen -m --yolo` read it as "approve every
    tool call". Every value launch passes from the backend is `--flag=VALUE`, JSON inside `-c`, or in
    a file."""
    plan = launch.plan(agent, dataclasses.replace(target(65536), model="--yolo"))
    assert "--yolo" not in plan.argv
    assert all(not a.endswith(" --yolo") for a in plan.argv)


def test_each_agent_run_is_a_session_its_requests_and_its_mcp_server_both_name() -> None:
    """Issue 56: the local token searched every session's evictions. A launch names one session: the
    agent's requests send it (where the agent takes headers) and its `contextpaw mcp` searches it."""
    from dataclasses import replace

    from contextpaw.wire import SESSION_HEADER

    run = replace(target(), session="0123abcd0123abcd")
    assert "--session=0123abcd0123abcd" in run.mcp
    claude, codex, opencode, qwen = (launch.PLANS[a](run) for a in ("claude", "codex", "opencode", "qwen"))
    assert f"{SESSION_HEADER}: 0123abcd0123abcd" in claude.env["ANTHROPIC_CUSTOM_HEADERS"]
    assert f'"{SESSION_HEADER}"="0123abcd0123abcd"' in overrides(codex)["model_providers.contextpaw"]
    (config,) = opencode.files.values()
    assert json.loads(config)["provider"]["contextpaw"]["options"]["headers"][SESSION_HEADER] == "0123abcd0123abcd"
    (settings,) = qwen.files.values()
    assert json.loads(settings)["model"]["generationConfig"]["customHeaders"][SESSION_HEADER] == "0123abcd0123abcd"
    assert all("--session=0123abcd0123abcd" in "".join(p.files.values()) + " ".join(p.argv) for p in (claude, codex, opencode, qwen))
