"""Dashboard faults, with real msrun jobs and a real browser.

* The dashboard is killed (SIGKILL) during a stop and restarted: the stop
  completes anyway (the trainers read the flag file, not the dashboard); the
  restarted dashboard shows the stop's true outcome; the audit trail has
  every row (the request from the first dashboard, the completion and the
  re-arm from the restarted one, before any page is open on it).
* The dashboard starts before the job, on a missing, empty or unreadable run
  directory: the page says so clearly, and picks the job up when it appears.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from playwright.sync_api import expect

from tests.helpers.faults import UI_TIMEOUT_MS, cell, measure
from tests.helpers.jobs import UNTIL_STOPPED, dump
from trainer_bridge.rundir import runfiles

pytestmark = [pytest.mark.msrun, pytest.mark.browser]


def test_dashboard_killed_during_a_stop_then_restarted(tmp_path, page, start_job, start_dash):
    run = tmp_path / "run"
    job = start_job(run, epochs=20, step_delay=0.05)
    first = start_dash(run, tmp_path / "dashboard-1.log")
    job.wait_for_step(3)
    page.goto(first.url)
    expect(cell(page, 1, "health")).to_contain_text("healthy", timeout=UI_TIMEOUT_MS)
    status, body = first.post("/api/exit", {"reason": "fault test: dashboard dies", "who": "op"})
    assert status == 202, body
    request_id = body["request_id"]
    first.kill()  # mid-stop: the ranks have at most just seen the flag
    stages_at_kill = [((h or {}).get("stop") or {}).get("stage") for h in job.heartbeats()]
    killed_at = time.monotonic()

    # Training reads the file, not the dashboard: the stop completes anyway.
    assert job.wait() == 0, job.logs()
    measure(
        "dashboard_kill.stop_completed_after_kill",
        time.monotonic() - killed_at,
        stages_at_kill=stages_at_kill,
    )
    hbs = job.heartbeats()
    stop_step = hbs[0]["stop"]["stop_step"]
    assert all(
        h["state"] == "exited"
        and h["stop"]["request_id"] == request_id
        and h["stop"]["stop_step"] == stop_step
        for h in hbs
    ), dump(hbs)

    restarted_at = time.time()
    second = start_dash(run, tmp_path / "dashboard-2.log")
    # The true outcome, from the files alone, before any browser connects
    # ("rearmed" once its watcher has recorded the completion).
    exit_status = second.get("/api/exit")
    assert exit_status["state"] in ("completed", "rearmed"), dump(exit_status)
    assert exit_status["request"]["request_id"] == request_id
    assert exit_status["stop_step"] == stop_step
    assert exit_status["summary"].startswith(f"all 2 ranks stopped after step {stop_step}")

    # Its watcher records the completion and re-arms, with no page open.
    rows = second.wait(
        lambda body: (
            body["rows"] if {"complete", "rearm"} <= {row["action"] for row in body["rows"]} else None
        ),
        "the completion and re-arm rows",
        path="/api/audit",
    )
    page.goto(second.url)
    panel = page.locator("#stop-panel")
    expect(panel).to_have_attribute("data-state", re.compile("completed|rearmed"), timeout=UI_TIMEOUT_MS)
    expect(page.locator("#stop-headline")).to_contain_text(f"all 2 ranks stopped after step {stop_step}")
    for r in (0, 1):
        expect(cell(page, r, "health")).to_contain_text("exited")
    expect(page.locator("#audit-table tbody tr[data-action='complete']")).to_have_count(
        1, timeout=UI_TIMEOUT_MS
    )

    by_action = {row["action"]: row for row in rows}
    assert [row["action"] for row in reversed(rows)] == ["request", "complete", "rearm"], rows
    assert by_action["request"]["outcome"] == "accepted" and by_action["request"]["who"] == "op"
    assert by_action["request"]["at"] < restarted_at
    assert by_action["complete"]["request_id"] == by_action["rearm"]["request_id"] == request_id
    assert by_action["complete"]["at"] >= restarted_at and by_action["rearm"]["at"] >= restarted_at
    assert by_action["complete"]["outcome"].startswith(
        f"completed: all 2 ranks stopped after step {stop_step}"
    )
    assert json.loads(runfiles.flag_path(run).read_text())["GracefulExit"] == 0


def run_message(page):
    return page.locator("#run-message")


def test_dashboard_started_before_the_job_and_on_bad_run_directories(
    tmp_path, page, console_errors, start_job, start_dash
):
    run = tmp_path / "run"  # does not exist yet
    dash = start_dash(run, tmp_path / "dashboard.log")
    status = page.locator("#run-status")
    page.goto(dash.url)
    expect(status).to_have_attribute("data-status", "missing", timeout=UI_TIMEOUT_MS)
    # This page holds no token: it is told the run by its name, not where it lives (issue 32, P11).
    expect(run_message(page)).to_contain_text(f"The run directory {run.name} does not exist (yet)")

    run.mkdir()
    expect(status).to_have_attribute("data-status", "waiting", timeout=UI_TIMEOUT_MS)
    expect(run_message(page)).to_contain_text("The job has not started")

    state_dir = runfiles.state_dir(run)
    state_dir.write_text("not a directory")  # another tool took the name
    expect(status).to_have_attribute("data-status", "unreadable", timeout=UI_TIMEOUT_MS)
    expect(run_message(page)).to_contain_text(f"Cannot read {run.name}/rankwatch: Not a directory")
    state_dir.unlink()

    state_dir.mkdir()
    runfiles.job_path(run).write_bytes(b'{"world_size": 2, "sta')  # torn, by another tool
    expect(status).to_have_attribute("data-status", "waiting", timeout=UI_TIMEOUT_MS)
    expect(run_message(page)).to_contain_text("job.json is unreadable")

    # The job appears: the same page picks it up, no reload.
    start_job(run, epochs=UNTIL_STOPPED, step_delay=0.05)  # killed after the test
    started = time.monotonic()
    for r in (0, 1):
        expect(cell(page, r, "health")).to_contain_text("healthy", timeout=UI_TIMEOUT_MS)
        # Shown from its worker log while it compiles, then from the bridge's heartbeats.
        expect(cell(page, r, "health").locator("xpath=..")).to_have_attribute(
            "data-source", "bridge", timeout=UI_TIMEOUT_MS
        )
    expect(status).to_have_attribute("data-status", "running", timeout=UI_TIMEOUT_MS)
    expect(run_message(page)).to_have_text("2 ranks reporting.")
    measure("dashboard_before_job.shown_after_launch", time.monotonic() - started)
    assert console_errors == []
