"""Session fixtures for tests against a real llama-server running SmolLM2-135M-Instruct.

Without the binary or the model these tests skip, saying what is missing; under CI (``$CI`` set)
the binary is built if need be and anything still missing is a failure, so the proof cannot
silently disappear from a pipeline.
"""

import os
from collections.abc import Iterator

import pytest

from contextpaw.testing.backends import Backend, locate_llama_server, locate_smollm2, running, start_llama_server
from contextpaw.testing.fake_ollama import OllamaSettings
from contextpaw.testing.ollama_sim import ollama_sim_app

SERVER_N_CTX = 2048  # the llama-server slot; the simulator's windows are at most this
SIM_MODEL = "smollm2:135m"


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    in_ci = bool(os.environ.get("CI"))
    binary, model = locate_llama_server(build=in_ci), locate_smollm2()
    if binary.path is None or model.path is None:
        reason = binary.reason or model.reason
        if in_ci:
            pytest.fail(f"CI needs the real backend: {reason}")
        pytest.skip(reason)
    log = tmp_path_factory.mktemp("llama-server") / "llama-server.log"
    with start_llama_server(binary.path, model.path, SERVER_N_CTX, log) as server:
        yield server


@pytest.fixture(scope="session")
def sim_model() -> str:
    return SIM_MODEL


@pytest.fixture(scope="session")
def ollama_sim(llama_server: Backend) -> Iterator[str]:
    """The simulator's base URL, served from a thread of the test process."""
    with running(ollama_sim_app(llama_server.url, OllamaSettings(model=SIM_MODEL, num_ctx=SERVER_N_CTX))) as url:
        yield url
