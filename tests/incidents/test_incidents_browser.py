"""The incident views in headless Chromium against a real ``python -m app``.

A rank's Stack action, Capture now (answered by a real ``StackWatcher`` in
this process, which is the ranks' pid in the heartbeats), Copy, the grouped
view, and the policy's armed rules. Waits are Playwright's ``expect`` with
generous timeouts.
"""

from __future__ import annotations

import threading
import time

import pytest
from playwright.sync_api import expect

from tests.helpers.app import TOKEN
from tests.helpers.heartbeats import HOST, heartbeat, write_heartbeat, write_job
from tests.helpers.incidents import COLLECTIVE, HUNG, WAITING, fake_capture
from tests.helpers.liveserver import sign_in
from trainer_bridge import stacks

pytestmark = pytest.mark.browser

WAIT_MS = 30_000


def answer_requests_until(stop: threading.Event, run_dir) -> None:
    """The ranks' reporters: rank 1 polls for stack requests, as the bridge does five times a second,
    and every rank beats once a second, so that no rank is judged stalled or dead however long a
    loaded machine takes to reach the click (a dead rank's capture is refused)."""
    watcher = stacks.StackWatcher(run_dir, 1, HOST)
    seq, beat_at = 1, time.monotonic()
    while not stop.wait(0.1):
        watcher.poll(steps=7, since_step_s=0.1, step_s=0.05, global_step=7, stepping=True)
        if time.monotonic() - beat_at >= 1.0:
            seq, beat_at = seq + 1, time.monotonic()
            for r in range(3):
                write_heartbeat(run_dir, heartbeat(r, 3, seq=seq))


@pytest.mark.parametrize(
    "live_env",
    [{"TOKEN": TOKEN, "POLICY_MODE": "dry_run", "POLICY_RULES": "stalled:60,device_unhealthy:30"}],
    indirect=True,
)
def test_stack_dialog_grouped_view_and_policy(live_server, page, run_dir, console_errors):
    write_job(run_dir, 3)
    for r in range(3):
        write_heartbeat(run_dir, heartbeat(r, 3))
    fake_capture(run_dir, 0, WAITING, COLLECTIVE)
    fake_capture(run_dir, 1, HUNG)
    fake_capture(run_dir, 2, WAITING, COLLECTIVE)
    stop = threading.Event()
    rank1 = threading.Thread(target=answer_requests_until, args=(stop, run_dir), daemon=True)
    rank1.start()
    try:
        sign_in(page, live_server.url, TOKEN)
        stack_button = page.locator('#rank-table tbody tr[data-rank="1"] button[data-stack-rank="1"]')
        expect(stack_button).to_be_visible(timeout=WAIT_MS)
        stack_button.click()
        dialog = page.locator("#stack-dialog")
        expect(dialog).to_be_visible()
        expect(page.locator("#stack-dialog-title")).to_have_text("Stack of rank 1")
        expect(page.locator("#stack-text")).to_contain_text("hang_here (/job/train.py:42)", timeout=WAIT_MS)
        expect(page.locator("#stack-meta")).to_contain_text("automatically")

        page.locator("#stack-capture").click()
        expect(page.locator("#stack-meta")).to_contain_text("on request", timeout=WAIT_MS)
        expect(page.locator("#stack-text")).to_contain_text("answer_requests_until")
        expect(page.locator("#stack-text")).to_contain_text("(training thread)")
        page.locator("#stack-copy").click()
        expect(page.locator("#stack-copy")).not_to_have_text("Copy")
        page.locator("#stack-close").click()
        expect(dialog).to_be_hidden()

        # Rank 1 now shows the fresh capture (this process's threads), so the
        # grouped view finds ranks 0 and 2 together in AllReduce.
        page.locator("#stacks-load").click()
        summary = page.locator("#stacks-text")
        # Names are code, not raw Markdown: no backtick reaches the page.
        expect(summary).to_contain_text("ranks 0, 2 waiting in AllReduce", timeout=WAIT_MS)
        expect(summary.locator("code", has_text="AllReduce").first).to_be_visible()
        assert "`" not in summary.text_content()
        expect(page.locator("#stacks-groups > li")).to_have_count(2)
        expect(page.locator("#stacks-copy")).to_be_visible()

        expect(page.locator("#policy-mode")).to_have_text("dry run")
        rules = page.locator("#policy-rules li")
        expect(rules).to_have_count(2)
        expect(rules.first).to_contain_text("stalled:60")
        # These ranks report no device (CPU): the NPU rule says it cannot fire here (issue 33, section 6).
        expect(rules.nth(1)).to_contain_text("Ascend NPU")
        expect(rules.nth(1)).to_contain_text(
            "no rank here reports an NPU (a CPU job), so this rule cannot fire"
        )
        expect(page.locator("#alerts-note")).to_contain_text("No webhook configured")
    finally:
        stop.set()
        rank1.join()
    assert console_errors == []
