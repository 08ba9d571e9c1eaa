"""Issue 33, section 4, in Chromium: one straggler figure everywhere.

The summary tile said 1.21x against a median of 954 ms that included the
straggler itself, while its row said 1.5x against 755 ms, and ``rankwatch
status`` said something else again. All of them now quote the peer median (in words,
"the other ranks' median")
from ``app/run/peers.py``: the row (``/api/ranks``), the tile
(``/api/summary`` and the page) and the CLI.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest
from playwright.sync_api import expect

from tests.helpers.browser import WAIT_MS, cell
from tests.helpers.liveserver import REPO

pytestmark = pytest.mark.browser


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def test_the_row_the_tile_and_rankwatch_status_quote_one_peer_median(
    live_server, page, run_dir, simulator, console_errors
):
    # No jitter: every figure stays put, so the sources can be read one after the other.
    # 50, 60 and 150 ms: the median of all is 60 ms, rank 2's peer median (50 and 60) 55 ms.
    simulator(3, period_s=0.3, step_ms=50.0, slow={1: 1.2, 2: 3.0}, jitter=0.0)
    page.goto(live_server.url + "/")
    expect(cell(page, 2, "health")).to_contain_text("straggler", timeout=WAIT_MS)
    tile = page.locator('[data-summary="slowest"]')
    expect(tile).to_contain_text("rank 2:", timeout=WAIT_MS)

    row = next(r for r in get(live_server.url + "/api/ranks")["ranks"] if r["rank"] == 2)
    said = re.search(r"is (\S+x) (the other ranks' median \S+ ms)", row["reason"])
    assert said, row["reason"]
    ratio, peer = said[1], said[2]
    assert peer == "the other ranks' median 55 ms" and ratio == "2.7x", row["reason"]

    slowest = get(live_server.url + "/api/summary")["summary"]["slowest"]
    assert slowest["rank"] == 2 and slowest["median_ms"] == 55.0 and slowest["straggler"]
    assert f"over {peer} ({ratio})" in slowest["text"], slowest
    expect(tile).to_have_text(slowest["text"])

    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "status", "--run-dir", str(run_dir)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "as the dashboard at" in out.stdout, out.stdout
    assert f"slowest rank: {slowest['text']}" in out.stdout, out.stdout
    assert console_errors == []
