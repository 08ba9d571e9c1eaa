"""Issue 33, section 4, in Chromium: the whole-run charts neither leak handlers nor hide the attempt.

``runcharts.js`` guarded its ``plotly_relayout`` handler with an empty
``dataset`` value, which is falsy, so every redraw added one more (261 per
chart after 30 minutes); and its hover label rendered ``-`` where the text
names the attempt.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.bench.simulate import Simulator
from tests.helpers.browser import WAIT_MS
from tests.helpers.heartbeats import heartbeat, write_heartbeat

pytestmark = pytest.mark.browser

CHARTS = ("#chart-step-time", "#chart-loss")
DRAWN = """sel => { const el = document.querySelector(sel);
  return el && el.data && el.data.some(t => t.meta.kind === 'smoothed' && t.x.length >= 10); }"""
# Plotly keeps a chart's handlers on the element's own EventEmitter.
HANDLERS = "sel => document.querySelector(sel)._ev.listeners('plotly_relayout').length"


def test_many_redraws_add_no_relayout_handler_and_the_hover_names_the_attempt(
    live_server, page, run_dir, console_errors
):
    sim = Simulator(run_dir, 2)
    sim.write_job()
    sim.prefill_history(20)
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2, seq=1, global_step=sim.gstep[r]), history=False)
    page.goto(live_server.url + "/")
    for chart in CHARTS:
        page.wait_for_function(DRAWN, arg=chart, timeout=WAIT_MS)
    before = {chart: page.evaluate(HANDLERS, chart) for chart in CHARTS}
    assert all(n >= 1 for n in before.values()), before
    # As deltas and the controls redraw it over half an hour, and more.
    page.evaluate("() => { for (let i = 0; i < 300; i++) window.rankwatch.charts.run.draw(); }")
    after = {chart: page.evaluate(HANDLERS, chart) for chart in CHARTS}
    assert after == before

    # The one handler left still follows a zoom, and its undoing.
    zoomed = "() => window.rankwatch.charts.run.zoomed.loss"
    page.evaluate("() => Plotly.relayout(document.querySelector('#chart-loss'), {'yaxis.range': [0, 5]})")
    assert page.evaluate(zoomed) is True
    page.evaluate("() => Plotly.relayout(document.querySelector('#chart-loss'), {'yaxis.autorange': true})")
    assert page.evaluate(zoomed) is False

    # The tooltip as drawn: hover the smoothed loss line's middle point.
    page.evaluate(
        """() => { const el = document.querySelector('#chart-loss');
          const i = el.data.findIndex(t => t.meta.kind === 'smoothed');
          Plotly.Fx.hover(el, [{curveNumber: i, pointNumber: Math.floor(el.data[i].x.length / 2)}]); }"""
    )
    label = page.locator("#chart-loss .hoverlayer .hovertext")
    expect(label).to_have_count(1, timeout=WAIT_MS)
    expect(label).to_contain_text("attempt ")
    expect(label).to_contain_text("global step ")
    assert not label.text_content().startswith("-"), label.text_content()
    assert console_errors == []
