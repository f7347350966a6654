"""The `contextpaw` command ended by Ctrl-C says so in one line, without a traceback, wherever it is
stopped (issue 43, item 12)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from support.common import LOOPBACK

ENTRY = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); from contextpaw.command.entry import main; main()"
"""The console script as an interactive shell runs it: Ctrl-C raises KeyboardInterrupt (a shell's
background job, or a test run under one, may start with SIGINT ignored)."""
COMMAND = [sys.executable, "-c", ENTRY]


def test_ctrl_c_while_the_command_starts_ends_in_one_line_with_status_130(tmp_path: Path) -> None:
    """The command is stopped where it waits at start: the TLS probe of an https backend that
    accepts the connection and never answers; Ctrl-C comes once the probe has connected."""
    with socket.socket() as silent:
        silent.bind((LOOPBACK, 0))
        silent.listen()
        silent.settimeout(120)
        port = silent.getsockname()[1]
        argv = [*COMMAND, "--llamacpp", f"https://{LOOPBACK}:{port}", "--confdir", str(tmp_path / "conf")]
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            connection, _ = silent.accept()
            process.send_signal(signal.SIGINT)
            out, err = process.communicate(timeout=60)
            connection.close()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.strip() == "contextpaw: interrupted", err[-3000:]
    assert process.returncode == 130


def test_a_keyboard_interrupt_anywhere_in_the_command_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from contextpaw.command import cli, entry

    def interrupt(_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "check_tls", interrupt)
    try:
        entry.main(["--llamacpp", "http://127.0.0.1:1"])
        status: object = "went on"
    except SystemExit as ended:
        status = ended.code
    except KeyboardInterrupt:  # caught here, or pytest would take it for the user's and stop the session
        status = "a traceback"
    assert status == 130
    assert capsys.readouterr().err == "contextpaw: interrupted\n"


def test_a_running_command_stopped_by_ctrl_c_prints_no_traceback(tmp_path: Path) -> None:
    """Once the proxy runs, mitmproxy's own handler shuts it down cleanly."""
    from support.backends import free_port

    port = free_port()
    argv = [*COMMAND, "--llamacpp", f"http://{LOOPBACK}:1", "--llamacpp-port", str(port), "--confdir", str(tmp_path / "conf"),
            "--set", f"contextpaw_state_dir={tmp_path / 'state'}"]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines: list[str] = []
        started = threading.Event()

        def read() -> None:
            assert process.stdout is not None
            with process.stdout as stream:  # closed at its end, by the thread that read it
                for line in stream:
                    lines.append(line)
                    if "/contextpaw/health on each" in line:
                        started.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert started.wait(120), "".join(lines)[-3000:]
        process.send_signal(signal.SIGINT)
        process.wait(60)
        reader.join(10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    said = "".join(lines)
    assert "Traceback" not in said, said[-3000:]
    assert process.returncode in (0, 130), said[-3000:]


def test_a_connect_called_back_after_ctrl_c_cancelled_it_prints_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """CPython 3.12.1 calls a cancelled connect's callback, which raises InvalidStateError on the loop;
    the probes' loop keeps that out of the one line Ctrl-C owes, and still reports any other failure."""
    import asyncio

    from contextpaw.command.cli import run_probes

    def late_connect() -> None:
        raise asyncio.InvalidStateError("invalid state")

    def broken() -> None:
        raise ValueError("a real failure")

    async def probes() -> str:
        loop = asyncio.get_running_loop()
        loop.call_soon(late_connect)
        loop.call_soon(broken)
        await asyncio.sleep(0.01)
        return "answers"

    with caplog.at_level("ERROR", logger="asyncio"):
        assert run_probes(probes()) == "answers"
    assert "InvalidStateError" not in caplog.text
    assert "a real failure" in caplog.text
