"""Two real msrun jobs under one root, one dashboard (``--runs ROOT``), a real browser.

Both appear in ``GET /api/runs`` and on the landing page; a run's console
opens from its row; ``POST /api/runs/<id>/exit`` stops that job (every rank
together, its row turns to stopped) and the other keeps training.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import expect

from tests.helpers.jobs import JOB_TIMEOUT_S, DemoJob, dump
from tests.helpers.liveserver import start_dashboard
from trainer_bridge.rundir import runfiles

pytestmark = [pytest.mark.msrun, pytest.mark.browser]

TOKEN = "runs-msrun-operator-token-0123456789"
# Two jobs, a dashboard and a browser on a shared 2-core machine: verdict thresholds no
# competition for the cores reaches (this test is about runs, not about stragglers).
CALM = {"RANKWATCH_STALL_MIN_S": "120", "RANKWATCH_STRAGGLER_RATIO": "100"}
UI_TIMEOUT_MS = 120_000
A, B = "exp a", "team/b"


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


def test_two_jobs_one_root_stop_one(tmp_path, page, console_errors):
    root = tmp_path / "root"
    a = DemoJob(root / A, epochs=20, step_delay=0.05).start()
    b = DemoJob(root / B, epochs=20, step_delay=0.05).start()
    server = start_dashboard(
        root,
        tmp_path / "dashboard.log",
        env={"RANKWATCH_TOKEN": TOKEN, "RANKWATCH_TICK_S": "0.2", **CALM},
        runs_root=True,
    )
    try:
        a.wait_for_step(3)
        b.wait_for_step(3)
        rows = wait_rows(
            server,
            lambda rows: all(
                rows.get(i, {}).get("state") == "training" and rows[i]["world_size"] == 2 for i in (A, B)
            ),
            "both runs training",
            (a, b),
        )
        assert set(rows) == {A, B}, dump(rows)

        # The landing page lists both, is accessible, and opens a run's console from its row.
        page.goto(server.url + "/")
        expect(page.locator("#runs-table tbody tr")).to_have_count(2, timeout=UI_TIMEOUT_MS)
        expect(page.locator(f'#runs-table tbody tr[data-run="{B}"] td[data-col="state"]')).to_have_text(
            "training"
        )
        violations = [
            f"{v['id']} ({v['impact']})"
            for v in Axe().run(page).response["violations"]
            if v["impact"] in ("serious", "critical")
        ]
        assert violations == []
        page.locator(f'#runs-table tbody tr[data-run="{A}"] a').click()
        expect(page).to_have_url(re.compile(r"/runs/exp%20a/$"))
        expect(page.locator("#rank-table tbody tr[data-health='healthy']")).to_have_count(
            2, timeout=UI_TIMEOUT_MS
        )

        # A stop of A, through its run-scoped route, stops A only.
        request = urllib.request.Request(
            server.url + "/api" + rows[A]["url"] + "exit",
            data=json.dumps({"reason": "runs e2e", "who": "tester"}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as r:
            assert r.status == 202
        assert a.wait() == 0, a.logs()
        a.stopped_together()
        # A's console heard its own stop (its run's room).
        expect(page.locator("#stop-panel")).to_have_attribute(
            "data-state", re.compile("completed|rearmed"), timeout=UI_TIMEOUT_MS
        )
        rows = wait_rows(server, lambda rows: rows[A]["state"] == "stopped", "A's row to say stopped", (b,))
        assert rows[A]["health_counts"] == {"exited": 2}, dump(rows[A])
        assert rows[A]["last_stop"]["requested_by"] == "tester" and rows[B]["last_stop"] is None, dump(rows)
        step = max(h["global_step"] for h in b.heartbeats())
        b.wait_for_step(step + 3)
        assert all(h["state"] == "training" for h in b.heartbeats())
        assert runs(server)[B]["state"] == "training"
        # The landing row says so, and the shell's table (the same rows) too.
        page.goto(server.url + "/")
        expect(page.locator(f'#runs-table tbody tr[data-run="{A}"] td[data-col="state"]')).to_have_text(
            "stopped"
        )
        expect(page.locator(f'#runs-table tbody tr[data-run="{A}"] td[data-col="stop"]')).to_contain_text(
            "tester"
        )
        cli = subprocess.run(
            [sys.executable, "-m", "app.cli", "runs", str(root), "--json"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **CALM},
        )
        assert cli.returncode == 0, cli.stderr
        shell = {r["id"]: r["state"] for r in json.loads(cli.stdout)["runs"]}
        assert shell == {A: "stopped", B: "training"}, cli.stdout
        flag = runfiles.read_json_or_none(runfiles.flag_path(root / B))
        assert flag is None or not flag.get("GracefulExit"), flag
        page.goto("about:blank")
        assert console_errors == []
    finally:
        a.kill()
        b.kill()
        server.stop()
