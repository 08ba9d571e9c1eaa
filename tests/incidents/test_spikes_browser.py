"""Loss spikes in Chromium: the table's NaN, the loss chart's mark with its evidence, the rollbacks section.

A 2-rank run's heartbeats, written as the bridge writes them, turn NaN at
step 40; the real dashboard (``python -m app``, SPIKE_MODE observe) judges
them as they come. Every wait is on an event, with a deadline as a guard.
"""

from __future__ import annotations

import math

import pytest
from playwright.sync_api import expect

from tests.helpers.app import wait_for
from tests.helpers.browser import WAIT_MS
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.helpers.liveserver import rank_rows

pytestmark = pytest.mark.browser

SPIKE = """() => { const el = document.querySelector('#chart-loss');
  return el && el.data && el.data.some(t => t.meta.kind === 'spike'); }"""


def test_a_nan_is_shown_marked_on_the_chart_with_its_evidence_and_listed(
    live_server, page, run_dir, console_errors
):
    write_job(run_dir, 2)
    for i, step in enumerate(range(5, 65, 5), start=1):
        for r in (0, 1):
            loss = math.nan if step >= 40 else 2.3 / (1 + step / 100) * (1 + 0.05 * math.sin(step + r))
            write_heartbeat(run_dir, heartbeat(r, 2, seq=i, global_step=step, loss=loss))
        # One sample per tick: wait until the dashboard has read this step on both ranks (both
        # rows there: before its first tick it lists none, and all() of nothing is true).
        wait_for(
            lambda step=step: [row["global_step"] for row in rank_rows(live_server.url)] == [step, step],
            f"the dashboard at step {step}",
        )
    page.goto(live_server.url + "/")
    # The rank table shows NaN, never a blank.
    expect(page.locator("#rank-table tbody tr").first).to_contain_text("NaN", timeout=WAIT_MS)
    page.wait_for_function(SPIKE, timeout=WAIT_MS)
    page.evaluate(
        """() => { const el = document.querySelector('#chart-loss');
          const i = el.data.findIndex(t => t.meta.kind === 'spike');
          Plotly.Fx.hover(el, [{curveNumber: i, pointNumber: 0}]); }"""
    )
    label = page.locator("#chart-loss .hoverlayer .hovertext")
    expect(label).to_contain_text("nonfinite: rank", timeout=WAIT_MS)
    expect(label).to_contain_text("NaN")
    item = page.locator("#rollbacks-list li[data-rule='nonfinite']").first
    expect(item).to_contain_text("nonfinite", timeout=WAIT_MS)
    expect(page.locator("#rollbacks-list li[data-kind='observed']")).to_contain_text("from step 36")
    assert console_errors == []
