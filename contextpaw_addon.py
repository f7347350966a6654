"""`mitmdump -s contextpaw_addon.py --mode reverse:...`: ContextPaw as a mitmproxy script."""

from contextpaw.proxy.compose import make_addons

addons = make_addons()
