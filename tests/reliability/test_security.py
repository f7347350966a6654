"""Security: loopback-only listening, the admin endpoints' guard, the client's credentials passed on
untouched, request-size limits, and no endpoint that starts or stops anything.

Body size: a model request over `contextpaw_max_body_mb` (default 32) gets a 413 in the caller's
API; other routes (Ollama's blob uploads) are not limited; a ~100 MB body goes through in bounded
time and memory (test_bad_input.py). mitmproxy's `body_size_limit`, checked before any hook, is the
operator's hard cap on memory: what it refuses gets mitmproxy's own page.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.backends import REPO, Backend, free_port, start_process

LOOPBACK = "127.0.0.1"


# -- what a process listens on ----------------------------------------------------------------------


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def listening(pid: int) -> list[tuple[str, str, int]]:
    """(protocol, address, port) of every TCP listener and bound UDP socket the process holds."""
    inodes = _socket_inodes(pid)
    found = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if inode in inodes and (state == "0A" or proto.startswith("udp")):
                found.append((proto, *_address(local)))
    return found


def is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def non_loopback_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: it only picks a source address
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def assert_loopback_only(pid: int, ports: list[int]) -> None:
    sockets = listening(pid)
    assert {port for _, _, port in sockets} >= set(ports), sockets
    assert all(is_loopback(address) for _, address, _ in sockets), f"listening beyond loopback: {sockets}"
    other = non_loopback_address()
    if other:
        for port in ports:
            with socket.socket() as s, pytest.raises(OSError):
                s.settimeout(1)
                s.connect((other, port))


def test_the_listener_check_catches_all_interfaces(cases: Any) -> None:
    """The check itself: a socket bound to 0.0.0.0 is caught."""
    import os

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        with pytest.raises(AssertionError, match="beyond loopback"):
            assert_loopback_only(os.getpid(), [s.getsockname()[1]])
    cases["security"] += 1


@pytest.fixture(scope="module")
def command(workdir: Path, ollama: Backend, llamacpp: Backend) -> Iterator[tuple[Backend, int, int]]:
    """The `contextpaw` command as documented, with a 2 MB body limit set by the operator."""
    port, llama_port = free_port(), free_port()
    argv = [
        sys.executable, "-m", "contextpaw.command.cli", "--ollama", ollama.url, "--port", str(port),
        "--llamacpp", llamacpp.url, "--llamacpp-port", str(llama_port), "--confdir", str(workdir / "conf"), "-q",
        "--set", "contextpaw_max_body_mb=2",
    ]  # fmt: skip
    with start_process(argv, f"http://{LOOPBACK}:{port}", "/contextpaw/health", workdir / "command.log", 30) as process:
        yield process, port, llama_port


def test_the_contextpaw_command_listens_on_loopback_only(command: tuple[Backend, int, int], cases: Any) -> None:
    process, port, llama_port = command
    assert_loopback_only(process.process.pid, [port, llama_port])
    cases["security"] += 1


def documented_mitmdump_line() -> list[str]:
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```sh\n(mitmdump -s contextpaw_addon\.py.*?)```", readme, re.S)
    assert block, "README.md no longer documents a mitmdump line"
    return shlex.split(block.group(1).replace("\\\n", " "))


def test_the_documented_mitmdump_line_listens_on_loopback_only(workdir: Path, ollama: Backend, llamacpp: Backend, cases: Any) -> None:
    argv = documented_mitmdump_line()
    upstreams = iter([ollama.url, llamacpp.url])
    ports: list[int] = []

    def reverse(match: re.Match[str]) -> str:
        ports.append(free_port())
        return f"reverse:{next(upstreams)}@{match.group(1)}:{ports[-1]}"

    argv = [re.sub(r"reverse:http://[\d.]+:\d+@([\d.]+):\d+", reverse, a) for a in argv]
    argv = [sys.executable, "-c", "from mitmproxy.tools.main import mitmdump; mitmdump()", *argv[1:]]
    argv = [str(REPO / a) if a == "contextpaw_addon.py" else a for a in argv]
    argv += ["-q", "--set", f"confdir={workdir / 'conf'}"]
    assert len(ports) == 2, argv
    with start_process(argv, f"http://{LOOPBACK}:{ports[0]}", "/contextpaw/health", workdir / "documented.log", 30) as process:
        assert_loopback_only(process.process.pid, ports)
    cases["security"] += 1


# -- request size -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "shape"), [("/api/chat", str), ("/v1/chat/completions", dict)])
def test_a_body_over_the_limit_gets_a_json_413_in_the_api_convention_and_the_proxy_stays_up(
    command: tuple[Backend, int, int], kit: Any, cases: Any, path: str, shape: type
) -> None:
    _, port, _ = command
    url = f"http://{LOOPBACK}:{port}{path}"
    big = {"model": "fake", "messages": [{"role": "user", "content": "x" * (3 << 20)}], "stream": False}
    refused = httpx.post(url, json=big, timeout=20)
    assert refused.status_code == 413 and refused.headers["content-type"].startswith("application/json")
    error = refused.json()["error"]
    assert isinstance(error, shape) and "contextpaw_max_body_mb" in str(error)
    small = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    assert httpx.post(url, json=small, timeout=20).status_code == 200
    assert kit.health(f"http://{LOOPBACK}:{port}")["stats"]["too_large"] >= 1
    blob = httpx.post(f"http://{LOOPBACK}:{port}/api/blobs/sha256:abc", content=b"x" * (3 << 20), timeout=20)
    assert blob.status_code != 413, "only model requests are limited: Ollama's blob uploads are big by nature"
    cases["security"] += 3


# -- the admin endpoints ----------------------------------------------------------------------------

ADMIN_PATHS = ["/contextpaw/health", "/contextpaw/metrics", "/contextpaw/evicted/x", "/contextpaw/runtime", "/contextpaw/nope"]
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"]


async def admin_call(
    harness: Any, kit: Any, path: str, peer: str, method: str = "GET", token: str | None = None, headers: dict[str, str] | None = None
) -> Any:
    headers = {**({"X-ContextPaw-Token": token} if token is not None else {}), **(headers or {})}
    flow = kit.flow_for(path, b"", method=method, peer=peer, headers=headers)
    await harness.send(flow)
    return flow


@pytest.mark.parametrize("peer", ["192.168.1.20", "10.0.0.5", "8.8.8.8", "::ffff:192.168.1.20", "fe80::1", "not-an-ip", ""])
@pytest.mark.parametrize("path", ADMIN_PATHS)
async def test_admin_endpoints_are_refused_to_non_loopback_clients_without_the_token(
    harness: Any, kit: Any, cases: Any, peer: str, path: str
) -> None:
    for method in METHODS:
        for token in (None, "", "guess"):
            flow = await admin_call(harness, kit, path, peer, method, token)
            assert flow.response is not None and flow.response.status_code == 403, (peer, path, method)
            assert b"prompt" not in flow.response.content and "error" in json.loads(flow.response.content)
            cases["security"] += 1
    harness.tctx.configure(harness.admin, contextpaw_admin_token="s3cret")
    for token in (None, "", "S3CRET", "s3cret "):
        flow = await admin_call(harness, kit, path, peer, "GET", token)
        assert flow.response.status_code == 403
        cases["security"] += 1


@pytest.mark.parametrize("peer", ["192.168.1.20", "8.8.8.8", "fe80::1"])
async def test_admin_endpoints_are_allowed_with_the_token(harness: Any, kit: Any, cases: Any, peer: str) -> None:
    harness.tctx.configure(harness.admin, contextpaw_admin_token="s3cret")
    flow = await admin_call(harness, kit, "/contextpaw/metrics", peer, token="s3cret")
    assert flow.response.status_code == 200 and b"contextpaw_requests_total" in flow.response.content
    cases["security"] += 1


@pytest.mark.parametrize("peer", ["127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1"])
async def test_admin_endpoints_are_open_to_loopback_clients(harness: Any, kit: Any, cases: Any, peer: str) -> None:
    flow = await admin_call(harness, kit, "/contextpaw/metrics", peer)
    assert flow.response.status_code == 200
    cases["security"] += 1


READ_STATUS = {
    "/contextpaw/health": 503,  # the harness's backends are not listening
    "/contextpaw/metrics": 200,
    "/contextpaw/runtime": 200,  # arbitration off: {"enabled": false}
    "/contextpaw/evicted/x": 404,  # nothing is kept under that id
    "/contextpaw/nope": 404,
    "/contextpaw/runtime/pin": 404,
    "/contextpaw/shutdown": 404,
    "/contextpaw/restart": 404,
    "/contextpaw/stop": 404,
}
"""What a loopback GET of each path answers: the read endpoints 200, every other path 404."""


@pytest.mark.parametrize(("path", "read_status"), READ_STATUS.items())
async def test_no_endpoint_changes_anything(harness: Any, kit: Any, cases: Any, path: str, read_status: int) -> None:
    """Not even for loopback clients: every non-read method is refused with a 405, on every path,
    so nothing can start, stop, pin or kill a process through the proxy."""
    assert set(ADMIN_PATHS) <= READ_STATUS.keys()
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        flow = await admin_call(harness, kit, path, "127.0.0.1", method)
        assert flow.response is not None and flow.response.status_code == 405, (path, method)
        assert json.loads(flow.response.content) == {"error": f"{method} is not allowed on {path}"}
        cases["security"] += 1
    flow = await admin_call(harness, kit, path, "127.0.0.1", "GET")
    assert flow.response.status_code == read_status, path


# -- credentials ------------------------------------------------------------------------------------


@pytest.mark.parametrize("overflowing", [False, True])
def test_the_clients_authorization_reaches_the_backend_unchanged(proxy: Any, fault_server: Any, cases: Any, overflowing: bool) -> None:
    import uuid

    req_id = uuid.uuid4().hex
    turns = 40 if overflowing else 1
    body = {
        "model": "fault",
        "messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"t{i} " + "w " * 100} for i in range(turns)],
    }
    secret = "Bearer sk-" + "Zz9/+=" * 6
    response = httpx.post(
        proxy["fault"] + "/v1/chat/completions", json=body, timeout=10,
        headers={"Authorization": secret, "X-Req-Id": req_id, "X-Api-Key": "k-1", "Cookie": "session=abc"},
    )  # fmt: skip
    assert response.status_code == 200
    assert response.json()["contextpaw"]["compacted"] is overflowing
    [seen] = fault_server.hits(req_id)
    assert seen.headers["Authorization"] == secret
    assert (seen.headers["X-Api-Key"], seen.headers["Cookie"]) == ("k-1", "session=abc")
    cases["security"] += 1


@pytest.mark.parametrize("host", ["evil.example", "evil.example:11434", "127.0.0.1.evil.example", "192.168.1.2:11434", "[fe80::1]:80", ""])
@pytest.mark.parametrize("path", ADMIN_PATHS)
async def test_admin_endpoints_refuse_a_loopback_client_that_names_another_host(
    harness: Any, kit: Any, cases: Any, host: str, path: str
) -> None:
    """DNS rebinding: a web page whose name resolves to 127.0.0.1 is a loopback client, but its
    browser sends the page's name as the Host; without the token it learns nothing."""
    flow = await admin_call(harness, kit, path, "127.0.0.1", headers={"Host": host})
    assert flow.response is not None and flow.response.status_code == 403, (host, path)
    assert b"prompt" not in flow.response.content
    harness.tctx.configure(harness.admin, contextpaw_admin_token="s3cret")
    flow = await admin_call(harness, kit, "/contextpaw/metrics", "127.0.0.1", token="s3cret", headers={"Host": host})
    assert flow.response.status_code == 200
    cases["security"] += 2


@pytest.mark.parametrize(
    "host", ["localhost", "LOCALHOST:11434", "localhost.", "127.0.0.1", "127.8.9.10:80", "[::1]", "[::1]:11434", "app.localhost:3000"]
)
async def test_admin_endpoints_answer_a_loopback_client_that_names_a_loopback_host(harness: Any, kit: Any, cases: Any, host: str) -> None:
    flow = await admin_call(harness, kit, "/contextpaw/metrics", "127.0.0.1", headers={"Host": host})
    assert flow.response is not None and flow.response.status_code == 200, host
    cases["security"] += 1
