"""The page in headless Chromium against a real ``python -m app`` process.

Waits are Playwright's ``expect``/``wait_for_function`` with generous
timeouts (the machine is shared with training jobs); nothing asserts how fast.
"""

from __future__ import annotations

import json
import math
import time
from urllib.parse import urlparse

import pytest
from playwright.sync_api import expect

from tests.bench.simulate import Simulator
from tests.helpers.browser import WAIT_MS, cell
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import runfiles

pytestmark = pytest.mark.browser


def test_table_fills_and_follows_the_heartbeat_files(live_server, page, run_dir, console_errors):
    write_job(run_dir, 3)
    for r in range(3):
        write_heartbeat(run_dir, heartbeat(r, 3, seq=1, global_step=10))
    page.goto(live_server.url + "/")
    expect(page.locator("#rank-table tbody tr")).to_have_count(3, timeout=WAIT_MS)
    expect(cell(page, 1, "global_step")).to_contain_text("(10)", timeout=WAIT_MS)
    expect(page.locator('[data-summary="world_size"]')).to_have_text("3")

    write_heartbeat(run_dir, heartbeat(1, 3, seq=2, global_step=20, loss=0.125))
    expect(cell(page, 1, "global_step")).to_contain_text("(20)", timeout=WAIT_MS)
    expect(cell(page, 1, "loss")).to_have_text("0.1250")
    expect(cell(page, 0, "global_step")).to_contain_text("(10)")
    assert console_errors == []


def test_a_silent_rank_turns_stalled_then_dead(live_server, page, simulator, console_errors):
    sim = simulator(2, period_s=0.5)
    page.goto(live_server.url + "/")
    expect(cell(page, 1, "health")).to_contain_text("healthy", timeout=WAIT_MS)
    sim.silence(1)
    expect(cell(page, 1, "health")).to_contain_text("stalled", timeout=WAIT_MS)
    # Heartbeats stopped (not only steps): the reason says so.
    expect(cell(page, 1, "reason")).to_contain_text("no heartbeat for over")
    expect(cell(page, 1, "health")).to_contain_text("dead", timeout=WAIT_MS)
    expect(cell(page, 1, "reason")).to_contain_text("no heartbeat for over 4 s")
    expect(cell(page, 0, "health")).to_contain_text("healthy")
    expect(page.locator('#verdict-counts [data-verdict="dead"]')).to_have_text("✕ dead 1")
    assert console_errors == []


def test_charts_render_from_local_assets_only(live_server, page, run_dir, simulator, console_errors):
    foreign = []
    page.on(
        "request",
        lambda req: (
            foreign.append(req.url)
            if urlparse(req.url).hostname not in ("127.0.0.1", None) and not req.url.startswith("data:")
            else None
        ),
    )
    sim = Simulator(run_dir, 3)
    sim.prefill_history(20)
    simulator(3)
    page.goto(live_server.url + "/")
    for chart in ("#chart-step-time", "#chart-loss"):
        # The whole run, from the seeded history on: one series (no attempts.jsonl), smoothed over raw.
        page.wait_for_function(
            "sel => { const el = document.querySelector(sel);"
            " return el && el.data && el.data.some(t => t.meta.kind === 'smoothed'"
            " && t.y.filter(v => v !== null).length >= 10 && t.x[0] === 20); }",
            arg=chart,
            timeout=WAIT_MS,
        )
        expect(page.locator(f"{chart} .main-svg").first).to_be_visible()
    expect(page.locator("#heatmap-section")).to_be_hidden()
    assert foreign == []
    assert console_errors == []


def test_the_whole_run_is_charted_and_thinned_ranges_are_said(live_server, page, run_dir, console_errors):
    """3 h 20 min of history lines, one every 10 s: the last hour whole, older ones one a minute."""
    write_job(run_dir, 2)
    now = time.time()
    for r in range(2):
        lines = [
            json.dumps(
                {
                    "time": now - 10 * (1200 - i),
                    "global_step": i + 1,
                    "loss": round(2.3 / (1 + i / 100), 6),
                    "step_time_ms": 50.0 + r,
                    "step_time_mean_ms": 50.0 + r,
                }
            )
            for i in range(1200)
        ]
        runfiles.history_path(run_dir, r).write_text("\n".join(lines) + "\n")
        write_heartbeat(run_dir, heartbeat(r, 2, seq=1, global_step=1201), history=False)
    page.goto(live_server.url + "/")
    note = page.locator("#chart-thinned")
    expect(note).to_contain_text("one point a minute", timeout=WAIT_MS)
    expect(note).to_contain_text("Thinned to stay bounded: before ")
    # From the first minute on, with fewer points than lines: 360 of the last hour, 1 a minute before.
    page.wait_for_function(
        "() => { const el = document.querySelector('#chart-loss');"
        " const t = el.data && el.data.find(t => t.meta.kind === 'smoothed');"
        " return t && t.x[0] <= 6 && t.x.includes(1200) && t.x.length < 600; }",
        timeout=WAIT_MS,
    )
    assert console_errors == []


