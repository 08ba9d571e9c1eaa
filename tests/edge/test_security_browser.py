"""Issue 13, item 10 in a real browser: both pages run under the Content-Security-Policy.

The policy forbids inline script, so a page that still needed some would
break; Chromium reports every violation as a ``securitypolicyviolation``
event and a console error, and this test fails on either.
"""

from __future__ import annotations

import re
import time

import pytest
from playwright.sync_api import expect

from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job

pytestmark = pytest.mark.browser

WAIT_MS = 30_000
WATCH_VIOLATIONS = """
window.__cspViolations = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__cspViolations.push(`${e.violatedDirective} ${e.blockedURI} ${e.sourceFile}:${e.lineNumber}`);
});
"""


def test_both_pages_run_under_the_csp_without_a_violation(live_server, page, run_dir, console_errors):
    write_job(run_dir, 2)
    for seq in (1, 2, 3):
        for r in range(2):
            write_heartbeat(run_dir, heartbeat(r, 2, seq=seq, now=time.time() - 3 + seq))
    page.add_init_script(WATCH_VIOLATIONS)
    response = page.goto(live_server.url + "/")
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    expect(page.locator("#rank-table tbody tr")).to_have_count(2, timeout=WAIT_MS)
    # The charts drew (Plotly is the part most likely to need what the policy forbids).
    expect(page.locator(".main-svg").first).to_be_attached(timeout=WAIT_MS)
    page.wait_for_function("window.rankwatch && window.rankwatch.socket.connected", timeout=WAIT_MS)
    # Hover labels and the mode bar are drawn on demand: bring them up.
    plot = page.locator(".js-plotly-plot").first
    box = plot.bounding_box()
    for dx in (0.3, 0.5, 0.7):
        page.mouse.move(box["x"] + box["width"] * dx, box["y"] + box["height"] * 0.5)
    expect(plot.locator(".modebar")).to_be_attached(timeout=WAIT_MS)
    page.locator("#token-open").click()
    page.keyboard.press("Escape")
    assert page.evaluate("window.__cspViolations") == []

    page.goto(live_server.url + "/checkpoints")
    expect(page.locator("#ckpt-connection")).to_have_attribute("data-state", "live", timeout=WAIT_MS)
    expect(page.locator("#ckpt-headline")).not_to_have_text("Looking for checkpoints…", timeout=WAIT_MS)
    assert page.evaluate("window.__cspViolations") == []
    assert console_errors == []


def test_the_login_link_works_once_and_leaves_nothing_in_the_url(
    live_server, page, run_dir, console_errors, new_context
):
    """The printed URL carries a code the page trades for the token; the history keeps a dead code."""
    write_job(run_dir, 1)
    write_heartbeat(run_dir, heartbeat(0, 1))
    printed = re.search(r"open (http://\S+#login=\S+)", live_server.log())
    assert printed, live_server.log()
    url = printed[1]
    page.goto(url)
    expect(page.locator("#operator-state")).to_have_text("operator", timeout=WAIT_MS)
    assert "#" not in page.url and "login" not in page.url
    token = page.evaluate("sessionStorage.getItem('rankwatch.token')")
    assert token and token not in live_server.log()

    # The same link again, in a fresh tab (as from the history): it is used up.
    other = new_context().new_page()
    other.goto(url)
    expect(other.locator("#token-error")).to_contain_text("used up or expired", timeout=WAIT_MS)
    expect(other.locator("#operator-state")).to_have_text("read-only")
    assert other.evaluate("sessionStorage.getItem('rankwatch.token')") is None
    assert console_errors == []


# Every JSON type where the page expects a number, a string or an object.
WEIRD = ["x", "", {}, {"a": [1]}, [], [1, 2], None, 1e308, -1, 0, True, "NaN", "1e999", 2**60]

SURVIVE = """
([weird, metrics]) => {
  const errors = [];
  const rw = window.rankwatch;
  const now = Date.now() / 1000;
  for (const w of weird) {
    try {
      rw.stop.status = {
        state: "stopping", flag: w, flag_error: w, bridge_seen: w, deadline_s: w, stop_step: w, summary: w,
        request: { request_id: w, requested_at: w, requested_by: w, reason: w },
        ranks: [
          { rank: 0, stage: w, seen_step: w, stop_step: w, checkpoint: { path: w, bytes: w, seconds: w },
            at: { seen: w, agreed: w, saved: w }, late: w, stage_since: w, state: w, error: w },
          { rank: 1, stage: "saved", checkpoint: w, at: w, stage_since: now - 3 },
          w,
        ],
        holding_up: [0], late: w, can_cancel: w, can_rearm: w,
      };
      rw.stop.render();
      rw.stop.renderTimes();
      const row = { rank: 0, warnings: w, time: w, seq: 99 };
      for (const m of metrics) row[m] = w;
      row.rank = 0;
      rw.charts.addRows(rw.store.applyDelta({ now, world_size: 2, rows: [row, { rank: 1, time: now, loss: w }] }));
      rw.store.summary = { ...rw.store.summary, throughput: w, last_step_at: w, global_step: w };
      rw.summary.render();
      rw.table.invalidate();
    } catch (e) {
      errors.push(`${JSON.stringify(w)}: ${e.message}`);
    }
  }
  return errors;
}
"""


def test_the_page_survives_any_value_the_api_passes_through(live_server, page, run_dir, console_errors):
    """A non-numeric checkpoint.seconds threw in stop.js and aborted the stop panel (issue 13, item 12)."""
    write_job(run_dir, 2)
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2))
    page.goto(live_server.url + "/")
    expect(page.locator("#rank-table tbody tr")).to_have_count(2, timeout=WAIT_MS)
    metrics = page.evaluate("JSON.parse(document.querySelector('#rankwatch-config').textContent).metrics")
    names = [m["name"] for m in metrics if m["name"] != "rank"]
    assert page.evaluate(SURVIVE, [WEIRD, names]) == []
    # The table and charts draw what they were given at their next frame; then they still work.
    expect(page.locator("#stop-ranks tbody tr")).not_to_have_count(0)
    write_heartbeat(run_dir, heartbeat(0, 2, seq=5, global_step=777))
    expect(page.locator('#rank-table tbody tr[data-rank="0"] td[data-col="global_step"]')).to_contain_text(
        "(777)", timeout=WAIT_MS
    )
    assert console_errors == []
