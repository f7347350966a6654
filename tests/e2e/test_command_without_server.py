"""`contextpaw -n` (no server, as when reading a flow file) warns of no listener and names none at
start: nothing listens (issue 43, item 12)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

COMMAND = [sys.executable, "-m", "contextpaw.command.cli"]


def test_reading_a_flow_file_without_a_server_warns_of_no_listener(tmp_path: Path) -> None:
    from mitmproxy import io
    from mitmproxy.test import tflow

    flows = tmp_path / "flows.mitm"
    with flows.open("wb") as sink:
        io.FlowWriter(sink).add(tflow.tflow(resp=True))
    argv = [*COMMAND, "-n", "-r", str(flows), "--confdir", str(tmp_path / "conf")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert "listening on" not in said and "0.0.0.0" not in said, said[-3000:]
    assert "no proxy server (-n)" in said
