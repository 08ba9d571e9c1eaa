"""Storage faults under a real msrun job: the heartbeat directory fills up, then turns read-only.

``RUN/rankwatch`` (where the bridge writes heartbeats and history) is a tiny
tmpfs of its own, so the test can fill it (ENOSPC) and remount it read-only
(EROFS) while the job trains, without touching the job's data or logs.
Needs root and a working ``mount -t tmpfs``; skipped otherwise.

What must hold: training goes on and ends cleanly (exit 0, every step in
the worker logs); each problem is logged once per rank; while writes fail
the page says heartbeats are not arriving and that the process still runs;
once writes work again the heartbeat carries the problem in ``warnings`` and
the page shows it.

Nothing here depends on the machine's speed. The job trains until the test
stops it (a graceful stop once both faults have been seen), not for a fixed
number of epochs that a loaded machine's slow page could outlast; and
``DEAD_AFTER_S`` is far away, so a silent rank stays "stalled" (not "dead")
for as long as the page takes to show it.
"""

from __future__ import annotations

import re
import time

import pytest
from playwright.sync_api import expect

from tests.helpers.faults import UI_TIMEOUT_MS, cell, measure
from tests.helpers.jobs import dump
from tests.helpers.storage import fill, mount, small_tmpfs
from trainer_bridge.rundir import runfiles

pytestmark = [pytest.mark.msrun, pytest.mark.browser]

SIZE = "2m"
# Far more than the test needs: the job ends by a graceful stop, not by itself.
EPOCHS = 1000
SAMPLES = 500


@pytest.fixture
def small_state_dir(tmp_path):
    """``RUN/rankwatch`` as its own 2 MB tmpfs; unmounted after the test."""
    run = tmp_path / "run"
    with small_tmpfs(runfiles.state_dir(run), SIZE):
        yield run


def test_full_then_read_only_heartbeat_directory(small_state_dir, tmp_path, page, start_job, start_dash):
    run = small_state_dir
    state = runfiles.state_dir(run)
    job = start_job(run, epochs=EPOCHS, samples=SAMPLES, step_delay=0.05)
    # A silent rank turns "dead" after DEAD_AFTER_S: put that out of reach, so
    # "stalled" lasts until the page has shown it, however slow the machine.
    dash = start_dash(run, tmp_path / "dashboard.log", DEAD_AFTER_S=3600)
    hbs = job.wait_for_step(3)
    pids = [h["pid"] for h in hbs]
    page.goto(dash.url)
    for r in (0, 1):
        expect(cell(page, r, "health")).to_contain_text("healthy", timeout=UI_TIMEOUT_MS)

    # 1. Disk full.
    filler = fill(state)
    full_at = time.monotonic()
    rows = dash.wait_rows(
        lambda rows: (
            rows
            if all(
                rows[r]["health"] == "stalled" and "no heartbeat for over" in rows[r]["reason"]
                for r in (0, 1)
            )
            else None
        ),
        "both ranks shown without heartbeats",
    )
    measure("storage.full_to_shown", time.monotonic() - full_at)
    for r in (0, 1):
        assert f"its process {pids[r]} still runs" in rows[r]["reason"], rows[r]
        assert "disk full? read-only run directory?" in rows[r]["reason"]
    expect(cell(page, 0, "reason")).to_contain_text("no heartbeat for over 5 s")
    expect(cell(page, 0, "reason")).to_contain_text("unable to write its heartbeat")
    # Training goes on meanwhile: the step log moves.
    logged = [len(job.steps_logged(r)) for r in (0, 1)]
    deadline = time.monotonic() + 120
    while [len(job.steps_logged(r)) for r in (0, 1)] <= logged:
        assert time.monotonic() < deadline and job.proc.poll() is None, job.logs()
        time.sleep(0.1)

    filler.unlink()
    freed_at = time.monotonic()
    rows = dash.wait_rows(
        lambda rows: (
            rows
            if all(
                rows[r]["health"] == "healthy"
                and any("No space left on device" in w for w in rows[r]["warnings"])
                for r in (0, 1)
            )
            else None
        ),
        "heartbeats back, carrying the warning",
    )
    measure("storage.freed_to_healthy_with_warning", time.monotonic() - freed_at)
    expect(cell(page, 1, "reason")).to_contain_text("⚠ cannot write to", timeout=UI_TIMEOUT_MS)
    expect(cell(page, 1, "reason")).to_contain_text("No space left on device")

    # 2. Read-only.
    assert job.proc.poll() is None, "the job ended before the read-only phase: make it longer"
    assert mount("-o", "remount,ro", str(state)).returncode == 0
    ro_at = time.monotonic()
    dash.wait_rows(
        lambda rows: all(
            rows[r]["health"] == "stalled" and "no heartbeat for over" in rows[r]["reason"] for r in (0, 1)
        ),
        "both ranks shown without heartbeats (read-only)",
    )
    measure("storage.read_only_to_shown", time.monotonic() - ro_at)
    assert mount("-o", "remount,rw", str(state)).returncode == 0
    dash.wait_rows(
        lambda rows: all(
            rows[r]["health"] == "healthy" and any("Read-only file system" in w for w in rows[r]["warnings"])
            for r in (0, 1)
        ),
        "heartbeats back, carrying the read-only warning",
    )
    expect(cell(page, 0, "reason")).to_contain_text("Read-only file system", timeout=UI_TIMEOUT_MS)
    expect(cell(page, 0, "reason")).to_contain_text("(+1 more)")

    # The end: a graceful stop, now that both faults are over.
    assert job.proc.poll() is None, "the job ended before it was stopped"
    status, body = dash.post("/api/exit", {"reason": "storage test done"})
    assert status == 202, body
    assert job.wait() == 0, job.logs()
    dash.wait_rows(lambda rows: all(rows[r]["health"] == "exited" for r in (0, 1)), "both ranks exited")

    # Training went on through both faults: every step ran on every rank, up to the stop step.
    stop_step, _ = job.stopped_together()
    for r in (0, 1):
        assert job.steps_logged(r) == list(range(1, stop_step + 1)), job.steps_logged(r)[-5:]
        hb = job.heartbeat(r)
        assert hb["global_step"] == stop_step, dump(hb)
        # Each problem logged once per rank, not once per heartbeat.
        log = job.worker_log(r)
        for why in ("No space left on device", "Read-only file system"):
            lines = re.findall(rf"rankwatch: cannot write to .*{why}.*\(training continues\)", log)
            assert len(lines) == 1, (why, lines)
