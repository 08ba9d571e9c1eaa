"""A real dashboard process and a headless Chromium, for browser tests and the benchmark."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_dashboard(run_dir: str | os.PathLike, log_path: Path, env: dict | None = None,
                    timeout: float = 60.0) -> LiveServer:
    """Start ``python -m app`` on a free port and wait until it answers.

    Polls ``/api/summary``; fails at once, with the server's output, if the
    process exits instead of coming up.
    """
    port = free_port()
    log_file = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "--run-dir", str(run_dir), "--port", str(port)],
        cwd=REPO, env={**os.environ, **(env or {})}, stdout=log_file, stderr=subprocess.STDOUT)
    log_file.close()
    server = LiveServer(proc, f"http://127.0.0.1:{port}", Path(log_path))
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"dashboard exited with {proc.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(server.url + "/api/summary", timeout=2):
                return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"dashboard did not answer in {timeout} s:\n{server.log()}")
            time.sleep(0.1)


def launch_chromium(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
