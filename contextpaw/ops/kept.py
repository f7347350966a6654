"""State kept on disk across restarts: read back only from a regular file of bounded size, written
atomically and privately (files 0600, in directories made 0700), its leftovers removed at start,
and the calibration's file read at start and written off the event loop. A write that fails says
so once, not at every try."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from contextpaw.core import logs

logger = logs.get(__name__)

STATE_LIMIT = 16 << 20
"""Bytes a state file may hold to be read back: the calibration's is a few KB. A bigger one is not
ours (or not sane), and is not read into memory."""


def remove_leftovers(path: Path) -> int:
    """Remove the temporary files that writes of `path` killed half-way left behind (a crash
    between `mkstemp` and `replace`); how many went. Called once, when the file is taken up."""
    removed = 0
    for leftover in path.parent.glob(f"{glob.escape(path.name)}*.tmp"):
        with contextlib.suppress(OSError):
            leftover.unlink()
            removed += 1
    return removed


def read_state(path: Path, limit: int = STATE_LIMIT) -> bytes | None:
    """The bytes of the state file `path`, or None when there is no usable one: missing (quietly),
    or, with one log line, anything but a regular file of at most `limit` bytes. A device (a link
    to /dev/zero), a FIFO, a socket or a directory is neither opened for long nor read: it is
    opened without blocking and looked at before a byte is read, so start-up never waits on it
    nor fills memory from it. A link that leads out of the state directory is not followed."""
    try:
        if path.is_symlink() and not path.resolve().is_relative_to(path.parent.resolve()):
            logger.warning("state file %s is a link out of its directory, to %s: not read; starting fresh", path, path.resolve())
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        return None
    except (OSError, RuntimeError) as e:  # RuntimeError: a loop of links
        logger.warning("state file %s cannot be opened (%s): starting fresh", path, e)
        return None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # looked at on the descriptor: a directory cannot even be wrapped in a file
        os.close(fd)
        logger.warning("state file %s is not a regular file (%s): not read; starting fresh", path, _kind(info.st_mode))
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1) if info.st_size <= limit else b""
        except OSError as e:
            logger.warning("state file %s cannot be read (%s): starting fresh", path, e)
            return None
        if info.st_size > limit or len(data) > limit:
            logger.warning("state file %s holds over %d bytes (%d): not read; starting fresh", path, limit, max(info.st_size, len(data)))
            return None
        return data


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a file"


def private_dir(directory: Path) -> None:
    """Make `directory` and whichever of its parents are missing, each this user's only (0700); one
    that exists is left as it is (the operator's choice)."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another writer
            d.mkdir(mode=0o700)


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text`: a crash leaves the old file or the new one, never half of one.
    The file is this user's only (0600, as `mkstemp` makes it whatever the umask, and `replace`
    keeps), in a directory made 0700 where ContextPaw makes it (`private_dir`)."""
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class StateWriter:
    """Writes one state file (`write_atomically`), and tells of its failures once: the first of a
    kind as one warning line with the reason, no traceback; nothing more while it keeps failing
    the same way; one line when it is saved again. Safe to call from worker threads."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.what = what
        self.failing: str | None = None
        """Why the last write failed; None while writes succeed."""
        self._lock = threading.Lock()

    def write(self, text: str) -> bool:
        """Whether `text` was saved."""
        with self._lock:
            try:
                write_atomically(self.path, text)
            except (OSError, ValueError) as e:  # ValueError: text UTF-8 cannot hold (a lone surrogate)
                reason = f"{type(e).__name__}: {(e.strerror if isinstance(e, OSError) else None) or e}"
                if reason != self.failing:
                    logger.warning("%s %s not saved (%s); told again only when this changes", self.what, self.path, reason)
                self.failing = reason
                return False
            if self.failing is not None:
                logger.warning("%s %s saved again", self.what, self.path)
                self.failing = None
            return True


class KeptCalibration:
    """The calibration's JSON file: read when the state dir is set, written off the event loop at
    most every `every_s` seconds (and once more at exit)."""

    def __init__(self, path: Path, every_s: float = 10.0) -> None:
        self.path = path
        self.every_s = every_s
        self._saved_at = 0.0
        self.writer = StateWriter(path, "calibration state")
        remove_leftovers(path)

    def restore(self, calibration: Any) -> bool | None:
        """Load into `calibration`; None when there is no usable file (`read_state` said why),
        False when it is damaged."""
        data = read_state(self.path)
        if data is None:
            return None
        try:
            return bool(calibration.restore(json.loads(data.decode("utf-8"))))
        except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested past the parser's depth
            return False

    def save(self, calibration: Any, force: bool = False) -> asyncio.Future[bool] | None:
        """Write in a worker thread, if `every_s` went by since the last write (or `force`); the
        write's future (whether it saved), None when none was due. A failure is told by the
        writer (`StateWriter`), never raised."""
        now = time.monotonic()
        if not force and now - self._saved_at < self.every_s:
            return None
        self._saved_at = now
        text = json.dumps(calibration.state())
        return asyncio.get_running_loop().run_in_executor(None, self.writer.write, text)
