"""Session fixtures for tests against a real llama-server running SmolLM2-135M-Instruct.

Without the binary or the model these tests skip, saying what is missing; under CI (``$CI`` set)
the binary is built if need be and anything still missing is a failure, so the proof cannot
silently disappear from a pipeline.

Two llama-servers: ``llama_server`` (2048-token slot) under the Ollama simulator, and
``small_llama_server`` (1024-token slot, a strict chat template) for the 400 and the template tests.
Each backend has a ContextPaw in front of it: mitmdump with the addon, as the README runs it.
"""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.backends import (
    Backend,
    free_port,
    locate_llama_server,
    locate_smollm2,
    running,
    start_llama_server,
    start_process,
    start_proxy,
)
from support.common import LOOPBACK
from support.fake_ollama import OllamaSettings
from support.ollama_sim import ollama_sim_app

SERVER_N_CTX = 2048  # the llama-server slot; the simulator's windows are at most this
SMALL_N_CTX = 1024  # the slot of the llama-server that answers an overflow with its 400
SIM_MODEL = "smollm2:135m"

STRICT_CHATML = """\
{%- for message in messages -%}
{%- if message['role'] == 'system' and not loop.first -%}
{{ raise_exception('strict template: a system message must come first') }}
{%- endif -%}
{%- if not loop.first and message['role'] != 'tool' and message['role'] == messages[loop.index0 - 1]['role'] -%}
{{ raise_exception('strict template: roles must alternate') }}
{%- endif -%}
{%- if message['role'] == 'tool' and (loop.first or messages[loop.index0 - 1]['role'] not in ['assistant', 'tool']) -%}
{{ raise_exception('strict template: a tool result must follow a tool call') }}
{%- endif -%}
{%- if loop.first and message['role'] != 'system' -%}
{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}
{%- endif -%}
{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}
"""
"""SmolLM2's own ChatML, rendering the same text for every chat it accepts, but as strict as Gemma's or
Mistral's templates: a system message only first, no two messages of one role in a row (tool results
excepted), a tool result only after a tool call. A marker placed carelessly is then a 400 from the
server's template, not a silent success."""


@pytest.fixture(scope="session")
def real_backend() -> tuple[Path, Path]:
    """The llama-server binary and the SmolLM2 model: skipped when missing, a failure under CI."""
    in_ci = bool(os.environ.get("CI"))
    binary, model = locate_llama_server(build=in_ci), locate_smollm2()
    if binary.path is None or model.path is None:
        reason = binary.reason or model.reason
        if in_ci:
            pytest.fail(f"CI needs the real backend: {reason}")
        pytest.skip(reason)
    return binary.path, model.path


@pytest.fixture(scope="session")
def llama_server(real_backend: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    binary, model = real_backend
    log = tmp_path_factory.mktemp("llama-server") / "llama-server.log"
    with start_llama_server(binary, model, SERVER_N_CTX, log) as server:
        yield server


@pytest.fixture(scope="session")
def small_llama_server(real_backend: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    """llama-server with a 1024-token slot (so an overflow is its 400) and :data:`STRICT_CHATML`."""
    binary, model = real_backend
    work = tmp_path_factory.mktemp("small-llama-server")
    template = work / "strict-chatml.jinja"
    template.write_text(STRICT_CHATML)
    port = free_port()
    argv = [
        str(binary), "-m", str(model), "-c", str(SMALL_N_CTX), "-np", "1", "--host", LOOPBACK, "--port", str(port),
        "--chat-template-file", str(template),
    ]  # fmt: skip
    with start_process(argv, f"http://{LOOPBACK}:{port}", "/health", work / "llama-server.log", 120) as server:
        yield server


@pytest.fixture(scope="session")
def sim_model() -> str:
    return SIM_MODEL


@pytest.fixture(scope="session")
def ollama_sim(llama_server: Backend) -> Iterator[str]:
    """The simulator's base URL, served from a thread of the test process."""
    with running(ollama_sim_app(llama_server.url, OllamaSettings(model=SIM_MODEL, num_ctx=SERVER_N_CTX))) as url:
        yield url


@pytest.fixture(scope="session")
def sim_proxy(ollama_sim: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """ContextPaw (mitmdump with the addon) in front of the Ollama simulator; its base URL."""
    work = tmp_path_factory.mktemp("sim-proxy")
    options = [f"contextpaw_ollama={ollama_sim}"]
    with start_proxy(ollama_sim, work / "conf", work / "mitmdump.log", options=options) as proxy:
        yield proxy.url


@pytest.fixture(scope="session")
def llama_proxy(small_llama_server: Backend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """ContextPaw in front of the small llama-server, configured as a llama.cpp backend; its base URL.

    It asks the server for its window (``/props``) and counts with its tokenizer, so an overflow is
    compacted before it is sent."""
    work = tmp_path_factory.mktemp("llama-proxy")
    options = [f"contextpaw_llamacpp={small_llama_server.url}"]
    with start_proxy(small_llama_server.url, work / "conf", work / "mitmdump.log", options=options) as proxy:
        yield proxy.url


@pytest.fixture(scope="session")
def rescue_proxy(small_llama_server: Backend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """ContextPaw in front of the small llama-server without window discovery: it believes the default
    4096-token window, forwards the overflow, and learns the real window from the 400 it rescues."""
    work = tmp_path_factory.mktemp("rescue-proxy")
    options = [f"contextpaw_llamacpp={small_llama_server.url}", "contextpaw_discover_window=false"]
    with start_proxy(small_llama_server.url, work / "conf", work / "mitmdump.log", options=options) as proxy:
        yield proxy.url


AGENT_N_CTX = 8192
SHORT_ANSWER = 'root ::= [A-Za-z ]{1,40} "."'
"""The agents' tests keep each answer to a short sentence: this llama-server build does not clamp a
request's max_tokens (Claude Code asks for 32,000) to `-n`, and SmolLM2 would write until the
window is full."""


@pytest.fixture(scope="module")
def server_8192(real_backend: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    """A real llama-server with an 8,192-token window and the short-answer grammar, for the agent CLIs."""
    binary, model = real_backend
    work = tmp_path_factory.mktemp("llama-server-8192")
    port = free_port()
    argv = [str(binary), "-m", str(model), "-c", str(AGENT_N_CTX), "-np", "1", "--grammar", SHORT_ANSWER,
            "--host", LOOPBACK, "--port", str(port)]  # fmt: skip
    with start_process(argv, f"http://{LOOPBACK}:{port}", "/health", work / "llama-server.log", 120) as server:
        yield server
