"""The `contextpaw` command as a mitmproxy user runs it, and `contextpaw doctor`, against the fakes.

One `contextpaw` process carries several mitmproxy habits at once (a flow file, an extra script, a
`--set` over a preset, a URL without a scheme); each test below checks one of them."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.backends import Backend, dead_port, free_port, start_module, start_process

LOOPBACK = "127.0.0.1"
COMMAND = [sys.executable, "-m", "contextpaw.command.cli"]
SCRIPT = """
class Stamp:
    def response(self, flow):
        flow.response.headers["X-Extra-Script"] = "loaded"

addons = [Stamp()]
"""


def post(url: str, body: dict) -> tuple[int, dict[str, str], dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def chat(words: int) -> dict:
    return {"model": "fake", "max_tokens": 8, "messages": [{"role": "user", "content": "word " * words + "hello"}]}


@dataclass
class Running:
    process: Backend
    url: str
    flows: Path
    backend: str


@pytest.fixture(scope="module")
def command(workdir: Path, llamacpp: Backend) -> Iterator[Running]:
    """`contextpaw --llamacpp HOST:PORT -w F -s SCRIPT --set contextpaw_policy=strict` (no -q: its
    start-up lines are in the log)."""
    script, flows = workdir / "stamp.py", workdir / "command-flows.mitm"
    script.write_text(SCRIPT)
    port = free_port()
    scheme_less = llamacpp.url.removeprefix("http://")
    argv = [
        *COMMAND, "--llamacpp", scheme_less, "--llamacpp-port", str(port), "--confdir", str(workdir / "conf"),
        "-w", str(flows), "-s", str(script), "--set", "contextpaw_policy=strict",
        "--set", f"contextpaw_state_dir={workdir / 'command-habits-state'}", "--set", "contextpaw_calibrate=false",
    ]  # fmt: skip
    url = f"http://{LOOPBACK}:{port}"
    with start_process(argv, url, "/contextpaw/health", workdir / "command-habits.log", 60) as process:
        yield Running(process, url, flows, llamacpp.url)


def test_a_url_without_a_scheme_is_plain_http_and_said_once(command: Running) -> None:
    status, _, answer = post(command.url + "/v1/chat/completions", chat(5))
    assert status == 200 and answer["choices"][0]["message"]["content"]
    log = command.process.log.read_text()
    assert log.count("has no scheme: using http://") == 1


def test_the_startup_line_names_version_policy_and_backend(command: Running) -> None:
    log = command.process.log.read_text()
    assert f"policy strict: llamacpp {command.backend} at {command.url}" in log
    assert "contextpaw 0." in log


def test_set_overrides_the_policy_preset_strict_refuses(command: Running) -> None:
    status, _, answer = post(command.url + "/v1/chat/completions", chat(3000))
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert "policy strict" in answer["error"]["message"]


def test_an_extra_script_is_loaded(command: Running) -> None:
    _, headers, _ = post(command.url + "/v1/chat/completions", chat(5))
    assert headers.get("X-Extra-Script") == "loaded"


def test_flows_written_with_w_are_read_back_with_r(command: Running, workdir: Path) -> None:
    post(command.url + "/v1/chat/completions", chat(7))
    command.process.stop()  # mitmproxy closes the flow file on exit
    argv = [*COMMAND, "-n", "-r", str(command.flows), "--confdir", str(workdir / "conf"), "--flow-detail", "1"]
    read = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert read.returncode == 0, read.stderr
    assert "POST" in read.stdout and "/v1/chat/completions" in read.stdout and "200 OK" in read.stdout


# -- contextpaw doctor -----------------------------------------------------------------------------


def doctor(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    done = subprocess.run([*COMMAND, "doctor", "--timeout", "10", *argv], capture_output=True, text=True, timeout=120, check=False, env=env)
    return done.returncode, done.stdout + done.stderr


def problems(report: str, mark: str = "PROBLEM") -> list[str]:
    """Each PROBLEM line (or another `mark`'s) with the fix under it."""
    lines = report.splitlines()
    return [line + " " + (lines[i + 1] if i + 1 < len(lines) else "") for i, line in enumerate(lines) if line.startswith(mark)]


def notes(report: str) -> list[str]:
    return problems(report, "note")


@pytest.fixture(scope="module")
def small_window_ollama(workdir: Path) -> Iterator[Backend]:
    """An Ollama whose default window (OLLAMA_CONTEXT_LENGTH, or its VRAM tier) is 4096, for a model
    trained on 131072."""
    args = ["--n-ctx", "4096", "--train-ctx", "131072"]
    with start_module("support.fake_ollama", args, "/", workdir / "doctor-ollama.log") as backend:
        yield backend


@pytest.fixture(scope="module")
def divided_llamacpp(workdir: Path) -> Iterator[Backend]:
    """llama-server -c 8192 -np 4: each slot has 2048."""
    args = ["--n-ctx", "2048", "--slots", "4", "--n-ctx-train", "131072"]
    with start_module("support.fake_llamacpp", args, "/health", workdir / "doctor-np.log") as backend:
        yield backend


@pytest.fixture(scope="module")
def fitted_llamacpp(workdir: Path) -> Iterator[Backend]:
    """llama-server asked for -c 32768 that runs 4096 (--fit lowered it)."""
    args = ["--n-ctx", "4096", "--n-ctx-train", "131072"]
    with start_module("support.fake_llamacpp", args, "/health", workdir / "doctor-fit.log") as backend:
        yield backend


def small_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(500)}, unk_token="w0")).save(str(path))
    return path


