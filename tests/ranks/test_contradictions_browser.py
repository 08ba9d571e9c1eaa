"""Issue 33, section 4, in Chromium: rows and notes that contradicted the rest of the page.

A dead rank's State said "training" beside "✕ dead"; and "Attempts
unavailable: Failed to fetch" stayed above the fresh list after the
dashboard came back.
"""

from __future__ import annotations

import time

import pytest
from playwright.sync_api import expect

from tests.helpers.browser import WAIT_MS, cell
from tests.helpers.heartbeats import HOST, Hosts, heartbeat, write_heartbeat, write_job
from tests.helpers.liveserver import free_port

pytestmark = pytest.mark.browser


def test_a_dead_rank_does_not_read_training(live_server, page, run_dir, console_errors):
    # Rank 0 keeps reporting (a heartbeat written once would be dead too on a loaded machine);
    # rank 1 said "training", then nothing for a minute (DEAD_AFTER_S is 4 s here).
    with Hosts(run_dir, {0: HOST}, world=2):
        write_heartbeat(run_dir, heartbeat(1, 2, seq=1, global_step=10, now=time.time() - 60))
        page.goto(live_server.url + "/")
        expect(cell(page, 1, "health")).to_contain_text("dead", timeout=WAIT_MS)
        expect(cell(page, 1, "state")).to_have_text("last said training")
        expect(cell(page, 1, "state")).to_have_attribute(
            "title", "The rank no longer reports: this is the last state it reported"
        )
        expect(cell(page, 0, "state")).to_have_text("training", timeout=WAIT_MS)
    assert console_errors == []


def test_the_attempts_error_goes_when_the_dashboard_answers_again(
    start_server, run_dir, tmp_path, live_env, page
):
    write_job(run_dir, 1)
    write_heartbeat(run_dir, heartbeat(0, 1))
    port = free_port()
    first = start_server(run_dir, tmp_path / "first.log", env=live_env, port=port)
    page.goto(first.url + "/")
    note = page.locator("#attempts-note")
    expect(note).to_contain_text("Each launch of the job in this run directory", timeout=WAIT_MS)
    intro = note.inner_html()

    first.stop()
    expect(note).to_contain_text("Attempts unavailable: ", timeout=WAIT_MS)
    start_server(run_dir, tmp_path / "second.log", env=live_env, port=port)
    # The list it gets is the same as before: the note must go all the same, markup and all.
    expect(note).not_to_contain_text("unavailable", timeout=WAIT_MS)
    assert note.inner_html() == intro
