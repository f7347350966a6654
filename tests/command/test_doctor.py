"""`contextpaw doctor`'s checks: each misconfiguration found, with its fix; a sound set-up passes.

The readings here are what the servers would say; tests/e2e/test_command.py takes them from the fakes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contextpaw.command import doctor, launch
from contextpaw.command.doctor import Answer, LlamaServer, OllamaModel, TokenizerFile
from contextpaw.wire import Kind


def levels(findings: list[doctor.Finding]) -> list[str]:
    return [f.level for f in findings]


def test_an_ollama_window_far_below_the_trained_length_says_how_to_raise_it() -> None:
    [finding] = doctor.check_ollama_window(OllamaModel("http://o:1", "qwen3:8b", 4096, 131072, None))
    assert finding.level == "problem" and "4,096 tokens of the 131,072" in finding.what
    assert "OLLAMA_CONTEXT_LENGTH=32768" in finding.fix and "PARAMETER num_ctx 32768" in finding.fix
    assert "contextpaw_ollama_context_length=32768" in finding.fix


def test_a_modelfile_window_is_fixed_in_the_modelfile() -> None:
    [finding] = doctor.check_ollama_window(OllamaModel("http://o:1", "m", 2048, 32768, 2048))
    assert finding.level == "problem"
    assert "Modelfile sets num_ctx 2048" in finding.fix and "OLLAMA_CONTEXT_LENGTH does not override" in finding.fix


@pytest.mark.parametrize("window, trained", [(32768, 131072), (4096, 8192), (4096, None)])
def test_an_ollama_window_near_the_trained_length_is_fine(window: int, trained: int | None) -> None:
    assert levels(doctor.check_ollama_window(OllamaModel("http://o:1", "m", window, trained, None))) == ["ok"]


def test_an_ollama_window_not_learned_could_not_be_checked() -> None:
    """A model that did not load in time leaves the window unknown: not checked (exit 3), not a note (exit 0)."""
    [finding] = doctor.check_ollama_window(OllamaModel("http://o:1", "m", None, 131072, None))
    assert finding.level == "unchecked" and doctor.exit_status([finding]) == 3


def test_np_dividing_the_context_is_found_with_the_command_line_that_undoes_it() -> None:
    [finding] = doctor.check_llamacpp_window(LlamaServer("http://l:1", 2048, 4, 131072), asked=8192)
    assert finding.level == "problem" and "-np 4 divides the -c 8,192" in finding.what
    assert "-c 32768 -np 4" in finding.fix and "-np 1" in finding.fix


def test_fit_shrinking_the_context_below_c_is_found() -> None:
    [finding] = doctor.check_llamacpp_window(LlamaServer("http://l:1", 4096, 1, 131072), asked=32768)
    assert finding.level == "problem" and "--fit lowered the context" in finding.what and "-c 32,768" in finding.what
    assert "-ctk q8_0" in finding.fix and "-c 4096" in finding.fix


def test_without_c_a_window_below_the_trained_length_is_a_note_that_asks_for_it() -> None:
    [finding] = doctor.check_llamacpp_window(LlamaServer("http://l:1", 8192, 1, 131072), asked=None)
    assert finding.level == "note" and "--ctx N" in finding.fix


@pytest.mark.parametrize(
    "server, asked",
    [
        (LlamaServer("http://l:1", 8192, 1, 131072), 8192),
        (LlamaServer("http://l:1", 8192, 4, 131072), 8192),  # unified: every slot may use all of -c
        (LlamaServer("http://l:1", 1024, 1, 131072), 1000),  # -c 1000 is padded up to a multiple of 256
        (LlamaServer("http://l:1", 32768, 1, 32768), None),
    ],
)
def test_a_window_as_asked_is_fine(server: LlamaServer, asked: int | None) -> None:
    assert levels(doctor.check_llamacpp_window(server, asked)) == ["ok"]


def test_c_above_the_trained_length_is_capped_there() -> None:
    findings = doctor.check_llamacpp_window(LlamaServer("http://l:1", 8192, 1, 8192), asked=32768)
    assert levels(findings) == ["note", "ok"] and "caps each slot" in findings[0].what


def test_a_backend_that_does_not_answer() -> None:
    [finding] = doctor.check_answer(Answer(Kind.OLLAMA, "http://127.0.0.1:9", False))
    assert finding.level == "problem" and finding.what == "does not answer" and "--ollama" in finding.fix


def test_https_to_a_plain_http_server_says_to_write_http() -> None:
    [finding] = doctor.check_answer(Answer(Kind.LLAMACPP, "https://127.0.0.1:8091", False, plain_http=True))
    assert finding.level == "problem" and "write http://127.0.0.1:8091" in finding.fix


def test_a_tokenizer_of_another_vocabulary_is_found() -> None:
    findings = doctor.check_tokenizer(TokenizerFile("t.json", 32000), [("qwen", 151936), ("llama", 32000), ("x", None)])
    assert levels(findings) == ["problem", "ok", "note"]
    assert "32,000 tokens, qwen has 151,936" in findings[0].what and "--tokenizer" in findings[0].fix


def test_gguf_padding_of_the_vocabulary_is_no_mismatch() -> None:
    assert levels(doctor.check_tokenizer(TokenizerFile("t.json", 151665), [("qwen", 151936)])) == ["ok"]


def test_a_tokenizer_file_that_cannot_be_read(tmp_path: Path) -> None:
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{}")
    reading = doctor.read_tokenizer(str(broken))
    assert reading.vocab is None and reading.error
    assert levels(doctor.check_tokenizer(reading, [("m", 32000)])) == ["problem"]


def test_the_vocabulary_of_a_tokenizer_file_is_read(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    path = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(123)}, unk_token="w0")).save(str(path))
    assert doctor.read_tokenizer(str(path)).vocab == 123


@pytest.mark.parametrize(
    "host, level",
    [("127.0.0.1", "ok"), ("::1", "ok"), ("localhost", "ok"), ("0.0.0.0", "problem"), ("", "problem"), ("192.168.1.5", "problem")],
)
def test_a_listener_beyond_the_loopback_is_a_problem(host: str, level: str) -> None:
    [finding] = doctor.check_listeners([("regular", host)])
    assert finding.level == level
    if level == "problem":
        assert "--host 127.0.0.1" in finding.fix


def test_render_shows_each_fix_under_its_finding_and_counts_problems() -> None:
    text = doctor.render([doctor.Finding("ok", "a", "fine"), doctor.Finding("problem", "b", "broken", "mend it")])
    assert text.splitlines() == ["ok      a: fine", "PROBLEM b: broken", "        fix: mend it", "1 problem found"]
    assert text.isascii()


# -- the agents' fixed part against the served window -----------------------------------------------


def launch_refuses(agent: str, window: int) -> bool:
    """Whether `contextpaw launch` refuses to start the agent (without --force) at `window`."""
    return launch.too_small(agent, launch.Target("http://127.0.0.1:8092", "m", window, Kind.LLAMACPP, Path("/state"))) is not None


@pytest.mark.parametrize("window", [1024, 4096, 8192, 16384, 18432, 32768, 65536])
def test_the_agents_short_of_a_window_are_those_launch_refuses_each_with_a_window_launch_accepts(window: int) -> None:
    short = doctor.agents_short_of(window)
    assert set(short) == {agent for agent in launch.FIXED_TOKENS if launch_refuses(agent, window)}
    for agent, need in short.items():
        assert need > window and need % 1024 == 0 and not launch_refuses(agent, need), (agent, need)


def test_at_4096_every_agent_is_short_and_claude_code_needs_the_most() -> None:
    short = doctor.agents_short_of(4096)
    assert set(short) == set(launch.FIXED_TOKENS)
    assert max(short, key=short.__getitem__) == "claude" and doctor.agents_short_of(short["claude"]) == {}


def test_an_ollama_window_too_small_for_agents_names_them_and_how_to_raise_it() -> None:
    short = doctor.agents_short_of(4096)
    [finding] = doctor.check_ollama_agents(OllamaModel("http://o:1", "qwen3:8b", 4096, 131072, None))
    assert finding.level == "note" and finding.subject == "http://o:1 model qwen3:8b"
    assert all(f"{agent} ({need:,})" in finding.what for agent, need in short.items())
    assert "`contextpaw launch` refuses to start them" in finding.what
    most = max(short.values())
    assert f"for all of them, a window of {most:,}" in finding.fix
    assert f"OLLAMA_CONTEXT_LENGTH={most}" in finding.fix and f"contextpaw_ollama_context_length={most}" in finding.fix


def test_an_ollama_window_set_by_the_modelfile_is_raised_in_the_modelfile() -> None:
    [finding] = doctor.check_ollama_agents(OllamaModel("http://o:1", "m", 8192, 131072, 8192))
    assert "Modelfile sets num_ctx 8192" in finding.fix and "OLLAMA_CONTEXT_LENGTH=" not in finding.fix


def test_a_window_that_holds_every_agent_is_one_ok_line() -> None:
    [finding] = doctor.check_ollama_agents(OllamaModel("http://o:1", "m", 65536, 131072, None))
    assert finding.level == "ok" and "every agent" in finding.what and not finding.fix


def test_an_unknown_window_says_nothing_of_agents() -> None:
    assert doctor.check_ollama_agents(OllamaModel("http://o:1", "m", None, 131072, None)) == []
    assert doctor.check_llamacpp_agents(LlamaServer("http://l:1", None, 1, 131072)) == []


def test_llama_server_slots_are_raised_per_slot_and_an_agent_beyond_the_trained_length_needs_another_model() -> None:
    short = doctor.agents_short_of(2048)
    [finding] = doctor.check_llamacpp_agents(LlamaServer("http://l:1", 2048, 4, 32768))
    assert finding.level == "note" and finding.subject == "http://l:1 (llama-server)"
    reachable = max(need for need in short.values() if need <= 32768)
    assert f"-c {reachable * 4} -np 4" in finding.fix and f"-c {reachable} -np 1" in finding.fix
    assert "claude and qwen need more than the 32,768 tokens the model was trained on" in finding.fix
    assert "for codex, opencode and aider" in finding.fix


def test_a_llama_server_window_is_the_smallest_slot() -> None:
    [finding] = doctor.check_llamacpp_agents(LlamaServer("http://l:1", 65536, 2, 131072, slot_windows=(65536, 4096)))
    assert finding.what.startswith("4,096 tokens are too few") and "-c 65536 -np 1" in finding.fix


def test_agents_that_do_not_fit_are_a_note_not_a_problem() -> None:
    text = doctor.render(doctor.check_llamacpp_agents(LlamaServer("http://l:1", 1024, 1, 131072)))
    assert text.startswith("note") and text.endswith("no problems found")


# -- issue 43: cases the doctor got wrong or missed --------------------------------------------------


def test_np_without_ctx_and_a_small_slot_is_a_problem_blaming_np_not_fit() -> None:
    [finding] = doctor.check_llamacpp_window(LlamaServer("http://l:1", 512, 4, 32768), asked=None)
    assert finding.level == "problem" and "-np 4 divides" in finding.what and "--fit" not in finding.what
    assert "-np 1" in finding.fix and "--kv-unified" in finding.fix


def test_a_small_slot_of_a_model_trained_on_no_more_is_not_a_problem() -> None:
    assert levels(doctor.check_llamacpp_window(LlamaServer("http://l:1", 1024, 1, 1024), asked=None)) == ["ok"]


@pytest.mark.parametrize("given, found, said", [(Kind.OLLAMA, Kind.LLAMACPP, "--ollama points at a llama-server"),
                                                (Kind.LLAMACPP, Kind.OLLAMA, "--llamacpp points at an Ollama")])  # fmt: skip
def test_a_backend_that_answers_as_the_other_kind_is_named_as_such(given: Kind, found: Kind, said: str) -> None:
    [finding] = doctor.check_answer(Answer(given, "http://b:1", True, found=found))
    assert finding.level == "problem" and said in finding.what and f"--{found} http://b:1" in finding.fix


def test_an_unknown_model_is_no_such_model_with_the_models_there() -> None:
    [finding] = doctor.check_ollama_window(OllamaModel("http://o:1", "nosuch", None, None, None, available=("qwen3:8b", "llama3:8b")))
    assert finding.level == "problem" and "no such model" in finding.what and "qwen3:8b, llama3:8b" in finding.what
    assert "--timeout" not in finding.fix


def test_exit_status_tells_problems_from_what_could_not_be_checked() -> None:
    ok, note = doctor.Finding("ok", "a", "x"), doctor.Finding("note", "a", "x")
    unchecked, problem = doctor.Finding("unchecked", "a", "x"), doctor.Finding("problem", "a", "x", "fix")
    assert doctor.exit_status([ok, note]) == 0
    assert doctor.exit_status([ok, unchecked, problem]) == 1
    assert doctor.exit_status([ok, unchecked]) == 3
    parsed = json.loads(doctor.as_json([ok, problem]))
    assert parsed["status"] == 1 and parsed["findings"][1] == {"level": "problem", "subject": "a", "what": "x", "fix": "fix", "facts": {}}


def test_json_gives_a_script_the_numbers_not_only_the_sentences() -> None:
    [ollama] = doctor.check_ollama_window(OllamaModel("http://o:1", "qwen3:8b", 4096, 131072, None))
    [llamacpp] = doctor.check_llamacpp_window(LlamaServer("http://l:1", 2048, 4, 131072), asked=8192)
    facts = [f["facts"] for f in json.loads(doctor.as_json([ollama, llamacpp]))["findings"]]
    assert facts[0] == {"kind": "ollama", "model": "qwen3:8b", "window": 4096, "trained": 131072, "modelfile_num_ctx": None}
    assert facts[1] == {"kind": "llamacpp", "window": 2048, "slots": 4, "trained": 131072, "asked": 8192}


def test_client_settings_past_contextpaw_or_at_nothing_are_problems() -> None:
    settings = [
        doctor.ClientSetting("OPENAI_BASE_URL", "http://localhost:11435/v1"),
        doctor.ClientSetting("ANTHROPIC_BASE_URL", "http://127.0.0.1:11434"),
        doctor.ClientSetting("~/.codex/config.toml base_url", "http://127.0.0.1:9/v1", answers=False),
        doctor.ClientSetting("OLLAMA_HOST", "127.0.0.1:11435"),
    ]
    past, mine, nothing, ollama = doctor.check_clients(settings, ["http://127.0.0.1:11434"], ["http://127.0.0.1:11435"])
    assert past.level == "problem" and "straight at the backend" in past.what and past.fix == "OPENAI_BASE_URL=http://127.0.0.1:11434/v1"
    assert mine.level == "ok"
    assert nothing.level == "problem" and "points at nothing" in nothing.what
    assert ollama.level == "note" and "OLLAMA_HOST=127.0.0.1:11434" in ollama.fix


def test_client_settings_are_read_from_the_environment_and_codex_config(tmp_path: Path) -> None:
    (tmp_path / ".codex").mkdir()
    (tmp_path / ".codex" / "config.toml").write_text('[model_providers.local]\nbase_url = "http://127.0.0.1:11434/v1"\n')
    found = doctor.client_settings({"OPENAI_BASE_URL": "http://x:1/v1", "HOME": "/"}, tmp_path)
    assert [(c.name, c.url) for c in found] == [
        ("OPENAI_BASE_URL", "http://x:1/v1"),
        ("~/.codex/config.toml base_url", "http://127.0.0.1:11434/v1"),
    ]


def test_something_else_at_contextpaws_port_is_a_problem() -> None:
    [other] = doctor.check_running(doctor.Running("http://127.0.0.1:11434", 404, False))
    assert other.level == "problem" and "OLLAMA_HOST=127.0.0.1:11435" in other.fix
    assert levels(doctor.check_running(doctor.Running("http://127.0.0.1:11434", 200, True))) == ["ok"]


def test_a_backend_at_contextpaws_own_address_is_a_problem_with_the_fix() -> None:
    [finding] = doctor.check_own_address(["http://localhost:11434", "http://127.0.0.1:11435"], ["http://127.0.0.1:11434"])
    assert finding.level == "problem" and finding.subject == "http://localhost:11434" and "own listen address" in finding.what
    assert "OLLAMA_HOST=127.0.0.1:11435" in finding.fix


def test_a_client_pointed_past_contextpaw_is_told_the_listener_that_fronts_its_own_backend(tmp_path: Path) -> None:
    """It always named the first listener: OPENAI_BASE_URL or Codex's base_url at llama-server was
    told the Ollama port. Now each is told the listener in front of the backend it points at, and an
    Ollama-only setting (aider's OLLAMA_API_BASE) the one in front of Ollama."""
    proxies = ["http://127.0.0.1:11434", "http://127.0.0.1:8092"]
    backends = ["http://127.0.0.1:11435", "http://127.0.0.1:8091"]
    fronts = dict(zip(backends, proxies, strict=True))
    settings = [
        doctor.ClientSetting("OPENAI_BASE_URL", "http://127.0.0.1:8091/v1"),
        doctor.ClientSetting("$CODEX_HOME/config.toml base_url", "http://127.0.0.1:8091/v1"),
        doctor.ClientSetting("OLLAMA_API_BASE", "http://127.0.0.1:11435"),
        doctor.ClientSetting("OLLAMA_API_BASE", "http://127.0.0.1:9", answers=False),
    ]
    openai_, codex, aider, nowhere = doctor.check_clients(settings, proxies, backends, fronts, ollama_side="http://127.0.0.1:11434")
    assert openai_.fix == "OPENAI_BASE_URL=http://127.0.0.1:8092/v1"
    assert codex.fix == 'base_url = "http://127.0.0.1:8092/v1" in $CODEX_HOME/config.toml'
    assert aider.level == "problem" and aider.fix == "OLLAMA_API_BASE=http://127.0.0.1:11434"
    assert nowhere.fix == "OLLAMA_API_BASE=http://127.0.0.1:11434"


def test_codex_home_and_aiders_ollama_base_are_read(tmp_path: Path) -> None:
    (tmp_path / "codex").mkdir()
    (tmp_path / "codex" / "config.toml").write_text('[model_providers.local]\nbase_url = "http://127.0.0.1:8091/v1"\n')
    found = doctor.client_settings({"CODEX_HOME": str(tmp_path / "codex"), "OLLAMA_API_BASE": "http://127.0.0.1:11435"}, tmp_path)
    assert [(c.name, c.url) for c in found] == [
        ("OLLAMA_API_BASE", "http://127.0.0.1:11435"),
        ("$CODEX_HOME/config.toml base_url", "http://127.0.0.1:8091/v1"),
    ]
