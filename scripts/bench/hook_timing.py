"""ContextPaw as a mitmproxy script, with the time spent inside each of its hooks measured.

    CONTEXTPAW_HOOK_TIMES=hooks.json mitmdump -s scripts/bench/hook_timing.py --mode reverse:...

The same addons as `contextpaw_addon.py`; each hook method is wrapped with the event loop thread's
CPU clock (`time.thread_time`: an async hook's waits, on the backend's answer in `Upstream.request`
above all, are not its cost; send requests one at a time, so no other flow's work falls inside a
wait), and when mitmdump stops (`done`) the count and mean of every hook is written to
$CONTEXTPAW_HOOK_TIMES as JSON. It tells ContextPaw's own code apart from mitmproxy's dispatch and
the relay in `scripts/bench/bench.py`'s overhead figures. For measuring only: the wrappers cost a
little themselves.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from contextpaw.proxy.compose import make_addons  # noqa: E402

HOOKS = ("requestheaders", "request", "responseheaders", "response", "error", "http_connect_upstream")
spent: defaultdict[str, list[float]] = defaultdict(list)


def timed(addon: object, hook: str) -> None:
    method = getattr(addon, hook)
    times = spent[f"{type(addon).__name__}.{hook}"]
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def wrapper(*args: Any) -> Any:
            started = time.thread_time()
            try:
                return await method(*args)
            finally:
                times.append(time.thread_time() - started)
    else:

        @functools.wraps(method)
        def wrapper(*args: Any) -> Any:
            started = time.thread_time()
            try:
                return method(*args)
            finally:
                times.append(time.thread_time() - started)

    setattr(addon, hook, wrapper)


class Written:
    """Writes the measured times when mitmdump stops."""

    def done(self) -> None:
        out = {hook: {"n": len(t), "mean_us": sum(t) / len(t) * 1e6} for hook, t in sorted(spent.items()) if t}
        Path(os.environ.get("CONTEXTPAW_HOOK_TIMES", "contextpaw-hook-times.json")).write_text(json.dumps(out, indent=2))


addons = make_addons()
for one in addons:
    for name in HOOKS:
        if hasattr(one, name):
            timed(one, name)
addons.append(Written())
