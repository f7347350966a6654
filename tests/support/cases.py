"""The inputs the reliability tests tried, counted by kind and printed at the end of the session.

Under pytest-xdist each worker counts its own and hands them to the controller, which prints the
sum (tests/conftest.py holds the hooks: the controller loads no conftest below tests/)."""

from __future__ import annotations

import collections

CASES: collections.Counter[str] = collections.Counter()
WORKER_KEY = "contextpaw_cases"
"""Where a worker leaves its counts in `workeroutput` for the controller."""
