"""The sections of scripts/bench/bench.py, a module each: what it measures and how (the entry point
parses the arguments, runs the sections named and writes the report of report.py)."""
