"""Issue 18: the retention plan on the checkpoint page, in headless Chromium against a real
``python -m app`` process: the column, the policy and disk line, and one Apply button."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from tests.helpers.app import TOKEN
from tests.helpers.checkpoints import periodic, sid
from tests.helpers.heartbeats import write_job

pytestmark = pytest.mark.browser

WAIT_MS = 60_000
LIVE = {"CHECKPOINT_SCAN_S": 0.3, "TOKEN": TOKEN}


@pytest.mark.parametrize("live_env", [LIVE], indirect=True)
def test_the_plan_shows_as_a_column_and_apply_deletes_it(live_server, page, run_dir, console_errors):
    write_job(run_dir, 2)
    for step in (10, 20, 30, 40):
        periodic(run_dir, step)
    page.goto(live_server.url + "/checkpoints")
    row = lambda step: page.locator(f'#ckpt-table tr.set-row[data-set-id="{sid(step)}"]')  # noqa: E731
    cell = lambda step: row(step).locator('td[data-col="retention"]')  # noqa: E731
    expect(cell(40)).to_contain_text("kept: newest complete healthy", timeout=WAIT_MS)
    expect(cell(30)).to_contain_text("kept: newest 3 complete")
    expect(cell(10)).to_contain_text("will free")
    expect(page.locator('#ckpt-table thead th[data-col="retention"]')).to_have_text("Retention")
    expect(page.locator("#ckpt-retention-policy")).to_contain_text("Retention off: keep the newest 3")
    expect(page.locator("#ckpt-retention-policy")).to_contain_text(
        "Nothing is deleted by itself; Apply deletes the plan's sets once."
    )
    expect(page.locator("#ckpt-retention-disk")).to_contain_text("free on their filesystem")
    button = page.locator("#ckpt-retention-apply")
    expect(button).to_contain_text("Apply retention once: delete 1")
    page.evaluate(f"sessionStorage.setItem('rankwatch.token', {TOKEN!r})")
    # Pin set 10, then unpin it: the column and the button follow.
    cell(10).locator("button", has_text="Pin").click()
    expect(cell(10)).to_contain_text("kept: pinned", timeout=WAIT_MS)
    expect(button).to_be_hidden()
    cell(10).locator("button", has_text="Unpin").click()
    expect(cell(10)).to_contain_text("will free", timeout=WAIT_MS)
    # The page's own dialog, as stop and delete use (issue 33): a native confirm() would fail the test.
    native = []
    page.on("dialog", lambda d: (native.append(d.message), d.dismiss()))
    button.click()
    dialog = page.locator("#retention-dialog")
    expect(dialog).to_be_visible()
    expect(dialog.locator("#retention-summary")).to_contain_text("Delete 1 set or leftovers, freeing ")
    # While retention is off, the dialog says what Apply does then.
    expect(dialog.locator("#retention-mode-note")).to_contain_text(
        "Retention is off: nothing is deleted by itself. Apply deletes what the plan marks, once, now"
    )
    expect(dialog.locator("#retention-sets li")).to_have_count(1)
    # The set by its step, in words; its id only in the tooltip (issue 33, section 6).
    going = dialog.locator("#retention-sets li")
    expect(going).to_have_text(re.compile(r"^global step 10: "))
    expect(going).to_have_attribute("title", sid(10))
    dialog.locator("#retention-cancel").click()
    expect(dialog).to_be_hidden()
    assert (run_dir / "ckpt/rank_0/net-1_10.ckpt").exists()
    button.click()
    dialog.locator("#retention-confirm").click()
    expect(page.locator("#ckpt-flash")).to_contain_text("Retention deleted 1", timeout=WAIT_MS)
    expect(dialog).to_be_hidden()
    assert native == []
    expect(row(10)).to_have_count(0, timeout=WAIT_MS)
    expect(button).to_be_hidden(timeout=WAIT_MS)
    assert not (run_dir / "ckpt/rank_0/net-1_10.ckpt").exists()
    assert console_errors == []
