"""A NaN breakpoint save is refused as a target, and the browser says why (issue 34).

MindSpore's ``exception_save`` writes ``*_breakpoint.ckpt`` with the weights
a NaN step left: often the newest complete set on disk. The run directory
holds a healthy periodic set at step 10 and that breakpoint set at step 20;
the supervisor's own decision (``rollback.decide``, as ``rankwatch launch``
makes it) rolls a spike at step 25 back to step 10. The real dashboard then
shows, in Chromium: the rollback line naming the breakpoint it passed over,
and on the checkpoint page the breakpoint set marked unhealthy with why,
with the ★ and the headline on step 10, not on the newer, unhealthy set.
"""

from __future__ import annotations

import time

import pytest
from playwright.sync_api import expect

from app.supervise import rollback
from tests.helpers.browser import WAIT_MS
from tests.helpers.checkpoints import nan_set, periodic, sid
from tests.helpers.heartbeats import write_job
from trainer_bridge.rundir import ckptindex, rollbacks

pytestmark = pytest.mark.browser


def test_the_breakpoint_set_is_passed_over_and_the_pages_say_why(run_dir, live_server, page, console_errors):
    write_job(run_dir, 2)
    periodic(run_dir, 10)
    nan_set(run_dir, 20, name="net-1_{s}_breakpoint.ckpt")
    ev = rollbacks.Evidence(rule="nonfinite", rank=1, step=28, value="nan", ranks=2)
    req = rollbacks.Request(
        rule="nonfinite", evidence=ev, first_step=25, skip_batches=20, rung=1, asked_at=time.time()
    )
    rollbacks.write_request(run_dir, req)
    d = rollback.decide(str(run_dir), 2, req, rollback.Settings(), lambda text: None)
    assert d.code is None and d.resume == {"set": sid(10), "global_step": 10}
    rollbacks.append(run_dir, d.line.model_copy(update={"attempt": 2}))  # as the supervisor records it

    page.goto(live_server.url + "/")
    line = page.locator("#rollbacks-list li[data-kind='relaunched']")
    expect(line).to_contain_text("to the set at step 10", timeout=WAIT_MS)
    expect(line).to_contain_text("unhealthy: saved by MindSpore's exception_save after a step raised")

    page.goto(live_server.url + "/checkpoints")
    ids = {s.global_step: s.id for s in ckptindex.scan(run_dir, 2).sets}
    bad = page.locator(f"tr.set-row[data-set-id='{ids[20]}']")
    badge = bad.locator(".ckpt-unhealthy")
    expect(badge).to_have_text("⚠ unhealthy: never resumed from", timeout=WAIT_MS)
    assert "exception_save" in badge.get_attribute("title")
    expect(page.locator(f"tr.set-row[data-set-id='{ids[10]}']")).to_have_attribute("data-star", "true")
    expect(bad).to_have_attribute("data-star", "false")
    expect(page.locator("#ckpt-headline")).to_contain_text("global step 10")
    assert console_errors == []
