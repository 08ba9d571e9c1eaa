"""The page shows a log-only rank for what it is: what its log cannot tell, and how to get it.

A real ``python -m app`` and headless Chromium; the worker logs are real
files in msrun's format, written by the test as a script prints them.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.helpers.browser import WAIT_MS, cell, row
from tests.helpers.heartbeats import heartbeat, write_heartbeat
from tests.helpers.workerlogs import relaunched

pytestmark = pytest.mark.browser


def test_a_log_rank_says_what_it_cannot_show_and_the_stop_panel_warns(
    live_server, page, run_dir, console_errors
):
    logs = run_dir / "msrun_logs"
    logs.mkdir()
    for r in (0, 1):
        (logs / f"worker_{r}.log").write_text(
            "".join(f"epoch: 1 step: {s}, loss is {2.3 - s / 100:.4f}\n" for s in range(1, 8))
            + "Train epoch time: 700.000 ms, per step time: 100.000 ms\n"
        )
    page.goto(live_server.url + "/")
    expect(page.locator("#rank-table tbody tr")).to_have_count(2, timeout=WAIT_MS)
    expect(row(page, 1)).to_have_attribute("data-source", "log", timeout=WAIT_MS)
    expect(cell(page, 1, "global_step")).to_contain_text("1 / 7 (7)")
    expect(cell(page, 1, "loss")).to_have_text("2.230")
    reason = cell(page, 1, "reason")
    expect(reason).to_contain_text("read from its worker log only")
    expect(reason).to_contain_text("CPU, memory, device and stop stages are not in it")
    expect(reason).to_contain_text("add the Rankwatch bridge")
    expect(cell(page, 1, "cpu_percent")).to_have_text("not in log")
    expect(cell(page, 1, "rss_bytes")).to_have_text("not in log")
    expect(page.locator("#run-message")).to_contain_text("from msrun's worker logs")
    note = page.locator("#stop-note")
    expect(note).to_be_visible()
    expect(note).to_contain_text("2 ranks are shown only from msrun's worker logs")
    expect(note).to_contain_text("it may ignore the flag")

    # A bridge heartbeat for rank 0 wins: its row is no longer marked.
    write_heartbeat(run_dir, heartbeat(0, 2, seq=1, global_step=7))
    expect(row(page, 0)).to_have_attribute("data-source", "bridge", timeout=WAIT_MS)
    expect(cell(page, 0, "reason")).not_to_contain_text("worker log")
    expect(cell(page, 0, "cpu_percent")).to_have_text("99")
    expect(note).to_contain_text("1 rank is shown only from msrun's worker logs")
    assert console_errors == []


def test_a_dashboard_process_started_after_a_relaunch_shows_the_erased_attempt(
    start_server, tmp_path, page, run_dir, console_errors
):
    relaunched(run_dir)  # attempt 1 read by an earlier dashboard, then its log text emptied
    server = start_server(run_dir, tmp_path / "dashboard.log")
    page.goto(server.url + "/")
    items = page.locator("#attempts-list li")
    expect(items).to_have_count(2, timeout=WAIT_MS)
    expect(items.nth(0)).to_contain_text("Attempt 1 ")
    expect(items.nth(0)).to_contain_text("global steps 1–7")
    expect(items.nth(0).locator(".attempt-note")).to_contain_text("this attempt's log text is gone")
    expect(items.nth(1)).to_contain_text("Attempt 2 ")
    assert console_errors == []
