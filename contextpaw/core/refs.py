"""How a marker names what it stands for, and what reading it back takes. Pure.

A marker's reference is one string the model can copy, `cp-<id>.<cap>`: the id is an HMAC-SHA256 of
the content under a secret made at the proxy's first start, so content cannot be guessed from its
id nor its id from the content (the shell reads the secret and passes it in); the capability is
an HMAC of the id under the same secret, so only whoever saw the marker can read it back. Both
depend on nothing but the content and the secret: a marker once sent comes out the same on every
later turn, and after a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from contextpaw.core.canonical import canonical

ID_HEX = 12
"""Hex digits of an id (48 bits: unique among what the archive keeps; unguessable by the key)."""
CAP_HEX = 16
"""Hex digits of a capability (64 bits: not found by asking)."""
PLACEHOLDER_REF = "cp-" + "0" * ID_HEX + "." + "0" * CAP_HEX
"""A reference of the real ones' length, for sizing a note before its content is hashed."""
REF = re.compile(rf"cp-([0-9a-f]{{{ID_HEX}}})(?:\.([0-9a-f]{{{CAP_HEX}}}))?")
EVICTED_PATH = "/contextpaw/evicted/"


def _mac(key: bytes, data: bytes) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def capability(key: bytes, marker_id: str) -> str:
    """What proves that a reader saw the marker of `marker_id` (`cp-<id>`)."""
    return _mac(key, b"read:" + marker_id.encode())[:CAP_HEX]


def split(ref: str) -> tuple[str, str | None] | None:
    """(`cp-<id>`, its capability or None) of a reference or a bare id; None for anything else."""
    found = REF.fullmatch(ref)
    return (f"cp-{found[1]}", found[2]) if found else None


def readable(key: bytes, ref: str) -> str | None:
    """The id a reference may read (its capability is the one `key` makes), else None."""
    parts = split(ref)
    if parts is None or parts[1] is None:
        return None
    marker_id, cap = parts[0], parts[1]
    return marker_id if hmac.compare_digest(cap, capability(key, marker_id)) else None


@dataclass(frozen=True, slots=True)
class Refs:
    """The secret that keys the references of one request, where the client reached the proxy
    (`http://host:port`, as it named it; "" when unknown), for the command that reads one back, and
    the most bytes the archive keeps of one piece (0: no bound)."""

    key: bytes = b""
    url: str = ""
    most_bytes: int = 0

    def ref(self, payload: Sequence[Any] | str) -> str:
        """The reference of evicted content (a hole's messages, a shrunk text): `cp-<id>.<cap>`; a
        bare `cp-<id>` for content over `most_bytes`, which the archive does not keep: no marker
        promises to read it back (`kept`)."""
        data = payload.encode("utf-8", "surrogatepass") if isinstance(payload, str) else canonical(payload)
        marker_id = "cp-" + _mac(self.key, data)[:ID_HEX]
        if self.most_bytes and len(data) > self.most_bytes:
            return marker_id
        return f"{marker_id}.{capability(self.key, marker_id)}"

    def fetch(self, ref: str) -> str:
        """The shell command that prints what `ref` stands for, or "" without the proxy's address."""
        return f"curl -s {self.url}{EVICTED_PATH}{ref}" if self.url else ""


def kept(ref: str) -> bool:
    """Whether a reference `Refs.ref` made stands for content the archive keeps (it has a capability)."""
    return "." in ref


def store_id(ref: str) -> str:
    """The id a reference is kept under in the archive (the capability is never stored)."""
    return ref.split(".", 1)[0]