def test_doctor_finds_windows_tokenizer_and_listener(small_window_ollama: Backend, divided_llamacpp: Backend, workdir: Path) -> None:
    tokenizer = small_tokenizer(workdir / "other-model-tokenizer.json")
    status, report = doctor(
        "--ollama", small_window_ollama.url, "--llamacpp", divided_llamacpp.url, "--ctx", "8192",
        "--host", "0.0.0.0", "--tokenizer", str(tokenizer),
    )  # fmt: skip
    found = problems(report)
    assert status == 1, report
    assert any("4,096 tokens of the 131,072" in p and "OLLAMA_CONTEXT_LENGTH=32768" in p for p in found), report
    assert any("-np 4 divides the -c 8,192" in p and "-c 32768 -np 4" in p for p in found), report
    assert any("has 500 tokens, the model at" in p and "32,000" in p for p in found), report
    assert sum("listens on 0.0.0.0" in p for p in found) == 2, report  # both listeners
    assert len(found) == 5, report
    # Both windows are too small for the agents to live in on their own compaction: a note each, with the fix.
    short = notes(report)
    assert any(small_window_ollama.url in n and "claude (65,536)" in n and "OLLAMA_CONTEXT_LENGTH=65536" in n for n in short), report
    assert any(divided_llamacpp.url in n and "claude (65,536)" in n and "-c 262144 -np 4" in n for n in short), report


def test_doctor_finds_fit_and_a_backend_that_does_not_answer(fitted_llamacpp: Backend) -> None:
    dead = f"http://{LOOPBACK}:{dead_port()}"
    status, report = doctor("--llamacpp", fitted_llamacpp.url, "--ctx", "32768", "--ollama", dead)
    found = problems(report)
    assert status == 1, report
    assert any("--fit lowered the context" in p and "-c 4096" in p for p in found), report
    assert any(p.startswith(f"PROBLEM {dead}: does not answer") for p in found), report
    assert len(found) == 2, report


def test_doctor_finds_https_to_a_plain_http_backend(llamacpp: Backend) -> None:
    secure = "https://" + llamacpp.url.removeprefix("http://")
    status, report = doctor("--llamacpp", secure)
    assert status == 1 and any(f"write {llamacpp.url}" in p for p in problems(report)), report


