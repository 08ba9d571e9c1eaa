"""A real dashboard process and a headless Chromium, for browser tests and the benchmark."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def rank_rows(url: str, timeout: float = 120.0) -> list[dict]:
    """Every row of ``GET url/api/ranks``, page by page at the largest page it serves."""
    rows, page, pages = [], 1, 1
    while page <= pages:
        with urllib.request.urlopen(f"{url}/api/ranks?per_page=1000&page={page}", timeout=timeout) as r:
            body = json.load(r)
        rows += body["ranks"]
        pages, page = body["pages"], page + 1
    return rows


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

    def processes(self) -> list[psutil.Process]:
        """The server's processes: gunicorn's arbiter and its worker, which does the work."""
        try:
            parent = psutil.Process(self.proc.pid)
            return [parent, *parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def worker_pid(self) -> int:
        """The gunicorn worker's pid: the process that serves and scans (the arbiter only supervises)."""
        procs = self.processes()
        return procs[-1].pid if procs else self.proc.pid

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of all the server's processes so far."""
        total = 0.0
        for p in self.processes():
            try:
                times = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total

    def rss_bytes(self) -> int:
        total = 0
        for p in self.processes():
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def kill(self) -> None:
        """SIGKILL every process of the server, as a crash would: no shutdown code runs."""
        for p in reversed(self.processes()):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_dashboard(
    run_dir: str | os.PathLike,
    log_path: Path,
    env: dict | None = None,
    timeout: float = 60.0,
    prefix: list[str] | None = None,
    runs_root: bool = False,
    port: int | None = None,
) -> LiveServer:
    """Start ``python -m app`` on a free port and wait until it answers.

    ``prefix`` runs it through another command first (``tests/helpers/netns.py``
    gives the dashboard a node's host name that way).

    ``runs_root``: ``run_dir`` is a root of runs (``--runs ROOT``).

    ``port``: this one rather than a free one (a relaunch on the same address, as ``make demo`` twice does).

    Polls ``/api/summary`` (``/api/runs`` for a root); fails at once, with the server's output, if the
    process exits instead of coming up.
    """
    port = port or free_port()
    log_file = open(log_path, "wb")
    proc = subprocess.Popen(
        [
            *(prefix or []),
            *(sys.executable, "-m", "app", "--runs" if runs_root else "--run-dir", str(run_dir)),
            *("--port", str(port)),
        ],
        cwd=REPO,
        # The log is a file, where the dashboard leaves its login link out by
        # default (LOGIN_LINK): tests that sign in read the link from it.
        env={**os.environ, "RANKWATCH_LOGIN_LINK": "always", **(env or {})},
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    log_file.close()
    server = LiveServer(proc, f"http://127.0.0.1:{port}", Path(log_path))
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"dashboard exited with {proc.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(
                server.url + ("/api/runs" if runs_root else "/api/summary"), timeout=2
            ):
                return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"dashboard did not answer in {timeout} s:\n{server.log()}") from None
            time.sleep(0.1)


def launch_chromium(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def sign_in(page, url: str, token: str) -> None:
    """Open the page and enter the operator token in its dialog, as an operator does.

    (The page takes no ``#token=`` any more: the printed link carries a
    single-use ``#login=`` code, app/edge/login.py.)
    """
    page.goto(url)
    page.click("#token-open")
    page.fill("#token-input", token)
    page.click("#token-save")
