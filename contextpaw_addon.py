"""`mitmdump -s contextpaw_addon.py --mode reverse:...`: ContextPaw as a mitmproxy script."""

from contextpaw.compose import make_addons

addons = make_addons()
