"""Real processes on free loopback ports: the fake backends, and mitmdump or `contextpaw` in front.

Each process is started once per session (about a second each) and stopped group-wide at the end.
"""

from __future__ import annotations

import functools
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.backends import Backend, dead_port, free_port, start_module, start_process
from support.common import FAKE_N_CTX

REPO = Path(__file__).resolve().parents[2]
ADDON = REPO / "contextpaw_addon.py"
FAULT = Path(__file__).with_name("fault.py")
N_CTX = FAKE_N_CTX
"""Every fake backend's window, and the proxies' default window (test_proxy.py says so too)."""
LOOPBACK = "127.0.0.1"


@dataclass
class Proxy:
    """A ContextPaw process and the addresses clients use to reach each backend through it."""

    process: Backend
    ollama: str
    llamacpp: str


@pytest.fixture(scope="session")
def slow_llamacpp(workdir: Path) -> Iterator[Backend]:
    """A llama-server that takes 0.1 s per generated token, to see streaming through the proxy."""
    args = ["--n-ctx", str(N_CTX), "--chunk-delay", "0.1"]
    with start_module("support.fake_llamacpp", args, "/health", workdir / "slow.log") as backend:
        yield backend


@pytest.fixture(scope="session")
def slow_ollama(workdir: Path) -> Iterator[Backend]:
    """A native-mode Ollama (an overflow is a 400) that takes 0.1 s per generated token."""
    args = ["--n-ctx", str(N_CTX), "--native", "--chunk-delay", "0.1"]
    with start_module("support.fake_ollama", args, "/", workdir / "slow-ollama.log") as backend:
        yield backend


@pytest.fixture(scope="session")
def stalling_proxy(workdir: Path) -> Iterator[Proxy]:
    """In front of a native-mode Ollama that sends two generated tokens and then hangs forever: what
    reaches a client from it can only have been streamed."""
    args = ["--n-ctx", str(N_CTX), "--native", "--hang-after", "2"]
    with start_module("support.fake_ollama", args, "/", workdir / "stalling-ollama.log") as backend:
        running = mitmdump(workdir, "stalling-proxy", [backend.url])
        with running.process:
            yield running


def mitmdump(workdir: Path, name: str, upstreams: Sequence[str], *extra: str) -> Proxy:
    """`mitmdump -s contextpaw_addon.py` in reverse mode in front of each upstream, as documented."""
    ports = [free_port() for _ in upstreams]
    argv = [sys.executable, "-c", "from mitmproxy.tools.main import mitmdump; mitmdump()", "-q", "-s", str(ADDON)]
    for upstream, port in zip(upstreams, ports, strict=True):
        argv += ["--mode", f"reverse:{upstream}@{LOOPBACK}:{port}"]
    # one CA for all, but what each learns (calibration, digests) is its own
    argv += ["--set", f"confdir={workdir / 'conf'}", "--set", f"contextpaw_state_dir={workdir / name}-state",
             "--set", "connection_strategy=lazy"]  # fmt: skip
    # no learning: each test sees the estimate as it starts, whatever ran before it
    argv += [
        "--set",
        f"contextpaw_default_ctx={N_CTX}",
        "--set",
        "contextpaw_output_reserve=128",
        "--set",
        "contextpaw_calibrate=false",
        *extra,
    ]
    urls = [f"http://{LOOPBACK}:{port}" for port in ports]
    process = start_process(argv, urls[0], "/contextpaw/health", workdir / f"{name}.log", 30)
    return Proxy(process, urls[0], urls[-1])


@pytest.fixture
def new_mitmdump(workdir: Path) -> Callable[..., Proxy]:
    """Start a mitmdump of the test's own (name, upstreams, *extra arguments); the test stops it."""
    return functools.partial(mitmdump, workdir)


@pytest.fixture(scope="session")
def proxy(workdir: Path, ollama: Backend, llamacpp: Backend) -> Iterator[Proxy]:
    """The documented setup: one process, a reverse mode per backend, kinds found by probing."""
    running = mitmdump(workdir, "proxy", [ollama.url, llamacpp.url])
    with running.process:
        yield running


@pytest.fixture(scope="session")
def usage_whole(workdir: Path, ollama: Backend, llamacpp: Backend) -> Iterator[Proxy]:
    """The documented setup, telling the whole history's size in the usage after a cut."""
    running = mitmdump(workdir, "usage-whole", [ollama.url, llamacpp.url], "--set", "contextpaw_usage_whole=true")
    with running.process:
        yield running


@pytest.fixture(scope="session")
def cutting_ollama(workdir: Path) -> Iterator[Backend]:
    """Fake Ollama as most models run: an overflow is cut in silence (ollama.md §1)."""
    args = ["--n-ctx", str(N_CTX)]
    with start_module("support.fake_ollama", args, "/", workdir / "cutting.log") as backend:
        yield backend


