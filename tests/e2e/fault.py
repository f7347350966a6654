"""A second mitmdump script, for tests only: it breaks the compaction step, to see ContextPaw fail open."""

from contextpaw import wire


def _broken(*args: object, **kwargs: object) -> None:
    raise RuntimeError("injected by tests/e2e/fault.py")


wire.Chat.fit = _broken  # type: ignore[method-assign]
