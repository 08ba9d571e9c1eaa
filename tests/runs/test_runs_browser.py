"""Issue 33, section 4, in Chromium: the runs table says what the run's console says.

A stop every rank obeyed read "rearmed" (the flag's state after the automatic
re-arm, not the stop's), and the loss column showed only a sparkline.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from playwright.sync_api import expect

from tests.helpers.app import TOKEN, operator
from tests.helpers.browser import WAIT_MS
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job

pytestmark = pytest.mark.browser


def exited(run, rank: int, rid: str) -> None:
    now = time.time()
    write_heartbeat(
        run,
        heartbeat(
            rank,
            2,
            seq=9,
            global_step=40,
            state="exited",
            loss=0.5,
            stop={
                "request_id": rid,
                "source": "flag",
                "stage": "exited",
                "seen_step": 39,
                "stop_step": 40,
                "at": {"seen": now, "agreed": now, "saving": now, "saved": now, "exited": now},
                "checkpoint": {
                    "path": f"checkpoints/rank_{rank}/rankwatch-1_40.ckpt",
                    "bytes": 10,
                    "seconds": 0.1,
                },
            },
        ),
    )


def test_a_completed_stop_reads_completed_and_the_loss_is_a_number(
    start_server, tmp_path, page, console_errors
):
    root = tmp_path / "root"
    run = root / "a"
    write_job(run, 2)
    for seq in (1, 2, 3):
        for r in range(2):
            write_heartbeat(run, heartbeat(r, 2, seq=seq, global_step=seq * 10, loss=2.0 / seq))
    env = {"RANKWATCH_TOKEN": TOKEN, "RANKWATCH_STALL_MIN_S": "600", "RANKWATCH_DEAD_AFTER_S": "900"}
    server = start_server(root, tmp_path / "dashboard.log", env=env, runs_root=True)
    request = urllib.request.Request(
        server.url + "/api/runs/a/exit",
        data=json.dumps({"reason": "t", "who": "alice"}).encode(),
        headers={**operator(), "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        rid = json.load(r)["request_id"]
    for r in range(2):
        exited(run, r, rid)
    # The run's console follows the stop to its end, and the dashboard clears the flag after it.
    page.goto(server.url + "/runs/a/")
    expect(page.locator("#stop-headline")).to_contain_text(
        "Last stop: all 2 ranks stopped after step 40", timeout=WAIT_MS
    )

    page.goto(server.url + "/")
    row = page.locator('#runs-table tbody tr[data-run="a"]')
    expect(row.locator('td[data-col="stop"]')).to_contain_text("completed, by alice at ", timeout=WAIT_MS)
    expect(row.locator('td[data-col="loss"] .run-loss-value')).to_have_text("0.5000")
    expect(row.locator('td[data-col="loss"] svg.spark')).to_be_visible()
    assert console_errors == []
