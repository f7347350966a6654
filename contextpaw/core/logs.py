"""Log lines an operator can trust: whatever a client sent (a model name, a path) is escaped.

A model name like `"m\\n[06:00:00.000] FORGED ..."` would otherwise print as a line of its own, and
a lone surrogate (a JavaScript string cut inside an emoji) cannot be encoded by a log handler at
all, which would make logging the request fail. Every ContextPaw logger escapes control characters,
line separators and lone surrogates in its formatted message, the way Python's `repr` spells them.

One convention: each module logs through `logger = logs.get(__name__)`, so a record names its module
(`contextpaw.fitting.fitter`) and `logging.getLogger("contextpaw")` reaches them all.
"""

from __future__ import annotations

import logging
import re

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def escaped(text: str) -> str:
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode("ascii"), text)


class EscapedControls(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        safe = escaped(message)
        if safe != message:
            record.msg, record.args = safe, None
        return True


def get(name: str) -> logging.Logger:
    """The logger `name`, escaping what it is given (a filter on a logger does not reach its children)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, EscapedControls) for f in logger.filters):
        logger.addFilter(EscapedControls())
    return logger
