"""mitmweb's flow list, laid out for ContextPaw's comments.

mitmweb gives the comment column 150 px (about 20 characters), so `ollama.chat: 9,759→860 tok`
showed as `ollama.chat: 9,75…`, and a refusal's fix not at all. Under mitmweb (`contextpaw --web`, or
this addon loaded into mitmweb with `-s`) ContextPaw serves mitmweb's own stylesheet with one rule
added after it: the comment column takes half the flow list, the path column the rest. A width the
user drags a column to still wins (mitmweb sets it on the column itself). mitmdump has no web app:
nothing is done there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tornado.web

from contextpaw.core import logs

logger = logs.get(__name__)

COMMENT_RULE = b"\n/* ContextPaw: the comment column, where each flow's route, cut or fix is said */\n.flow-table .col-comment{width:50%}\n"
STYLESHEET = r"/static/(index-[A-Za-z0-9_-]+\.css)"
"""mitmweb's stylesheet (its name carries a hash of its content, which each release changes)."""


class _Stylesheet(tornado.web.RequestHandler):
    """mitmweb's stylesheet as it is, then `COMMENT_RULE`."""

    def get(self, name: str) -> None:
        path = Path(self.settings["static_path"]) / name
        try:
            css = path.read_bytes()
        except OSError:
            raise tornado.web.HTTPError(404) from None
        self.set_header("Content-Type", "text/css; charset=utf-8")
        self.set_header("Cache-Control", "no-cache")
        self.write(css + COMMENT_RULE)


def widen_comments(master: Any) -> bool:
    """Serve mitmweb's stylesheet with the wider comment column, if `master` is mitmweb's (it has a
    tornado app with a static path); whether it was done. The rule is tried before mitmweb's own:
    tornado puts the rules `add_handlers` adds ahead of the app's."""
    app = getattr(master, "app", None)
    if not isinstance(app, tornado.web.Application) or not app.settings.get("static_path"):
        return False
    app.add_handlers(r".*", [(STYLESHEET, _Stylesheet)])
    logger.debug("mitmweb's comment column is widened to half the flow list")
    return True
