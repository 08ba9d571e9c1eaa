"""A fresh machine: build the wheel, install it without ``-e`` into a new venv, and use it.

The venv lives outside the checkout and gets no ``PYTHONPATH``, so nothing
can come from the repository: only what the wheel carries. It has no
MindSpore (the dashboard and the CLI must not need it). Against a real
2-rank msrun job (launched with the development venv, which has MindSpore):

* ``rankwatch serve --port 0`` serves both pages, and every request the
  pages make (scripts, styles, vendored assets, Plotly, Socket.IO) answers
  200, in Chromium;
* ``rankwatch status`` and ``rankwatch checkpoints`` read the run directory;
* ``rankwatch stop`` stops the job gracefully, and the audit trail shows it.

It needs the package index (pip downloads the dependencies), like any
install. ``measure`` prints the install's size and time.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from playwright.sync_api import expect

from app.audit import AuditLog
from tests.helpers.app import TOKEN
from trainer_bridge.rundir import runfiles

pytestmark = [pytest.mark.slow, pytest.mark.msrun, pytest.mark.browser]

REPO = Path(__file__).resolve().parents[2]
_ANYWHERE = shutil.ignore_patterns("*.egg-info", "__pycache__", ".*_cache", ".hypothesis")
# Only at the top of the checkout: app/runs/ and tests/runs/ are code, /runs/ is the demo's output.
_TOP = {".git", ".venv", "build", "dist", "runs"}


def not_on_a_fresh_machine(folder: str, names: list[str]) -> set[str]:
    """What a fresh machine would not have: the checkout's own build and run output, caches."""
    top = _TOP & set(names) if Path(folder).resolve() == REPO else set()
    return top | _ANYWHERE(folder, names)


TIMEOUT_S = 900
UI_TIMEOUT_MS = 60_000


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, **kw)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    """(the venv's bin directory, an environment for it): the wheel installed as a user would."""
    root = tmp_path_factory.mktemp("fresh-machine")
    src, dist, venv = root / "src", root / "dist", root / "venv"
    shutil.copytree(REPO, src, ignore=not_on_a_fresh_machine)
    started = time.monotonic()
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(dist), str(src)])
    built = time.monotonic()
    wheel = next(dist.glob("rankwatch-*.whl"))
    run([sys.executable, "-m", "venv", str(venv)])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("RANKWATCH_")}
    env.pop("VIRTUAL_ENV", None)
    run([str(venv / "bin" / "pip"), "install", "--quiet", str(wheel)], env=env, cwd=root)
    installed = time.monotonic()
    print(
        f"\nfresh install: wheel {wheel.stat().st_size / 1024:.0f} KiB built in {built - started:.1f} s; "
        f"venv {du(venv) / 2**20:.0f} MiB installed in {installed - built:.1f} s"
    )
    # Nothing of the checkout, and no MindSpore.
    probe = run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.util, app; print(app.__file__); print(importlib.util.find_spec('mindspore'))",
        ],
        env=env,
        cwd=root,
    ).stdout.split()
    assert probe[0].startswith(str(venv)) and probe[1] == "None", probe
    return venv / "bin", env, root


