"""The windowed ranks page in Chromium: 500 simulated ranks above a threshold of 64.

The page holds only the server's window; paging, the verdict filter and the
worst-first order ask the server; a verdict change inside the window arrives,
one outside it sends no row. The Socket.IO frames the page receives are
counted (Playwright's ``framereceived``). Events only, no timings.
"""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import expect

from tests.helpers.browser import WAIT_MS, cell, row

pytestmark = pytest.mark.browser

RANKS = 500
# Stall and death later than FAST_SETTINGS: one writer thread of 500 ranks may lag on a loaded machine.
WINDOWED = {"PAGE_WINDOW_RANKS": 64, "STALL_MIN_S": 5.0, "DEAD_AFTER_S": 10.0}


def rank_events(frames: list[str]) -> list[tuple[str, dict]]:
    """The ``ranks_snapshot`` and ``ranks_delta`` events among Socket.IO text frames (``42["name", {...}]``)."""
    out = []
    for frame in frames:
        if isinstance(frame, str) and frame.startswith("42"):
            name, *args = json.loads(frame[2:])
            if name in ("ranks_snapshot", "ranks_delta"):
                out.append((name, args[0]))
    return out


def rows_of(payload: dict) -> list[dict]:
    return payload.get("ranks", payload.get("rows", []))


@pytest.mark.parametrize("live_env", [WINDOWED], indirect=True)
def test_a_large_job_is_windowed_by_the_server(live_server, page, simulator, console_errors):
    frames: list[str] = []
    page.on("websocket", lambda ws: ws.on("framereceived", lambda payload: frames.append(payload)))
    sim = simulator(RANKS)
    page.goto(live_server.url + "/")
    info = page.locator("#page-info")
    expect(info).to_have_text(
        "showing ranks 1–100 of 500; sorted and filtered by the server", timeout=WAIT_MS
    )
    expect(page.locator("#rank-table tbody tr")).to_have_count(100)
    expect(cell(page, 0, "health")).to_contain_text("healthy", timeout=WAIT_MS)
    expect(page.locator('[data-summary="world_size"]')).to_have_text("500")

    # The next page is the server's.
    page.click("#page-next")
    expect(info).to_have_text(
        "showing ranks 101–200 of 500; sorted and filtered by the server", timeout=WAIT_MS
    )
    expect(cell(page, 150, "health")).to_contain_text("healthy", timeout=WAIT_MS)
    expect(row(page, 0)).to_have_count(0)

    # Rank 400 (outside the window) and rank 120 (inside) go silent together.
    sim.silence(400)
    sim.silence(120)
    expect(cell(page, 120, "health")).to_contain_text("dead", timeout=WAIT_MS * 2)
    # The summary counts the job: both are dead, though only rank 120's row came.
    expect(page.locator('#verdict-counts [data-verdict="dead"]')).to_have_text("✕ dead 2", timeout=WAIT_MS)
    events = rank_events(frames)
    assert events and events[0][0] == "ranks_snapshot"
    sent = [r["rank"] for _, payload in events for r in rows_of(payload)]
    assert 120 in sent and 400 not in sent
    # No event carries more than the window, and none is near a whole snapshot of the job.
    assert max(len(rows_of(payload)) for _, payload in events) <= 100
    assert max(len(f) for f in frames if isinstance(f, str)) < 120_000

    # The filter is the server's: the two dead ranks, wherever they are.
    page.select_option("#verdict-filter", "dead")
    expect(info).to_have_text(
        "showing dead ranks 1–2 of 2; sorted and filtered by the server", timeout=WAIT_MS
    )
    expect(page.locator("#rank-table tbody tr")).to_have_count(2)
    expect(row(page, 400)).to_have_count(1)

    # Worst first across the job: the dead ranks lead, by rank.
    page.select_option("#verdict-filter", "")
    page.click('#rank-table thead th[data-col="health"] button')
    expect(info).to_contain_text("worst first", timeout=WAIT_MS)
    expect(page.locator("#rank-table tbody tr").nth(0)).to_have_attribute("data-rank", "120", timeout=WAIT_MS)
    expect(page.locator("#rank-table tbody tr").nth(1)).to_have_attribute("data-rank", "400")
    assert console_errors == []
