"""README.md's runnable examples run as written, against a tiny bundle instead of the real pair.

A fenced block whose info string is `bash runnable` or `python runnable` runs here; `... runnable server` runs
while the README's own `mirror-sd serve` command serves the tiny bundle. The real pair's bundle path, the port and
`.venv/bin/` are the only things replaced.
"""

from __future__ import annotations

import http.client
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BLOCK = re.compile(r"^```(bash|python) runnable( server)?\n(.*?)^```", re.M | re.S)
REAL_BUNDLE = "build/bundles/smollm2-feature"
PORT = "8000"


def blocks(server: bool) -> list[tuple[str, str]]:
    return [(lang, body) for lang, tag, body in BLOCK.findall(README) if bool(tag) == server]


def as_here(text: str, bundle: Path, port: str = PORT) -> str:
    bin_dir = Path(sys.executable).parent
    return (text.replace(REAL_BUNDLE, str(bundle)).replace(".venv/bin/", f"{bin_dir}/")
            .replace(f"127.0.0.1:{PORT}", f"127.0.0.1:{port}").replace(f"--port {PORT}", f"--port {port}"))


def run(lang: str, body: str, cwd: Path) -> subprocess.CompletedProcess:
    command = ["bash", "-euo", "pipefail", "-c", body] if lang == "bash" else [sys.executable, "-c", body]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_readme_has_runnable_examples_and_stays_short():
    assert len(README.splitlines()) <= 300  # a page to act on
    assert {lang for lang, _ in blocks(False)} == {"bash", "python"} and blocks(True)


def test_runnable_examples_run_as_written(bundle_factory, tmp_path):
    bundle = bundle_factory()
    for lang, body in blocks(False):
        done = run(lang, as_here(body, bundle), tmp_path)
        assert done.returncode == 0, f"README {lang} block failed:\n{body}\n{done.stderr[-2000:]}"


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _wait_healthy(port: str, server: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server.poll() is not None:
            pytest.fail(f"mirror-sd serve exited: {server.stderr.read()}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.2)
    pytest.fail("mirror-sd serve did not come up")


def test_server_examples_run_against_the_readmes_serve_command(bundle_factory, tmp_path):
    bundle, port = bundle_factory(), _free_port()
    serve = next(line for line in README.splitlines() if line.startswith(".venv/bin/mirror-sd serve "))
    server = subprocess.Popen(["bash", "-c", f"exec {as_here(serve, bundle, port)}"], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(port, server)
        for lang, body in blocks(True):
            done = run(lang, as_here(body, bundle, port), tmp_path)
            assert done.returncode == 0, f"README {lang} block failed:\n{body}\n{done.stderr[-2000:]}"
            assert '"error"' not in done.stdout, done.stdout
    finally:
        server.terminate()
        server.wait(timeout=30)
