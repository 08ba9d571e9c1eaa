"""Issue 33, section 4, in Chromium: the header and the stop panel never contradict each other.

The header said "Stopped" while the panel still said "Stopping: the ranks
are agreeing", with an active Cancel. Both now read one copy of the stop
status (``store.stop``); every state the page passes through is recorded
and checked, not only the last.
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

# Every change of the header's pill or the panel's headline: [pill, headline, Cancel shown].
RECORD = """() => {
  window.__pairs = [];
  const pill = document.querySelector('#state-pill');
  const head = document.querySelector('#stop-headline');
  const note = () => window.__pairs.push([pill.textContent, head.textContent,
    !document.querySelector('#stop-cancel').hidden]);
  const watch = new MutationObserver(note);
  for (const el of [pill, head]) watch.observe(el, {childList: true, characterData: true, subtree: true});
  note();
}"""


def stop_hb(run_dir, rank: int, rid: str, stage: str) -> None:
    write_heartbeat(
        run_dir,
        heartbeat(
            rank,
            2,
            seq=3 if stage == "exited" else 2,
            global_step=5,
            state="exited" if stage == "exited" else "stopping",
            stop={
                "request_id": rid,
                "source": "flag",
                "stage": stage,
                "seen_step": 4,
                "stop_step": 5 if stage == "exited" else None,
                "at": {"seen": time.time(), **({"exited": time.time()} if stage == "exited" else {})},
                "checkpoint": {
                    "path": f"checkpoints/rank_{rank}/rankwatch-1_5.ckpt",
                    "bytes": 10,
                    "seconds": 0.1,
                }
                if stage == "exited"
                else None,
            },
        ),
    )


@pytest.mark.parametrize("live_env", [{"TOKEN": TOKEN}], indirect=True)
def test_the_header_never_says_stopped_while_the_panel_says_stopping(
    live_server, page, run_dir, console_errors
):
    write_job(run_dir, 2)
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2, seq=1, global_step=4))
    request = urllib.request.Request(
        live_server.url + "/api/exit",
        data=json.dumps({"reason": "test"}).encode(),
        headers={**operator(), "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        rid = json.load(r)["request_id"]
    for r in range(2):
        stop_hb(run_dir, r, rid, "seen")
    page.goto(live_server.url + "/")
    head = page.locator("#stop-headline")
    expect(head).to_have_text("Stopping: the ranks are agreeing on the step to stop after.", timeout=WAIT_MS)
    page.evaluate(RECORD)

    for r in range(2):
        stop_hb(run_dir, r, rid, "exited")
    # Completed, then (the dashboard re-arms the flag after a completed stop) the last stop.
    expect(head).to_contain_text("all 2 ranks stopped after step 5", timeout=WAIT_MS)
    expect(page.locator("#state-pill")).to_contain_text("Stopped", timeout=WAIT_MS)
    pairs = page.evaluate("window.__pairs")
    done = ("Stopped: ", "Last stop: ")
    wrong = [p for p in pairs if "Stopped" in p[0] and (not p[1].startswith(done) or p[2])]
    assert wrong == [], pairs
    assert console_errors == []
