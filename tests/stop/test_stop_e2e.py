"""Stop gracefully, end to end: a real msrun job, the real dashboard, a real browser.

Also: a script using only native ``OnRequestExit`` (no bridge) is stopped by
``POST /api/exit``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import expect

from tests.helpers.app import AUTH, TOKEN
from tests.helpers.jobs import JOB_TIMEOUT_S
from trainer_bridge.demo.mnist import write_mnist
from trainer_bridge.rundir import runfiles
from trainer_bridge.rundir.ckptmeta import read_meta

pytestmark = [pytest.mark.msrun, pytest.mark.browser]

# Generous upper bounds for a shared 2-core machine; never a speed assertion.
UI_TIMEOUT_MS = 120_000


def _shot(page, tmp_path: Path, name: str) -> None:
    page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)


def test_headline_stop_from_the_browser_then_resume(
    tmp_path, browser, console_errors, page, start_job, start_server
):
    run = tmp_path / "run"
    job = start_job(run, epochs=20, step_delay=0.05)
    server = start_server(
        run, tmp_path / "dashboard.log", env={"RANKWATCH_TOKEN": TOKEN, "RANKWATCH_TICK_S": "0.2"}
    )
    job.wait_for_step(3)
    page.goto(server.url)
    # Issue 3: the real job's ranks appear, healthy and training.
    expect(page.locator("#rank-table tbody tr")).to_have_count(2, timeout=UI_TIMEOUT_MS)
    expect(page.locator("#rank-table tbody tr[data-health='healthy']")).to_have_count(
        2, timeout=UI_TIMEOUT_MS
    )
    for i in range(2):
        expect(page.locator("#rank-table tbody td[data-col='state']").nth(i)).to_have_text("training")
    stop_button = page.locator("#stop-open")
    expect(stop_button).to_be_disabled()  # read-only until the token is entered
    expect(page.locator("#operator-state")).to_have_text("read-only")

    page.click("#token-open")
    page.fill("#token-input", "not-the-token")
    page.click("#token-save")
    expect(page.locator("#token-error")).to_be_visible()
    page.fill("#token-input", TOKEN)
    page.click("#token-save")
    expect(page.locator("#operator-state")).to_have_text("operator")
    expect(stop_button).to_be_enabled()

    stop_button.click()
    expect(page.locator("#estimate-ranks")).to_have_text("2")
    expect(page.locator("#estimate-dir")).to_contain_text("checkpoints/rank_{r}/")
    confirm = page.locator("#stop-confirm")
    expect(confirm).to_be_disabled()  # the reason is required
    page.fill("#stop-reason", "e2e: NPU 1 reports ECC errors")
    page.fill("#stop-who", "e2e-operator")
    _shot(page, tmp_path, "1-dialog")
    confirm.dblclick()  # a double click must still make one request

    panel = page.locator("#stop-panel")
    expect(panel).to_have_attribute("data-state", re.compile("completed|rearmed"), timeout=UI_TIMEOUT_MS)
    assert job.wait() == 0, job.logs()
    headline = page.locator("#stop-headline")
    expect(headline).to_contain_text("all 2 ranks stopped after step")
    _shot(page, tmp_path, "2-stopped")
    # Every rank passed every stage, each with its time after the request.
    for stage in ("agreed", "saving", "saved", "exited"):
        cells = page.locator(f"#stop-ranks tbody td.at-{stage}")
        expect(cells).to_have_count(2)
        for i in range(2):
            expect(cells.nth(i)).to_have_text(re.compile(r"^\+\d+\.\d\d$"))
    seen = page.locator("#stop-ranks tbody td.at-seen")
    for i in range(2):
        expect(seen.nth(i)).to_have_text(re.compile(r"^(\+\d+\.\d\d|via vote)$"))
    expect(page.locator("#audit-table tbody tr[data-action='request']")).to_have_count(1)
    expect(page.locator("#audit-table tbody")).to_contain_text("e2e: NPU 1 reports ECC errors")
    headline_shown = page.locator("#stop-headline").text_content()
    # Leave the page before the server goes: its socket would retry (and log) for as long
    # as the relaunch below takes, which depends on the machine.
    page.goto("about:blank")
    server.stop()  # the audit trail is read, and the job relaunched, without it

    stop_step, stops = job.stopped_together()
    headline_text = f"all 2 ranks stopped after step {stop_step}"
    assert headline_text in headline_shown
    for s in stops:
        assert read_meta(run / s["checkpoint"]["path"]).global_step == stop_step

    # The audit trail in SQLite: one request (the double click joined it), the
    # completion, and the automatic re-arm, all in the run directory.
    import sqlite3

    with sqlite3.connect(runfiles.state_dir(run) / "audit.sqlite3") as db:
        rows = db.execute("SELECT action, who, outcome FROM audit ORDER BY id").fetchall()
    actions = [a for a, _, _ in rows]
    assert actions.count("request") >= 1 and "complete" in actions and actions[-1] == "rearm", rows
    assert rows[0][1:] == ("e2e-operator", "accepted"), rows
    assert all(o.startswith(("accepted", "duplicate", "completed")) for _, _, o in rows), rows
    assert json.loads(runfiles.flag_path(run).read_text())["GracefulExit"] == 0

    # Relaunch: it resumes after the stop step and is not stopped again. It asks for one
    # epoch more than the stop was in, wherever a loaded machine let the job get to.
    stopped_in = max(h["epoch"] for h in job.heartbeats())
    again = start_job(run, epochs=stopped_in + 1, step_delay=0.0)
    assert again.wait() == 0, again.logs()
    for r in range(2):
        assert again.steps_logged(r)[0] == stop_step + 1
        assert again.heartbeat(r)["state"] == "finished"
    # The one error is the wrong token typed on purpose, answered 401 as it should be.
    assert console_errors == [
        "Failed to load resource: the server responded with a status of 401 (UNAUTHORIZED)"
    ]


NATIVE_SCRIPT_TIMEOUT_S = JOB_TIMEOUT_S


def test_native_onrequestexit_script_is_stopped_by_post(tmp_path, start_process, start_server):
    """No bridge, one process: MindSpore's own OnRequestExit reads the flag we write."""
    run = tmp_path / "run"
    run.mkdir()
    data = write_mnist(run / "mnist", samples=2000)
    out = open(tmp_path / "native.log", "wb")
    proc = start_process(
        [
            sys.executable,
            "-m",
            "trainer_bridge.demo.train",
            "--run-dir",
            str(run),
            "--data-dir",
            str(data),
            "--epochs",
            "50",
            "--native-exit",
            "--step-log",
            "--step-delay",
            "0.02",
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "MS_ENABLE_GRACEFUL_EXIT": "1", "GLOG_v": "3"},
    )
    out.close()  # the script writes to its own copy
    server = start_server(run, tmp_path / "dashboard.log", env={"RANKWATCH_TOKEN": TOKEN})
    log = tmp_path / "native.log"
    deadline = time.monotonic() + NATIVE_SCRIPT_TIMEOUT_S
    while not re.search(r"^step 3 ", log.read_text(errors="replace"), re.M):
        assert proc.poll() is None, log.read_text(errors="replace")
        assert time.monotonic() < deadline, "the native script never started training"
        time.sleep(0.1)
    req = urllib.request.Request(
        server.url + "/api/exit",
        data=json.dumps({"reason": "native"}).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **AUTH},
    )
    with urllib.request.urlopen(req) as r:
        assert r.status == 202
    assert proc.wait(timeout=NATIVE_SCRIPT_TIMEOUT_S) == 0, log.read_text(errors="replace")
    with urllib.request.urlopen(server.url + "/api/exit") as r:
        status = json.load(r)
    assert status["state"] == "requested" and status["bridge_seen"] is False
    steps = [int(s) for s in re.findall(r"^step (\d+) ", log.read_text(errors="replace"), re.M)]
    assert steps[-1] < 50 * 62  # stopped long before the end
    ckpt = run / "rank_0" / "LeNet_train.ckpt"
    meta = read_meta(ckpt)
    assert meta.ok and meta.extras["step_num"] == steps[-1], (meta, steps[-5:])