class Served:
    """``rankwatch serve`` from the fresh venv, on a free port it reports itself."""

    def __init__(self, bin_dir: Path, env: dict, cwd: Path, run_dir: Path):
        self.proc = subprocess.Popen(
            [str(bin_dir / "rankwatch"), "serve", "--run-dir", str(run_dir), "--port", "0"],
            env={**env, "RANKWATCH_TOKEN": TOKEN},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        # Event-driven: the first start of a fresh venv compiles every module, which a loaded
        # machine can stretch past any short deadline; only a hung start hits TIMEOUT_S.
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while not any(ln.startswith("Rankwatch: open ") for ln in self.lines):
                assert self.proc.poll() is None, "\n".join(self.lines)
                assert time.monotonic() < deadline, "\n".join(self.lines)
                time.sleep(0.1)
        except BaseException:
            self.stop()  # it never came up: the test gets no Served to stop
            raise
        line = next(ln for ln in self.lines if ln.startswith("Rankwatch: open "))
        self.url = re.search(r"http://[\d.]+:\d+", line).group(0)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture
def serve():
    """``serve(bin_dir, env, cwd, run_dir)``: a ready ``Served``, stopped after the test."""
    with ExitStack() as ends:

        def start(*args) -> Served:
            served = Served(*args)
            ends.callback(served.stop)
            return served

        yield start


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_wheel_installed_without_e_serves_reads_and_stops_a_real_job(
    fresh_venv, tmp_path, browser, start_job, serve
):
    bin_dir, env, cwd = fresh_venv
    run_dir = tmp_path / "run"
    job = start_job(run_dir, epochs=200, step_delay=0.05, extra=["--ckpt-every", "10"])
    job.wait_for_step(25)  # periodic sets from step 10 on (the newest 5 kept)
    served = serve(bin_dir, env, cwd, run_dir)
    assert "development server" not in "\n".join(served.lines)

    # Every request both pages make answers 200 (each page in a fresh
    # context: a cache would answer 304 for what the first page loaded).
    responses: list[tuple[int, str]] = []
    for path, ready in (
        ("/", "#rank-table tbody tr[data-health='healthy']"),
        ("/checkpoints", "tr.set-row[data-complete='true']"),
    ):
        context = browser.new_context()
        page = context.new_page()
        page.on("response", lambda r: responses.append((r.status, r.url)))
        page.goto(served.url + path)
        expect(page.locator(ready).first).to_be_visible(timeout=UI_TIMEOUT_MS)
        expect(page.locator(".connection")).to_have_attribute("data-state", "live", timeout=UI_TIMEOUT_MS)
        context.close()
    assets = {url.split("?")[0] for status, url in responses}
    for needed in ("/static/css/rankwatch.css", "/static/js/main.js", "/static/js/table.js",
                   "/static/js/checkpoints.js", "/static/vendor/socket.io-4.8.4.min.js",
                   "/vendor/plotly.min.js"):  # fmt: skip
        assert served.url + needed in assets, sorted(assets)
    assert [r for r in responses if r[0] != 200] == [], responses

    # Both ranks healthy: on a busy host one could be judged a straggler, which is not what this checks.
    calm = {**env, "RANKWATCH_STRAGGLER_RATIO": "100"}
    status = run([str(bin_dir / "rankwatch"), "status", "--run-dir", str(run_dir)], env=calm, cwd=cwd)
    assert "world size 2" in status.stdout, status.stdout
    assert len(re.findall(r"^\s+[01]\s+\S+\s+✓ healthy", status.stdout, re.M)) == 2, status.stdout
    ckpts = run([str(bin_dir / "rankwatch"), "checkpoints", "--run-dir", str(run_dir)], env=env, cwd=cwd)
    # Whichever periodic sets exist when read: the job trains on meanwhile and
    # keeps only the newest 5, so how far it got depends on the machine.
    listed = re.findall(
        r"ckpt_of_rank/\{rank\}/lenet-\{E\}_\{S\}\.ckpt#g(\d+) .*periodic\s+yes", ckpts.stdout
    )
    assert listed and all(int(g) % 10 == 0 for g in listed), ckpts.stdout
    assert "Resume from" in ckpts.stdout and "--worker_num=2" in ckpts.stdout

    demo = subprocess.run(
        [str(bin_dir / "rankwatch"), "demo", "--no-dashboard"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    assert demo.returncode == 1 and "pip install 'rankwatch[trainer]'" in demo.stderr, demo

    stop = run(
        [str(bin_dir / "rankwatch"), "stop", "--run-dir", str(run_dir), "--reason", "fresh-machine test"],
        env=env,
        cwd=cwd,
    )
    assert job.wait() == 0, job.logs()
    stop_step, _ = job.stopped_together()
    assert f"all 2 ranks stopped after step {stop_step}" in stop.stdout, stop.stdout
    for r in range(2):
        assert re.search(rf"^rank\s+{r}\s+exited\s+checkpoints/rank_{r}/", stop.stdout, re.M), stop.stdout

    rows = list(reversed(AuditLog(runfiles.state_dir(run_dir) / "audit.sqlite3").rows()))
    assert [row["action"] for row in rows] == ["request", "complete", "rearm"], rows
    assert rows[0]["reason"] == "fresh-machine test" and rows[0]["remote_addr"].startswith("shell ")
    assert rows[1]["outcome"].startswith(f"completed: all 2 ranks stopped after step {stop_step}")
