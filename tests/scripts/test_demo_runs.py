"""The demos say where they are and leave nothing running (issue 43, item 12): a progress line per
request on stderr, and Ctrl-C, SIGTERM or SIGHUP stop the servers a demo started and end it in one
line, without a traceback. scripts/demo/demo_400.py is run on the fake llama-server (``--llama``),
where its requests are quick; the helper itself on a server that never becomes ready."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import backends
from support.backends import REPO, Backend, start_module
from support.demo_runs import Progress, duration

DEMO_400 = REPO / "scripts" / "demo" / "demo_400.py"
RESTORE_SIGINT = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
"""Ctrl-C as in a terminal (a test run from a shell's background job may start with SIGINT ignored)."""


# -- the progress line ------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_each_step_says_its_count_the_time_so_far_and_after_the_first_what_is_left() -> None:
    clock, out = Clock(), io.StringIO()
    progress = Progress(4, out, clock)
    progress.step("trial 1/2, direct")
    clock.now += 70
    progress.step("trial 1/2, ContextPaw")
    clock.now += 110
    progress.step("trial 2/2, direct")
    clock.now += 60
    progress.step("trial 2/2, ContextPaw")
    clock.now += 90
    progress.end()
    assert out.getvalue().splitlines() == [
        "[1/4] trial 1/2, direct (0 s so far)",
        "[2/4] trial 1/2, ContextPaw (1 min 10 s so far, about 3 min 30 s left)",
        "[3/4] trial 2/2, direct (3 min so far, about 3 min left)",
        "[4/4] trial 2/2, ContextPaw (4 min so far, about 1 min 20 s left)",
        "[4/4] done in 5 min 30 s",
    ]


def test_a_step_line_is_written_with_its_newline_so_a_signal_cannot_leave_it_open() -> None:
    class Interrupted(io.StringIO):
        """A stream on which the stop signal arrives right after the first write."""

        def write(self, text: str) -> int:
            super().write(text)
            raise KeyboardInterrupt

    out = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        Progress(2, out).step("trial 1/1, direct")
    assert out.getvalue().endswith(")\n")  # the demo's last line starts a line of its own


def test_what_is_left_counts_each_step_at_the_mean_of_its_own_kind() -> None:
    """A refusal that comes back at once does not make the compactions look quick."""
    clock, out = Clock(), io.StringIO()
    progress = Progress(["direct", "ContextPaw"] * 3, out, clock)
    progress.step("trial 1/3, direct")
    clock.now += 1
    progress.step("trial 1/3, ContextPaw")
    clock.now += 99
    progress.step("trial 2/3, direct")
    clock.now += 3
    progress.step("trial 2/3, ContextPaw")
    assert out.getvalue().splitlines() == [
        "[1/6] trial 1/3, direct (0 s so far)",
        "[2/6] trial 1/3, ContextPaw (1 s so far, about 5 s left)",  # 5 steps at the only mean there is
        "[3/6] trial 2/3, direct (1 min 40 s so far, about 3 min 20 s left)",  # 2 direct at 1 s, 2 ContextPaw at 99 s
        "[4/6] trial 2/3, ContextPaw (1 min 43 s so far, about 3 min 20 s left)",  # 99 + 2 (direct's mean now) + 99
    ]


@pytest.mark.parametrize(
    ("seconds", "said"), [(0.4, "0 s"), (59, "59 s"), (60, "1 min"), (125, "2 min 5 s"), (3600, "1 h"), (3725, "1 h 2 min")]
)
def test_a_duration_reads_as_a_wait_is_read(seconds: float, said: str) -> None:
    assert duration(seconds) == said


# -- nothing left running -----------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """Those of ``pids`` still running after ``seconds`` (a process stopped by its group's SIGTERM
    is reaped by init a moment after its parent ends)."""
    deadline = time.monotonic() + seconds
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def end_all(pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.killpg(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def fake_llama(workdir: Path) -> Iterator[Backend]:
    with start_module("support.fake_llamacpp", ["--n-ctx", "1024"], "/health", workdir / "demo-runs-llama.log") as backend:
        yield backend


def start_demo(argv: list[str], tmp_path: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """The demo as a terminal starts it; its stderr lines collect in the returned list."""
    code = RESTORE_SIGINT + "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    process = subprocess.Popen(
        [sys.executable, "-c", code, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**backends.tests_on_path(), "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    lines: list[str] = []

    def read() -> None:
        assert process.stderr is not None
        with process.stderr as stream:  # closed at its end, by the thread that read it
            lines.extend(stream)

    threading.Thread(target=read, daemon=True).start()
    return process, lines


def wait_for(lines: list[str], text: str, process: subprocess.Popen[str], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not any(text in line for line in lines):
        assert process.poll() is None and time.monotonic() < deadline, f"no {text!r} in:\n" + "".join(lines)[-3000:]
        time.sleep(0.1)


@pytest.mark.parametrize(("sent", "status", "said"), [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_a_stopped_400_demo_stops_its_mitmdump_and_says_so_in_one_line(
    fake_llama: Backend, tmp_path: Path, sent: signal.Signals, status: int, said: str
) -> None:
    process, lines = start_demo([str(DEMO_400), "--llama", fake_llama.url, "--trials", "100000"], tmp_path)
    started: list[int] = []
    try:
        wait_for(lines, "[2/", process)
        started = children(process.pid)
        assert started, "the demo started mitmdump"
        process.send_signal(sent)
        assert process.wait(60) == status, "".join(lines)[-3000:]
        assert gone_within(started, 30) == [], "left running"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        end_all(started)
    said_at_end = "".join(lines)
    assert "Traceback" not in said_at_end, said_at_end[-3000:]
    assert lines[-1].strip() == f"demo_400: {said}; stopped mitmdump"
    assert lines[0].startswith("[1/200002] trial 1/100000, direct (")


NEVER_READY = """
import contextlib, os, sys, time
from pathlib import Path
from support.backends import free_port, start_process
from support.demo_runs import run_demo

