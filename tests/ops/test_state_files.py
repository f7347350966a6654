"""State files read back at start (the calibration's) through `read_state`:
only a regular file of bounded size is read; a device, a FIFO, a link out of the state directory or
an oversized file is refused with one log line, and the proxy starts fresh, promptly and small."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from contextpaw.fitting.calibration import Calibration
from contextpaw.ops.kept import STATE_LIMIT, KeptCalibration, StateWriter, read_state, write_atomically

CHILD = """
import json, logging, resource, sys, time
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # a read of /dev/zero stops here, not at the machine's end
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
from contextpaw.fitting.calibration import Calibration
from contextpaw.ops.kept import KeptCalibration
path = Path(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.monotonic()
restored = KeptCalibration(path).restore(Calibration())
seconds = time.monotonic() - started
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"restored": restored, "seconds": seconds, "grown_kb": grown}))
"""


def start_up(path: Path) -> tuple[dict[str, object], list[str]]:
    """What the calibration's start-up makes of `path`, in a process of its own
    (bounded in time and address space), and the log lines that name it."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout), [line for line in done.stderr.splitlines() if str(path) in line]


def dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def fifo(path: Path) -> None:
    os.mkfifo(path)


def oversized(path: Path) -> None:
    """Valid state, padded past the limit: read whole, it would be taken."""
    path.write_text(json.dumps({"ratios": {"ollama/m": [1.2]}, "version": 0, "entries": {}, "pad": "x" * STATE_LIMIT}))


def directory(path: Path) -> None:
    """A directory where the file goes: it cannot even be opened as a file object (the proxy did not start)."""
    path.mkdir()


@pytest.mark.parametrize("make", [dev_zero, fifo, oversized, directory], ids=["link to /dev/zero", "FIFO", "over the limit", "directory"])
def test_a_special_or_oversized_state_file_is_refused_promptly_small_and_with_one_line_each(tmp_path: Path, make) -> None:
    path = tmp_path / "state"
    make(path)
    outcome, lines = start_up(path)
    assert outcome["restored"] is None, "no usable file: it starts fresh"
    assert outcome["seconds"] < 5 and outcome["grown_kb"] < 8 << 10, outcome
    assert len(lines) == 1 and all("starting fresh" in line for line in lines), lines


def test_a_link_out_of_the_state_directory_is_not_followed_and_one_inside_it_is(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "elsewhere").mkdir()
    (state := tmp_path / "state").mkdir()
    outside = tmp_path / "elsewhere" / "secret.json"
    outside.write_text('{"ratios": {"ollama/m": [1.2]}}')
    (state / "out").symlink_to(outside)
    (state / "real.json").write_text('{"ratios": {"ollama/m": [1.2]}}')
    (state / "in").symlink_to(state / "real.json")
    with caplog.at_level(logging.WARNING):
        assert read_state(state / "out") is None
        assert read_state(state / "in") == (state / "real.json").read_bytes()
    assert [r.getMessage() for r in caplog.records] == [
        f"state file {state / 'out'} is a link out of its directory, to {outside}: not read; starting fresh"
    ]


def test_a_missing_file_is_quietly_a_fresh_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert KeptCalibration(tmp_path / "none").restore(Calibration()) is None
    assert not caplog.records


def test_state_nested_past_the_parsers_depth_is_damaged_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "state"
    path.write_text("[" * 200_000 + "]" * 200_000)
    assert KeptCalibration(path).restore(Calibration()) is False


def test_a_file_at_the_limit_is_still_read(tmp_path: Path) -> None:
    path = tmp_path / "state"
    path.write_bytes(b" " * STATE_LIMIT)
    assert read_state(path) == b" " * STATE_LIMIT


# -- writes ---------------------------------------------------------------------------------------


BLOCKED = "NotADirectoryError"
"""What a write under a file says: its directory is there, and is not one."""


def blocked(tmp_path: Path) -> Path:
    """A state path whose directory cannot be made: a file stands where it would be (unwritable
    even to root, unlike a mode)."""
    (tmp_path / "state").write_text("not a directory")
    return tmp_path / "state" / "contextpaw-calibration.json"


def told(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_failing_background_write_says_so_once_without_a_traceback_and_once_when_it_works_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = blocked(tmp_path)
    kept, calibration = KeptCalibration(path), Calibration()
    with caplog.at_level(logging.WARNING):
        for _ in range(5):  # what five periods of 10 s bring
            assert await kept.save(calibration, force=True) is False
        [first] = told(caplog)
        assert "not saved" in first.getMessage() and BLOCKED in first.getMessage() and str(path) in first.getMessage()
        assert first.exc_info is None and first.exc_text is None, "one line, no traceback"
        (tmp_path / "state").unlink()
        assert await kept.save(calibration, force=True) is True
        assert await kept.save(calibration, force=True) is True
    assert [r.getMessage() for r in told(caplog)[1:]] == [f"calibration state {path} saved again"]
    assert json.loads(path.read_text()) == calibration.state()


def test_a_write_failing_another_way_is_told_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = blocked(tmp_path)
    writer = StateWriter(path, "calibration state")
    with caplog.at_level(logging.WARNING):
        assert not writer.write("{}") and not writer.write("{}")
        (tmp_path / "state").unlink()
        assert not writer.write("\ud800")  # UTF-8 cannot hold it: a failure, not an exception
        assert writer.write("{}")
    assert [r.getMessage().split(" (")[1].split(":")[0] for r in told(caplog)[:2]] == [BLOCKED, "UnicodeEncodeError"]
    assert len(told(caplog)) == 3


# -- privacy ----------------------------------------------------------------------------------------


def test_state_is_written_private_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "made" / "by" / "contextpaw" / "contextpaw-calibration.json"
    old = os.umask(0)
    try:
        write_atomically(path, "{}")
        path.chmod(0o644)  # as an earlier version left it
        write_atomically(path, '{"ratios": {}}')
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [stat.S_IMODE(d.stat().st_mode) for d in (path.parents[2], path.parents[1], path.parent)] == [0o700] * 3
    assert KeptCalibration(path).restore(Calibration()) is True


def test_a_state_directory_the_operator_made_is_left_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir(mode=0o750)
    (tmp_path / "shared").chmod(0o750)
    write_atomically(tmp_path / "shared" / "state.json", "{}")
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o750
    assert stat.S_IMODE((tmp_path / "shared" / "state.json").stat().st_mode) == 0o600
