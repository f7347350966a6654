"""State kept on disk across restarts: written atomically, its leftovers removed at start, and the
calibration's file read at start and written off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def remove_leftovers(path: Path) -> int:
    """Remove the temporary files that writes of `path` killed half-way left behind (a crash
    between `mkstemp` and `replace`); how many went. Called once, when the file is taken up."""
    removed = 0
    for leftover in path.parent.glob(f"{glob.escape(path.name)}*.tmp"):
        with contextlib.suppress(OSError):
            leftover.unlink()
            removed += 1
    return removed


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text`: a crash leaves the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
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


class KeptCalibration:
    """The calibration's JSON file: read when the state dir is set, written off the event loop at
    most every `every_s` seconds (and once more at exit)."""

    def __init__(self, path: Path, every_s: float = 10.0) -> None:
        self.path = path
        self.every_s = every_s
        self._saved_at = 0.0
        remove_leftovers(path)

    def restore(self, calibration: Any) -> bool | None:
        """Load into `calibration`; None when there is no file, False when it is damaged."""
        try:
            with open(self.path, encoding="utf-8") as f:
                return bool(calibration.restore(json.load(f)))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return False

    def save(self, calibration: Any, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._saved_at < self.every_s:
            return
        self._saved_at = now
        text = json.dumps(calibration.state())
        asyncio.get_running_loop().run_in_executor(None, write_atomically, self.path, text)
