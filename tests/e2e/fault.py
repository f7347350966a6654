"""A second mitmdump script, for tests only: it breaks the compaction step, to see ContextPaw fail open."""

from contextpaw.fitting import sizing


def _broken(*args: object, **kwargs: object) -> None:
    raise RuntimeError("injected by tests/e2e/fault.py")


sizing.fit_chat = _broken  # type: ignore[assignment]
