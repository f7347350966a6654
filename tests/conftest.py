"""Fixtures shared by the end-to-end and reliability suites: the fast fake servers, one of each per run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from support.backends import Backend, start_module
from support.cases import CASES, WORKER_KEY
from support.common import FAKE_N_CTX

# CI replays the same examples every run, so a red build means a change broke something; runs
# elsewhere explore new examples (and keep what they find in .hypothesis/).
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker hands its counts of cases tried to the controller."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output[WORKER_KEY] = dict(CASES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    CASES.update(getattr(node, "workeroutput", {}).get(WORKER_KEY, {}))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not CASES:
        return
    terminalreporter.section("ContextPaw reliability: cases tried")
    for name, count in sorted(CASES.items()):
        terminalreporter.write_line(f"{name:40s} {count:8d}")
    terminalreporter.write_line(f"{'total':40s} {sum(CASES.values()):8d}")


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Logs and config of the processes a test session starts."""
    return tmp_path_factory.mktemp("processes")


@pytest.fixture(scope="session")
def ollama(workdir: Path) -> Iterator[Backend]:
    """Fake Ollama in native mode: an overflow is llama-server's 400, wrapped in a string."""
    args = ["--n-ctx", str(FAKE_N_CTX), "--native"]
    with start_module("support.fake_ollama", args, "/", workdir / "ollama.log") as backend:
        yield backend


@pytest.fixture(scope="session")
def llamacpp(workdir: Path) -> Iterator[Backend]:
    args = ["--n-ctx", str(FAKE_N_CTX)]
    with start_module("support.fake_llamacpp", args, "/health", workdir / "llamacpp.log") as backend:
        yield backend
