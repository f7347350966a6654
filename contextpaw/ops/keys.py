"""The proxy's own secrets, made at its first start in the state directory and reused after it:

- `contextpaw-secret` (32 random bytes): keys marker references (`core.refs`) and conversation keys,
  so that what was evicted cannot be guessed from its id, nor read without the marker's capability;
- `contextpaw-token` (a random string): what local tools (the MCP server) present as
  `X-ContextPaw-Token` to read any id and to search the archive.

Both are this user's only (0600, in a 0700 directory). A file that is not a regular file of the
right size is refused, and a new secret is made in its place.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from contextpaw.core import logs

logger = logs.get(__name__)

SECRET_FILE = "contextpaw-secret"
TOKEN_FILE = "contextpaw-token"
SECRET_BYTES = 32


def _read_private(path: Path, size: int) -> bytes | None:
    """The file's bytes if it is a regular file of `size` bytes (a link is not followed), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.warning("%s cannot be read (%s): a new one is made", path, e)
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            logger.warning("%s is not a %d-byte file: a new one is made", path, size)
            return None
        if info.st_mode & 0o077:
            os.fchmod(f.fileno(), 0o600)
        return f.read(size)


def _made(path: Path, data: bytes) -> bytes:
    """Write `data` to a new private file at `path` (atomically: a half-written secret is never read)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return data


def secret(state_dir: Path) -> bytes:
    """The proxy's secret: read from `state_dir`, made there at the first start."""
    path = state_dir / SECRET_FILE
    return _read_private(path, SECRET_BYTES) or _made(path, secrets.token_bytes(SECRET_BYTES))


def local_token(state_dir: Path) -> str:
    """The local tools' token: read from `state_dir`, made there at the first start."""
    path = state_dir / TOKEN_FILE
    size = 43  # token_urlsafe(32)
    kept = _read_private(path, size)
    return (kept or _made(path, secrets.token_urlsafe(32).encode())).decode()
