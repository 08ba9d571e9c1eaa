"""Helpers shared by the fault-injection tests (``tests/test_faults_*.py``).

* ``Dashboard``: a real ``python -m app`` process with the JSON API at hand
  and a ``wait`` that polls it (never a fixed sleep).
* ``held_rename``: a real process held inside one ``rename`` (strace's fault
  injection), so that a fault can land in the middle of a save.
* ``measure``: the fault tests assert outcomes, never durations; durations
  are measured and reported here instead. Each measurement is printed (see
  it with ``pytest -rP`` or ``-s``) and, when ``RANKWATCH_FAULTS_REPORT`` names
  a file, appended to it as one JSON line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.helpers.liveserver import LiveServer, rank_rows, start_dashboard

# Generous upper bounds for a shared 2-core machine; never a speed assertion.
WAIT_S = 240.0
UI_TIMEOUT_MS = 120_000


def measure(name: str, value, unit: str = "s", **extra) -> None:
    """Report a measured figure (never asserted)."""
    shown = f"{value:.2f}" if isinstance(value, float) else str(value)
    more = ", ".join(f"{k}={v}" for k, v in extra.items() if len(str(v)) < 200)
    print(f"MEASURED {name} = {shown} {unit}".rstrip() + (f" ({more})" if more else ""), flush=True)
    path = os.environ.get("RANKWATCH_FAULTS_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"name": name, "value": value, "unit": unit, **extra}) + "\n")


def clean_env(**settings) -> dict:
    """``settings`` as the ``RANKWATCH_*`` variables of a dashboard process."""
    return {f"RANKWATCH_{k}": str(v) for k, v in settings.items()}


class Dashboard:
    """``python -m app`` on ``run_dir`` with default settings (plus ``settings``)."""

    def __init__(
        self,
        run_dir: Path,
        log_path: Path,
        token: str = "fault-token",
        prefix: list[str] | None = None,
        **settings,
    ):
        self.token = token
        # start_dashboard inherits os.environ: RANKWATCH_* variables someone
        # exported would change the defaults these tests measure.
        saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("RANKWATCH_")}
        try:
            self.server: LiveServer = start_dashboard(
                run_dir, log_path, env=clean_env(TOKEN=token, **settings), prefix=prefix
            )
        finally:
            os.environ.update(saved)
        self.url = self.server.url

    def stop(self) -> None:
        self.server.stop()

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown code runs."""
        if self.server.proc.poll() is None:
            self.server.kill()

    # -- the API ---------------------------------------------------------------------

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.load(r)

    def post(self, path: str, body: dict, token: str | None = "") -> tuple[int, dict]:
        token = self.token if token == "" else token
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), method="POST", headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def rows(self) -> dict[int, dict]:
        return {row["rank"]: row for row in rank_rows(self.url)}

    def wait(
        self, predicate, what: str, timeout: float = WAIT_S, poll: float = 0.1, path: str = "/api/ranks"
    ):
        """Poll ``GET path`` until ``predicate(body)`` is truthy; returns it.

        Fails at once, with the dashboard's log, if the dashboard died.
        """
        deadline = time.monotonic() + timeout
        body = None
        while time.monotonic() < deadline:
            if self.server.proc.poll() is not None:
                raise AssertionError(
                    f"the dashboard exited ({self.server.proc.returncode}) "
                    f"while waiting for {what}:\n{self.server.log()[-3000:]}"
                )
            body = self.get(path)
            value = predicate(body)
            if value:
                return value
            time.sleep(poll)
        raise AssertionError(
            f"timed out after {timeout} s waiting for {what}; last answer:\n"
            f"{json.dumps(body, indent=1)[:4000]}"
        )

    def wait_rows(self, predicate, what: str, timeout: float = WAIT_S, poll: float = 0.1):
        """Poll ``/api/ranks`` until ``predicate({rank: row})`` is truthy."""
        return self.wait(lambda body: predicate({r["rank"]: r for r in body["ranks"]}), what, timeout, poll)


def cell(page, rank: int, col: str):
    """A cell of the rank table, as the operator sees it."""
    return page.locator(f'#rank-table tbody tr[data-rank="{rank}"] td[data-col="{col}"]')


def poll_until(predicate, what: str, timeout: float = WAIT_S, poll: float = 0.1):
    """Poll ``predicate()`` until truthy; returns its value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def tree_snapshot(top) -> dict:
    """Every entry below ``top`` (and ``top``): its type, size and mtime, symlinks not followed.

    The fuzzers compare one taken before and one after: nothing outside ROOT may change.
    """
    tree = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for name in [".", *dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            tree[os.path.relpath(path, top)] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns)
    return tree


@contextlib.contextmanager
def held_rename(pid: int, path: Path, hold_s: int = 600):
    """Hold every thread of process ``pid`` at its ``rename`` of ``path`` for up to ``hold_s`` seconds.

    MindSpore writes a checkpoint to ``NAME.tmp`` and renames it to ``NAME.ckpt``
    (``serialization._exec_save``), so while ``path`` (the ``.tmp``) exists and
    the rename is held, the process is inside that save, however fast the
    machine: a fault sent then lands mid-save, deterministically. strace's
    ``-P`` limits the delay to calls on that one path; the process runs on
    (slower, as every syscall is traced) until it gets there. Needs ptrace
    rights over ``pid`` (root, or the same user with Yama's scope 0).
    """
    strace = shutil.which("strace")
    assert strace, "strace is not installed (.ci/run installs it)"
    calls = "rename,renameat,renameat2"
    cmd = [strace, "-f", "-o", os.devnull, "-P", str(path), "-e", f"trace={calls}"]
    cmd += ["-e", f"inject={calls}:delay_enter={hold_s}s", "-p", str(pid)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()  # "strace: Process N attached ...", once every thread is held
        assert "attached" in line, f"strace could not attach to {pid}: {line}{proc.stderr.read()}"
        yield proc
    finally:
        proc.kill()
        proc.wait()
