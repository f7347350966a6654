"""scripts/install/smoke_llama_server.py tells a binary that cannot run here from a port someone else took."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]

FAKE_SERVER = r"""
import http.server, json, sys
from pathlib import Path

port = int(sys.argv[sys.argv.index("--port") + 1])
tries = Path(sys.argv[0]).with_suffix(".tries")
count = int(tries.read_text()) + 1 if tries.exists() else 1
tries.write_text(str(count))
if count == 1:
    print("couldn't bind HTTP server socket, hostname: 127.0.0.1, port: %d" % port)
    sys.exit(1)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200); self.end_headers(); self.wfile.write(json.dumps({"content": "hi"}).encode())

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def smoke() -> ModuleType:
    spec = importlib.util.spec_from_file_location("smoke_llama_server", REPO / "scripts" / "install" / "smoke_llama_server.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_binary(tmp_path: Path) -> Path:
    script = tmp_path / "fake_llama_server.py"
    script.write_text(FAKE_SERVER)
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    binary.chmod(0o755)
    return binary


def test_a_port_taken_under_it_is_tried_again_and_the_binary_passes(tmp_path: Path) -> None:
    binary = fake_binary(tmp_path)
    assert smoke().check(binary, tmp_path / "model.gguf", timeout=20) is None
    assert (tmp_path / "fake_llama_server.tries").read_text() == "2"


def test_a_binary_that_exits_for_another_reason_fails(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'error: illegal instruction'\nexit 3\n")
    binary.chmod(0o755)
    problem = smoke().check(binary, tmp_path / "model.gguf", timeout=20)
    assert problem is not None and "dies while loading the model" in problem
