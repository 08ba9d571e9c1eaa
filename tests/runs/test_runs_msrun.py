"""Three real msrun jobs under one root, one dashboard (``--runs ROOT``), a real browser.

All three appear in ``GET /api/runs`` and on the landing page, with a loss
sparkline and the disk they use; a run's console opens from its row. One
(A) is stopped from its run page: every rank together, its row turns to
stopped. One (C) has a rank killed with ``kill -9``: its row says failed and
comes first, as needing attention. One (B) trains on, healthy, throughout.
Then A is relaunched: it resumes at S+1, and its row and console show two
attempts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from playwright.sync_api import expect

from tests.helpers.app import TOKEN
from tests.helpers.browser import serious
from tests.helpers.jobs import JOB_TIMEOUT_S, DemoJob, dump
from tests.helpers.liveserver import start_dashboard
from trainer_bridge.rundir import runfiles

pytestmark = [pytest.mark.msrun, pytest.mark.browser]

# Two jobs, a dashboard and a browser on a shared 2-core machine: verdict thresholds no
# competition for the cores reaches (this test is about runs, not about stragglers).
CALM = {"RANKWATCH_STALL_MIN_S": "120", "RANKWATCH_STRAGGLER_RATIO": "100"}
UI_TIMEOUT_MS = 120_000
A, B, C = "exp a", "team/b", "crash c"


def runs(server) -> dict[str, dict]:
    with urllib.request.urlopen(server.url + "/api/runs?per_page=500", timeout=30) as r:
        return {row["id"]: row for row in json.loads(r.read())["runs"]}


def wait_rows(server, predicate, what: str, jobs=()) -> dict[str, dict]:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    rows = {}
    while time.monotonic() < deadline:
        rows = runs(server)
        if predicate(rows):
            return rows
        for job in jobs:
            assert job.proc.poll() is None, f"a job ended before {what}\n{job.logs()}"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {dump(rows)}")


def job(rel_root, name) -> DemoJob:
    # More epochs than the test lasts: every job is alive until it is stopped, killed or ended by the test.
    return DemoJob(rel_root / name, epochs=200, step_delay=0.05)


def cell(page, run_id: str, col: str):
    return page.locator(f'#runs-table tbody tr[data-run="{run_id}"] td[data-col="{col}"]')


def test_three_jobs_one_root_stop_one_kill_one_relaunch(tmp_path, page, console_errors):
    root = tmp_path / "root"
    a, b, c = job(root, A).start(), job(root, B).start(), job(root, C).start()
    a2 = None
    server = start_dashboard(
        root,
        tmp_path / "dashboard.log",
        env={"RANKWATCH_TOKEN": TOKEN, "RANKWATCH_TICK_S": "0.2", **CALM},
        runs_root=True,
    )
    try:
        for j in (a, b, c):
            j.wait_for_step(3)
        rows = wait_rows(
            server,
            lambda rows: all(
                rows.get(i, {}).get("state") == "training"
                and rows[i]["world_size"] == 2
                and rows[i]["loss_spark"]
                for i in (A, B, C)
            ),
            "the three runs training, with losses",
            (a, b, c),
        )
        assert set(rows) == {A, B, C}, dump(rows)
        for i in (A, B, C):
            # Every regular file under the run counts: at least the ranks' worker logs and heartbeats.
            assert rows[i]["disk_bytes"] > 0 and not rows[i]["disk_truncated"], dump(rows[i])
            assert rows[i]["loss"] == rows[i]["loss_spark"][-1]

        # The landing page lists all three, with a sparkline that says its first and last loss, and is accessible.
        page.goto(server.url + "/")
        expect(page.locator("#runs-table tbody tr")).to_have_count(3, timeout=UI_TIMEOUT_MS)
        expect(cell(page, B, "state")).to_have_text("training")
        expect(cell(page, B, "loss").locator("svg[role=img]")).to_have_attribute(
            "aria-label", re.compile(r"^loss [\d.]+ to [\d.]+ over the last \d+ points$")
        )
        expect(cell(page, B, "disk")).to_have_text(re.compile(r"^\d+(\.\d)? (B|KiB|MiB|GiB)$"))
        assert serious(page) == []

        # A is stopped from its run page, which names the run in the dialog.
        page.locator(f'#runs-table tbody tr[data-run="{A}"] a').click()
        expect(page).to_have_url(re.compile(r"/runs/exp%20a/$"))
        expect(page.locator("#rank-table tbody tr[data-health='healthy']")).to_have_count(
            2, timeout=UI_TIMEOUT_MS
        )
        page.click("#token-open")
        page.fill("#token-input", TOKEN)
        page.click("#token-save")
        expect(page.locator("#operator-state")).to_have_text("operator")
        page.click("#stop-open")
        expect(page.locator("#stop-dialog .stop-run")).to_have_text(A)
        page.fill("#stop-reason", "runs e2e")
        page.fill("#stop-who", "tester")
        page.click("#stop-confirm")
        assert a.wait() == 0, a.logs()
        s, _ = a.stopped_together()
        expect(page.locator("#stop-panel")).to_have_attribute(
            "data-state", re.compile("completed|rearmed"), timeout=UI_TIMEOUT_MS
        )
        (launch_a,) = {hb["launch"] for hb in a.heartbeats()}
        rows = wait_rows(server, lambda rows: rows[A]["state"] == "stopped", "A's row to say stopped", (b, c))
        assert rows[A]["health_counts"] == {"exited": 2}, dump(rows[A])
        assert rows[A]["last_stop"]["requested_by"] == "tester" and rows[B]["last_stop"] is None, dump(rows)

        # C loses a rank to kill -9: its row says failed and comes first (it needs attention).
        pids_c = [hb["pid"] for hb in c.heartbeats()]
        os.kill(pids_c[1], signal.SIGKILL)
        rows = wait_rows(
            server,
            lambda rows: rows[C]["state"] == "failed" and rows[C]["needs_attention"],
            "C's row to say failed",
            (b,),
        )
        assert rows[C]["health_counts"].get("dead"), dump(rows[C])
        with urllib.request.urlopen(server.url + "/api/runs", timeout=30) as r:
            table = json.loads(r.read())
        assert table["runs"][0]["id"] == C and table["needs_attention"] == 1, dump(table)
        page.goto(server.url + "/")
        expect(page.locator("#runs-table tbody tr").first).to_have_attribute(
            "data-run", C, timeout=UI_TIMEOUT_MS
        )
        expect(cell(page, C, "state")).to_have_text("⚠ failed")
        expect(cell(page, A, "state")).to_have_text("stopped")
        expect(cell(page, A, "stop")).to_contain_text("tester")
        cli = subprocess.run(
            [sys.executable, "-m", "app.cli", "runs", str(root), "--json"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **CALM},
        )
        assert cli.returncode == 0, cli.stderr
        shell = [(r["id"], r["state"]) for r in json.loads(cli.stdout)["runs"]]
        assert shell[0] == (C, "failed") and dict(shell) == {A: "stopped", B: "training", C: "failed"}, (
            cli.stdout
        )

        # B trained on, healthy, through all of it.
        step = max(h["global_step"] for h in b.heartbeats())
        b.wait_for_step(step + 3)
        assert all(h["state"] == "training" for h in b.heartbeats())
        assert runs(server)[B]["health_counts"] == {"healthy": 2}
        flag = runfiles.read_json_or_none(runfiles.flag_path(root / B))
        assert flag is None or not flag.get("GracefulExit"), flag

        # A relaunched resumes at S+1: its row and its console show two attempts.
        a2 = job(root, A).start()
        a2.wait_until(
            lambda hbs: all(
                h and h.get("launch") not in (None, launch_a) and h["global_step"] >= s + 2 for h in hbs
            ),
            "A's relaunch past S+2",
        )
        assert all(a2.steps_logged(r)[0] == s + 1 for r in range(2))
        rows = wait_rows(
            server,
            lambda rows: rows[A]["attempts"] == 2 and rows[A]["state"] == "training",
            "A's row to show its second attempt, training",
            (a2, b),
        )
        page.goto(server.url + rows[A]["url"])
        items = page.locator("#attempts-list li")
        expect(items).to_have_count(2, timeout=UI_TIMEOUT_MS)
        expect(items.nth(0)).to_have_attribute("data-end", "graceful_stop")
        expect(items.nth(1)).to_contain_text(re.compile(rf"resumed from global step {s}\b"))
        page.goto("about:blank")
        assert console_errors == []
    finally:
        for j in (a, b, c, a2):
            if j is not None:
                j.kill()
        server.stop()