def test_the_command_refuses_https_to_a_plain_http_backend(llamacpp: Backend) -> None:
    secure = "https://" + llamacpp.url.removeprefix("http://")
    done = subprocess.run([*COMMAND, "--llamacpp", secure], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0 and f"write {llamacpp.url}" in done.stderr


def test_doctor_passes_a_sound_setup(llamacpp: Backend) -> None:
    status, report = doctor("--llamacpp", llamacpp.url)
    assert status == 0 and report.rstrip().endswith("no problems found"), report


@pytest.fixture(scope="module")
def roomy_llamacpp(workdir: Path) -> Iterator[Backend]:
    """llama-server -c 65536: room for every agent to live on its own compaction."""
    args = ["--n-ctx", "65536", "--n-ctx-train", "65536"]
    with start_module("support.fake_llamacpp", args, "/health", workdir / "doctor-roomy.log") as backend:
        yield backend


def test_doctor_says_in_one_line_that_every_agent_fits(roomy_llamacpp: Backend) -> None:
    status, report = doctor("--llamacpp", roomy_llamacpp.url, "--ctx", "65536")
    assert status == 0 and not [n for n in notes(report) if "llama-server" in n], report
    assert f"ok      {roomy_llamacpp.url} (llama-server): 65,536 tokens are enough for every agent `contextpaw launch` starts" in report, (
        report
    )


# -- issue 43: what the doctor got wrong or missed --------------------------------------------------


@pytest.fixture(scope="module")
def np_llamacpp(workdir: Path) -> Iterator[Backend]:
    """llama-server -np 4 without -c: 512 tokens a slot, for a model trained on 32768."""
    args = ["--n-ctx", "512", "--slots", "4", "--n-ctx-train", "32768"]
    with start_module("support.fake_llamacpp", args, "/health", workdir / "doctor-np-no-ctx.log") as backend:
        yield backend


def test_doctor_finds_a_small_slot_of_np_without_ctx(np_llamacpp: Backend) -> None:
    status, report = doctor("--llamacpp", np_llamacpp.url)
    found = problems(report)
    assert status == 1 and any("512 tokens per request (4 slots): -np 4 divides" in p for p in found), report
    assert "--fit" not in report.split("PROBLEM", 1)[1].splitlines()[0], report


def test_doctor_names_swapped_backend_kinds(llamacpp: Backend) -> None:
    status, report = doctor("--ollama", llamacpp.url)
    assert status == 1 and any("--ollama points at a llama-server" in p and f"--llamacpp {llamacpp.url}" in p for p in problems(report)), (
        report
    )


def test_doctor_says_no_such_model_with_the_models_there(small_window_ollama: Backend) -> None:
    status, report = doctor("--ollama", small_window_ollama.url, "--model", "nosuch:1b")
    found = problems(report)
    assert status == 1 and any("model nosuch:1b: no such model (it has " in p for p in found), report
    assert "--timeout" not in report, report


@pytest.mark.parametrize("flag", ["--ctxx", "--jsn"])
def test_doctor_refuses_unknown_flags_with_exit_status_2(llamacpp: Backend, flag: str) -> None:
    status, report = doctor("--llamacpp", llamacpp.url, flag, "1")
    assert status == 2 and "unrecognized arguments" in report, report


def test_doctor_prints_json_with_its_exit_status(llamacpp: Backend) -> None:
    status, report = doctor("--llamacpp", "https://" + llamacpp.url.removeprefix("http://"), "--json")
    parsed = json.loads(report)
    assert status == 1 == parsed["status"] and any(f["level"] == "problem" and "write http://" in f["fix"] for f in parsed["findings"])


def test_doctor_finds_contextpaw_running_and_something_else_on_its_port(llamacpp: Backend, workdir: Path) -> None:
    port = free_port()
    url = f"http://{LOOPBACK}:{port}"
    argv = [*COMMAND, "--llamacpp", llamacpp.url, "--llamacpp-port", str(port), "--confdir", str(workdir / "conf"), "-q",
            "--set", f"contextpaw_state_dir={workdir / 'doctor-state'}", "--set", "contextpaw_calibrate=false"]  # fmt: skip
    with start_process(argv, url, "/contextpaw/health", workdir / "doctor-contextpaw.log", 60):
        status, report = doctor("--llamacpp", llamacpp.url, "--llamacpp-port", str(port))
    assert f"ok      ContextPaw at {url}: answers" in report, report
    backend_port = llamacpp.url.rpartition(":")[2]
    status, report = doctor("--llamacpp", "http://127.0.0.1:1", "--llamacpp-port", backend_port)
    assert any(f"ContextPaw at http://127.0.0.1:{backend_port}: something else answers there" in p for p in problems(report)), report


def test_doctor_finds_clients_that_point_past_contextpaw_or_at_nothing(llamacpp: Backend, tmp_path: Path) -> None:
    import os

    (tmp_path / ".codex").mkdir()
    dead = f"http://127.0.0.1:{dead_port()}/v1"
    (tmp_path / ".codex" / "config.toml").write_text(f'[model_providers.local]\nbase_url = "{dead}"\n')
    env = {**os.environ, "HOME": str(tmp_path), "OPENAI_BASE_URL": llamacpp.url + "/v1"}
    env.pop("ANTHROPIC_BASE_URL", None)
    env.pop("OLLAMA_HOST", None)
    status, report = doctor("--llamacpp", llamacpp.url, "--llamacpp-port", "8092", env=env)
    found = problems(report)
    assert status == 1, report
    assert any(
        "OPENAI_BASE_URL=" in p and "straight at the backend" in p and "OPENAI_BASE_URL=http://127.0.0.1:8092/v1" in p for p in found
    ), report
    assert any("~/.codex/config.toml base_url" in p and "points at nothing" in p for p in found), report


def test_doctor_finds_a_backend_at_contextpaws_own_port(llamacpp: Backend) -> None:
    """ "I forgot to move Ollama off 11434": the server there answers, so only the addresses tell."""
    port = llamacpp.url.rpartition(":")[2]
    status, report = doctor("--llamacpp", llamacpp.url, "--llamacpp-port", port)
    assert status == 1 and any("own listen address" in p and "OLLAMA_HOST=127.0.0.1:11435" in p for p in problems(report)), report
