"""Issue 33, section 6, in Chromium: axe-core on every page finds nothing, of any impact.

The run and checkpoints pages had no ``<h1>`` (axe's page-has-heading-one,
moderate); earlier runs of axe looked only at serious and critical findings.
Every page is checked: the console and the checkpoint browser of one run,
the runs table, a run's console and checkpoints under ``--runs``, and the
error page.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.helpers.axe import violations
from tests.helpers.browser import WAIT_MS
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job

pytestmark = pytest.mark.browser


def settled(page, path: str) -> None:
    """Wait until the page has drawn what it loads, so axe sees it whole."""
    if path.endswith("checkpoints"):
        expect(page.locator("#ckpt-headline")).not_to_have_text("Looking for checkpoints…", timeout=WAIT_MS)
    elif path.startswith("/runs/") or path == "/one":
        expect(page.locator("#rank-table tbody tr")).to_have_count(2, timeout=WAIT_MS)
        expect(page.locator("#state-pill")).not_to_have_text("Loading…", timeout=WAIT_MS)
    elif path == "/":
        expect(page.locator("#runs-table tbody tr")).to_have_count(1, timeout=WAIT_MS)


def jobs(run) -> None:
    write_job(run, 2)
    for r in range(2):
        write_heartbeat(run, heartbeat(r, 2, global_step=5))


def test_every_page_of_one_run_passes_axe(live_server, page, run_dir):
    jobs(run_dir)
    found = {}
    for path, shown in (("/", "/one"), ("/checkpoints", "/checkpoints"), ("/no-such-page", "error")):
        page.goto(live_server.url + path)
        settled(page, shown)
        found[path] = violations(page)
    assert found == {path: [] for path in found}, found


def test_every_page_under_runs_passes_axe(start_server, tmp_path, page, live_env):
    root = tmp_path / "root"
    jobs(root / "a")
    server = start_server(root, tmp_path / "dashboard.log", env=live_env, runs_root=True)
    found = {}
    for path in ("/", "/runs/a/", "/runs/a/checkpoints"):
        page.goto(server.url + path)
        settled(page, path)
        found[path] = violations(page)
    assert found == {path: [] for path in found}, found