def main(argv):
    work = Path(sys.argv[1])
    with contextlib.ExitStack() as stack:
        child = [sys.executable, "-c", "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)",
                 str(work / "child.pid")]
        stack.enter_context(start_process(child, f"http://127.0.0.1:{free_port()}", "/health", work / "child.log", 600))
    return 0

sys.exit(run_demo(main, name="never-ready", servers="its server"))
"""


def test_ctrl_c_while_a_demo_waits_for_its_server_to_start_stops_that_server(tmp_path: Path) -> None:
    """The server is not the demo's ExitStack's yet: start_process stops it itself."""
    script = tmp_path / "never_ready.py"
    script.write_text(NEVER_READY)
    process, lines = start_demo([str(script), str(tmp_path)], tmp_path)
    pid_file, child = tmp_path / "child.pid", 0
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        child = int(pid_file.read_text())
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 130, "".join(lines)
        assert gone_within([child], 30) == [], "left running"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        end_all([child] if child else [])
    assert "".join(lines).strip() == "never-ready: interrupted; stopped its server"


# -- demo.sh --------------------------------------------------------------------------------------------


def test_demo_sh_says_which_demo_of_five_starts_before_each(tmp_path: Path) -> None:
    """On a copy of demo.sh, with a set-up that has nothing to do and a Python that says what it runs."""
    (tmp_path / "scripts" / "demo").mkdir(parents=True)
    (tmp_path / "scripts" / "install").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "demo" / "demo.sh", tmp_path / "scripts" / "demo" / "demo.sh")
    (tmp_path / "scripts" / "install" / "setup.sh").write_text("")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/usr/bin/env bash\necho "runs ${1##*/}" >&2\n')
    python.chmod(0o755)
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "demo" / "demo.sh")], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    said = done.stderr.splitlines()
    assert [line.split(":")[0] for line in said[::2]] == [f"demo [{i}/5]" for i in range(1, 6)]
    assert said[1::2] == [
        "runs demo_needle.py",
        "runs demo_400.py",
        "runs demo_messages.py",
        "runs demo_responses.py",
        "runs demo_responses.py",
    ]
