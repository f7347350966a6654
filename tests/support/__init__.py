"""Test-support backends: fast deterministic fakes of llama-server and Ollama, an Ollama simulator
on top of a real llama-server, helpers that start them (and mitmdump) for tests and scripts, and the
addons on mitmproxy's test master (:mod:`support.inprocess`).

Not part of the installed package: it lives in the checkout's ``tests/`` and is imported as
``support`` with ``tests/`` on ``sys.path`` (pytest's ``pythonpath`` setting; the scripts that reuse it are run with ``PYTHONPATH=tests``;
:func:`support.backends.start_module` puts it on a child's ``PYTHONPATH``). Nothing here is imported
by the addon itself.
"""