@pytest.fixture(scope="session")
def watching(workdir: Path, cutting_ollama: Backend) -> Iterator[Proxy]:
    """ContextPaw in front of the cutting Ollama."""
    running = mitmdump(workdir, "watching", [cutting_ollama.url])
    with running.process:
        yield running


@pytest.fixture(scope="session")
def summarizing(workdir: Path, llamacpp: Backend) -> Iterator[Proxy]:
    """ContextPaw that puts a digest of each evicted span where its marker goes."""
    running = mitmdump(workdir, "summarizing", [llamacpp.url], "--set", "contextpaw_summarize=true")
    with running.process:
        yield running


@pytest.fixture(scope="session")
def summarizer_down(workdir: Path, llamacpp: Backend) -> Iterator[Proxy]:
    """The same, with its summarizer pointed at a port where nothing answers."""
    dead = f"http://{LOOPBACK}:{dead_port()}"
    running = mitmdump(
        workdir, "summarizer-down", [llamacpp.url], "--set", "contextpaw_summarize=true",
        "--set", f"contextpaw_summarizer_url={dead}", "--set", "contextpaw_summarizer_timeout=2",
    )  # fmt: skip
    with running.process:
        yield running


@pytest.fixture(scope="session")
def strict(workdir: Path, ollama: Backend, llamacpp: Backend) -> Iterator[Proxy]:
    running = mitmdump(workdir, "strict", [ollama.url, llamacpp.url], "--set", "contextpaw_policy=strict")
    with running.process:
        yield running


@pytest.fixture(scope="session")
def faulty(workdir: Path, ollama: Backend) -> Iterator[Proxy]:
    """A proxy whose compaction step raises (tests/e2e/fault.py patches it), to see it fail open."""
    running = mitmdump(workdir, "faulty", [ollama.url], "-s", str(FAULT))
    with running.process:
        yield running


@pytest.fixture(scope="session")
def slow_proxy(workdir: Path, slow_ollama: Backend, slow_llamacpp: Backend) -> Iterator[Proxy]:
    running = mitmdump(workdir, "slow-proxy", [slow_ollama.url, slow_llamacpp.url])
    with running.process:
        yield running


@pytest.fixture(scope="session")
def command(workdir: Path, llamacpp: Backend) -> Iterator[Proxy]:
    """The `contextpaw` command, fronting llama-server and an Ollama that is down."""
    down = f"http://{LOOPBACK}:{dead_port()}"
    port, llama_port = free_port(), free_port()
    argv = [
        sys.executable, "-m", "contextpaw.command.cli", "--ollama", down, "--port", str(port),
        "--llamacpp", llamacpp.url, "--llamacpp-port", str(llama_port), "--confdir", str(workdir / "conf"), "-q",
        "--set", f"contextpaw_default_ctx={N_CTX}", "--set", "contextpaw_output_reserve=128",
        "--set", f"contextpaw_state_dir={workdir / 'command-state'}",
    ]  # fmt: skip
    url = f"http://{LOOPBACK}:{port}"
    with start_process(argv, url, "/contextpaw/health", workdir / "command.log", 30) as process:
        yield Proxy(process, url, f"http://{LOOPBACK}:{llama_port}")


@pytest.fixture(scope="session")
def regular(workdir: Path, ollama: Backend) -> Iterator[str]:
    """mitmdump as a regular HTTP proxy; the Ollama destination is configured. Yields the proxy URL."""
    port = free_port()
    proxy_url = f"http://{LOOPBACK}:{port}"
    argv = [
        sys.executable, "-c", "from mitmproxy.tools.main import mitmdump; mitmdump()", "-q", "-s", str(ADDON),
        "--mode", f"regular@{LOOPBACK}:{port}", "--set", f"confdir={workdir / 'conf'}",
        "--set", "connection_strategy=lazy", "--set", f"contextpaw_ollama={ollama.url}",
        "--set", f"contextpaw_state_dir={workdir / 'regular-state'}",
    ]  # fmt: skip
    # Ready as soon as it is started (Ollama answers `/`); then wait until the proxy answers too.
    with start_process(argv, ollama.url, "/", workdir / "regular.log", 30) as process:
        deadline = time.monotonic() + 30
        while fetch(f"{ollama.url}/contextpaw/health", proxy=proxy_url)[0] != 200:
            assert process.process.poll() is None and time.monotonic() < deadline, process.log.read_text()
            time.sleep(0.1)
        yield proxy_url


@pytest.fixture(scope="session")
def get() -> Callable[..., tuple[int, dict[str, str], bytes]]:
    return fetch


def fetch(url: str, proxy: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """A plain GET (through `proxy` when given), returning status, headers and body even on errors."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy} if proxy else {}))
    try:
        with opener.open(url, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()
    except (urllib.error.URLError, ConnectionError):
        return 0, {}, b""
