"""Issue 33, section 1, in Chromium: a tab left open across a relaunch of the dashboard.

The relaunched dashboard has a new token (docs/security.md says why it does
not keep the old one), so the old tab must say at once that it is read-only
and how to get back, and a new login link pasted into that same tab must log
it in without a reload.
"""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from tests.helpers.browser import wait_for_js
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.helpers.liveserver import free_port

pytestmark = pytest.mark.browser

WAIT_MS = 30_000
# `rankwatch login` by name where it is on PATH, else by its path beside the dashboard's Python.
STALE = re.compile(r"^read-only: open a new login link \(`(/\S+/)?rankwatch login`\)$")


def login_code(server) -> str:
    printed = re.search(r"open http://\S+#login=(\S+)", server.log())
    assert printed, server.log()
    return printed[1]


def test_a_tab_left_open_across_a_relaunch_says_so_and_takes_a_pasted_link(
    start_server, run_dir, tmp_path, live_env, page
):
    write_job(run_dir, 1)
    write_heartbeat(run_dir, heartbeat(0, 1))
    port = free_port()
    first = start_server(run_dir, tmp_path / "first.log", env=live_env, port=port)
    page.goto(f"{first.url}/#login={login_code(first)}")
    expect(page.locator("#operator-state")).to_have_text("operator", timeout=WAIT_MS)
    expect(page.locator("#stop-open")).to_be_enabled()
    wait_for_js(page, "window.rankwatch && window.rankwatch.socket.connected")
    # Survives only as long as the document does: a reload would drop it.
    page.evaluate("window.__sameDocument = true")

    # Ctrl-C and the same command again: same address, new token.
    first.stop()
    second = start_server(run_dir, tmp_path / "second.log", env=live_env, port=port)
    # The socket reconnects by itself; the page re-checks its token then, not when Stop is pressed.
    expect(page.locator("#operator-state")).to_have_text(STALE, timeout=WAIT_MS)
    expect(page.locator("#operator-state")).to_have_attribute("data-state", "stale")
    expect(page.locator("#stop-open")).to_be_disabled()
    expect(page.locator("#stop-open")).to_have_text("Stop gracefully (needs a new login link)")
    assert page.evaluate("sessionStorage.getItem('rankwatch.token')") is None

    # `rankwatch login`'s link pasted into the same tab changes only the hash.
    page.evaluate("(code) => { location.hash = '#login=' + code; }", login_code(second))
    expect(page.locator("#operator-state")).to_have_text("operator", timeout=WAIT_MS)
    expect(page.locator("#stop-open")).to_be_enabled()
    assert page.evaluate("window.__sameDocument") is True
    assert "login" not in page.url


def test_the_checkpoints_page_says_so_too(start_server, run_dir, tmp_path, live_env, page):
    write_job(run_dir, 1)
    port = free_port()
    first = start_server(run_dir, tmp_path / "first.log", env=live_env, port=port)
    page.goto(f"{first.url}/checkpoints#login={login_code(first)}")
    wait_for_js(page, "sessionStorage.getItem('rankwatch.token') !== null")
    expect(page.locator("#ckpt-connection")).to_have_text("live", timeout=WAIT_MS)
    first.stop()
    second = start_server(run_dir, tmp_path / "second.log", env=live_env, port=port)
    expect(page.locator("#ckpt-flash")).to_have_text(STALE, timeout=WAIT_MS)
    page.evaluate("(code) => { location.hash = '#login=' + code; }", login_code(second))
    wait_for_js(page, "sessionStorage.getItem('rankwatch.token') !== null")