# The demo's start: the compile step's 900 ms, then 50 ms steps; the loss falls from 2.31.
EARLY = [
    (1, 2.31, 900.0),
    (2, 2.30, 50.0),
    (3, 2.29, 51.0),
    (4, 2.27, 50.0),
    (5, 2.26, 52.0),
    (6, 2.24, 50.0),
]
RANGE = """async ([values, suspects, log]) => {
  const m = await import('/static/js/runcharts.js');
  return m.robustRange(values, log, suspects); }"""


def test_the_y_range_keeps_the_first_losses_and_drops_a_compile_step_only_once_it_is_one(
    live_server, page, run_dir, console_errors
):
    write_job(run_dir, 1)
    now = time.time()
    lines = [
        json.dumps(
            {
                "time": now - 10 + g,
                "global_step": g,
                "loss": loss,
                "step_time_ms": ms,
                "step_time_mean_ms": ms,
            }
        )
        for g, loss, ms in EARLY
    ]
    runfiles.history_path(run_dir, 0).write_text("\n".join(lines) + "\n")
    write_heartbeat(run_dir, heartbeat(0, 1, seq=1, global_step=6, loss=2.24), history=False)
    page.goto(live_server.url + "/")
    # Six points are too few to call one an outlier: the loss's start is inside the range.
    top = page.wait_for_function(
        "() => { const el = document.querySelector('#chart-loss');"
        " const t = el.data && el.data.find(t => t.meta.kind === 'raw');"
        " return t && t.x.length >= 6 && el.layout.yaxis.range && el.layout.yaxis.range[1]; }",
        timeout=WAIT_MS,
    ).json_value()
    assert top >= 2.31

    # Once there are enough points (the range function the charts use, in the page): the
    # compile step is left out, the first losses are kept, on either axis.
    steps = [50.0 + (i % 3) for i in range(40)]
    lo, hi = page.evaluate(RANGE, [steps, [900.0, 50.0], False])
    assert hi < 60.0 and lo <= 50.0
    # A slow fall: the range's padding alone would not reach 2.31.
    losses = [2.29 - 0.001 * i for i in range(40)]
    for log in (False, True):
        lo, hi = page.evaluate(RANGE, [losses, [2.31, 2.30], log])
        assert hi >= (math.log10(2.31) if log else 2.31) and lo <= (
            math.log10(losses[-1]) if log else losses[-1]
        )
    lo, hi = page.evaluate(RANGE, [steps, [900.0, 50.0], True])
    assert hi < math.log10(60.0)
    assert console_errors == []


@pytest.mark.parametrize("live_env", [{"PAGE_SIZE": 10}], indirect=True)
def test_large_job_pages_sorts_filters_and_maps_heat(live_server, page, simulator, console_errors):
    simulator(20, period_s=0.5, slow={7: 3.0})
    page.goto(live_server.url + "/")
    expect(page.locator("#page-info")).to_have_text("1–10 of 20", timeout=WAIT_MS)
    expect(page.locator("#rank-table tbody tr")).to_have_count(10)
    expect(cell(page, 7, "health")).to_contain_text("straggler", timeout=WAIT_MS)
    expect(cell(page, 7, "reason")).to_contain_text("the other ranks' median")

    page.locator('th[data-col="score"] button').click()
    expect(page.locator('th[data-col="score"]')).to_have_attribute("aria-sort", "ascending")
    expect(page.locator("#rank-table tbody tr").first).to_have_attribute("data-rank", "7")

    page.locator("#verdict-filter").select_option("straggler")
    expect(page.locator("#rank-table tbody tr")).to_have_count(1)
    expect(page.locator("#pager")).to_be_hidden()

    expect(page.locator("#heatmap-section")).to_be_visible(timeout=WAIT_MS)
    page.wait_for_function(
        "() => { const el = document.querySelector('#chart-heatmap');"
        " return el.data && el.data[0].type === 'heatmap' && el.data[0].z.length === 20; }",
        timeout=WAIT_MS,
    )
    assert console_errors == []


def test_missing_then_empty_then_partial_run_is_explained(
    run_dir, tmp_path, page, live_env, console_errors, start_server
):
    run = run_dir / "job"
    server = start_server(run, tmp_path / "dashboard.log", env=live_env)
    page.goto(server.url + "/")
    message = page.locator("#run-message")
    expect(message).to_contain_text("does not exist", timeout=WAIT_MS)
    expect(page.locator("#table-empty")).to_be_visible()

    run.mkdir()
    expect(message).to_contain_text("The job has not started", timeout=WAIT_MS)

    write_job(run, 4)
    for r in range(2):
        write_heartbeat(run, heartbeat(r, 4))
    expect(message).to_contain_text("2 of 4 ranks have reported; waiting for ranks 2, 3", timeout=WAIT_MS)
    expect(page.locator("#rank-table tbody tr")).to_have_count(4)
    expect(cell(page, 3, "health")).to_contain_text("pending")
    expect(page.locator('[data-summary="world_size"]')).to_have_text("4 (2 reported)")
    assert console_errors == []
