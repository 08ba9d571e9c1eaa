"""The page at a laptop's size (1366x768), and the Stop button once the job has ended.

Real ``python -m app`` and Chromium; heartbeat files in the bridge's format.
"""

from __future__ import annotations

import re
import sys
import time

import psutil
import pytest
from playwright.sync_api import expect

from tests.helpers.app import TOKEN
from tests.helpers.browser import LAPTOP, horizontal_overflow
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.helpers.liveserver import sign_in

pytestmark = pytest.mark.browser

WAIT_MS = 30_000
NPU = {
    "kind": "npu",
    "index": 3,
    "util_percent": 87.0,
    "mem_used_bytes": 30 * 2**30,
    "mem_total_bytes": 64 * 2**30,
    "temp_c": 61.0,
    "health": "Warning",
}
LONG_ERROR = (
    "RuntimeError: The state of the cluster is error, total nodes num: 8, failed nodes num: 1, "
    "the cluster heartbeat of node 7 timed out after 30 s; check the network between the hosts"
)


@pytest.fixture
def laptop(browser):
    context = browser.new_context(viewport=LAPTOP)
    page = context.new_page()
    yield page
    context.close()


def test_the_rank_table_fits_a_laptop_without_scrolling_sideways(
    live_server, laptop, run_dir, console_errors
):
    world = 8
    write_job(run_dir, world)
    for r in range(world):
        extra = {}
        if r == 5:
            extra = {
                "warnings": ["cannot write to RUN/rankwatch: No space left on device (training continues)"]
            }
        if r == 6:
            extra = {"state": "failed", "error": LONG_ERROR}
        if r == 7:
            # Silent for a minute: dead, its State "last said training", the widest state there is
            # (on a loaded machine the other ranks' single heartbeats may read so too).
            extra = {"now": time.time() - 60}
        write_heartbeat(
            run_dir,
            heartbeat(r, world, global_step=123_456, device=NPU, host="node-a17.cluster.example", **extra),
        )
    laptop.goto(live_server.url + "/")
    expect(laptop.locator("#rank-table tbody tr")).to_have_count(world, timeout=WAIT_MS)
    # Device columns appear once a rank reports a device: the widest table.
    expect(laptop.locator('#rank-table th[data-col="device_temp_c"]')).to_have_count(1, timeout=WAIT_MS)
    assert horizontal_overflow(laptop) == {"table": 0, "page": 0}
    for col in ("cpu_percent", "rss_bytes", "device_health"):
        box = laptop.locator(f'#rank-table tbody tr[data-rank="0"] td[data-col="{col}"]').bounding_box()
        assert box["x"] + box["width"] <= LAPTOP["width"], col

    # The failed rank's long reason is cut, whole on hover, and unfolds on a click.
    reason = laptop.locator('#rank-table tbody tr[data-rank="6"] td[data-col="reason"]')
    expect(reason).to_have_attribute("title", f"failed: {LONG_ERROR}")
    assert reason.evaluate("td => td.scrollWidth > td.clientWidth")
    one_line = reason.bounding_box()["height"]
    reason.click()
    expect(reason).to_have_attribute("data-expanded", "")
    assert reason.bounding_box()["height"] > one_line
    assert reason.evaluate("td => td.scrollWidth <= td.clientWidth")
    assert horizontal_overflow(laptop) == {"table": 0, "page": 0}
    reason.press("Enter")
    expect(reason).not_to_have_attribute("data-expanded", "")
    assert console_errors == []


@pytest.mark.parametrize("live_env", [{"TOKEN": TOKEN}], indirect=True)
def test_the_stop_button_is_disabled_once_the_job_has_ended_and_says_why(
    live_server, page, run_dir, start_process
):
    write_job(run_dir, 2)
    # The ranks' process: it runs while they train, and is gone when they say they finished,
    # so the end is proven, not only claimed (a claim alone leaves Stop usable).
    rank_proc = start_process([sys.executable, "-c", "import time; time.sleep(600)"])
    started = psutil.Process(rank_proc.pid).create_time()
    for r in range(2):
        write_heartbeat(
            run_dir, heartbeat(r, 2, seq=1, global_step=10, pid=rank_proc.pid, started_at=started)
        )
    sign_in(page, live_server.url, TOKEN)
    stop = page.locator("#stop-open")
    expect(page.locator("#operator-state")).to_have_text("operator", timeout=WAIT_MS)
    expect(stop).to_be_enabled(timeout=WAIT_MS)

    rank_proc.kill()
    rank_proc.wait()
    for r in range(2):
        write_heartbeat(
            run_dir,
            heartbeat(r, 2, seq=2, global_step=20, state="finished", pid=rank_proc.pid, started_at=started),
        )
    expect(stop).to_be_disabled(timeout=WAIT_MS)
    expect(stop).to_have_text("Stop gracefully (job ended)")
    expect(stop).to_have_attribute(
        "title", "Nothing to stop: The job has ended: 2 finished. Relaunch the job to train again."
    )

    # A relaunch (the ranks train again) enables it.
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2, seq=3, global_step=21))
    expect(stop).to_be_enabled(timeout=WAIT_MS)
    expect(stop).to_have_text("Stop gracefully")


def test_health_at_a_glance_on_a_laptop_64_ranks(live_server, laptop, simulator, tmp_path, console_errors):
    """The 3-second health test: at 1366x768 the page's state and at least 8 rank rows
    are on screen without scrolling, on a healthy 64-rank job."""
    simulator(64, period_s=0.5)
    laptop.goto(live_server.url + "/")
    pill = laptop.locator("#state-pill")
    expect(pill).to_have_text(re.compile(r"^✓ All 64 ranks healthy · step "), timeout=WAIT_MS)
    expect(laptop.locator("#rank-table tbody tr")).to_have_count(64, timeout=WAIT_MS)
    # The heat map of a large job has drawn (it sits below the table, not above it).
    expect(laptop.locator("#heatmap-section")).to_be_visible(timeout=WAIT_MS)
    assert laptop.evaluate("window.scrollY") == 0
    box = pill.bounding_box()
    assert box["y"] >= 0 and box["y"] + box["height"] <= LAPTOP["height"], box
    bottoms = laptop.evaluate(
        "() => [...document.querySelectorAll('#rank-table tbody tr')].map(tr => tr.getBoundingClientRect().bottom)"
    )
    on_screen = sum(1 for b in bottoms if b <= LAPTOP["height"])
    laptop.screenshot(path=str(tmp_path / "laptop-64.png"))
    assert on_screen >= 8, (on_screen, bottoms[:10])
    assert console_errors == []
