"""The checkpoint browser in headless Chromium against a real ``python -m app`` process.

Checkpoints are written by real MindSpore while the page is open. Waits are
Playwright's ``expect`` with generous timeouts (the machine is shared);
nothing asserts how fast.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.helpers.app import TOKEN
from tests.helpers.checkpoints import DAMAGED, bridge_id, save_bridge_set, save_small, write_damaged

pytestmark = pytest.mark.browser

WAIT_MS = 60_000
LIVE = {"CHECKPOINT_SCAN_S": 0.3, "TOKEN": TOKEN}


def set_row(page, set_id: str):
    return page.locator(f'#ckpt-table tr.set-row[data-set-id="{set_id}"]')


@pytest.mark.parametrize("live_env", [LIVE], indirect=True)
def test_new_sets_appear_live_and_the_newest_complete_stands_out(live_server, page, run_dir, console_errors):
    ten = save_bridge_set(run_dir, 10)
    write_damaged(run_dir, "damaged", "net-1_2.ckpt", global_step=2)
    page.goto(live_server.url + "/checkpoints")
    expect(page.locator("#ckpt-connection")).to_have_text("live", timeout=WAIT_MS)
    expect(set_row(page, bridge_id(10))).to_have_attribute("data-newest", "true", timeout=WAIT_MS)
    expect(page.locator("#ckpt-headline")).to_contain_text("global step 10")

    damaged = set_row(page, f"{DAMAGED}#g2")
    expect(damaged).to_have_attribute("data-complete", "false")
    expect(damaged.locator('td[data-col="ranks"]')).to_contain_text("missing 1, 2, 3, 4")
    expect(damaged.locator(".ckpt-corrupt")).to_have_text("4 corrupt")
    damaged.locator("button", has_text="Files").click()
    files = page.locator(f'tr[data-detail-for="{DAMAGED}#g2"] tr[data-path]')
    expect(files).to_have_count(5)
    expect(files.filter(has_text="damaged/rank_2/")).to_contain_text("corrupt: empty file")
    expect(files.filter(has_text="damaged/rank_4/")).to_contain_text("looks like JSON")

    # A stop saves a newer set while the page is open: it appears without a reload.
    page.evaluate("window.notReloaded = true")
    twenty = save_bridge_set(run_dir, 20, ranks=(0,))
    # A set's files are open: the new set waits, and says so, so that nothing moves under the pointer.
    held = page.locator("#ckpt-held")
    expect(held).to_contain_text("1 new set arrived", timeout=WAIT_MS)
    expect(set_row(page, bridge_id(20))).to_have_count(0)
    page.locator("#ckpt-held-show").click()
    expect(set_row(page, bridge_id(20))).to_have_attribute("data-complete", "false", timeout=WAIT_MS)
    expect(held).to_be_hidden()
    expect(set_row(page, bridge_id(20)).locator('td[data-col="ranks"]')).to_contain_text("missing 1")
    expect(set_row(page, bridge_id(10))).to_have_attribute("data-newest", "true")
    twenty += save_bridge_set(run_dir, 20, ranks=(1,))
    expect(set_row(page, bridge_id(20))).to_have_attribute("data-newest", "true", timeout=WAIT_MS)
    expect(set_row(page, bridge_id(20)).locator(".ckpt-newest")).to_have_text(
        "★ an unchanged relaunch resumes here"
    )
    expect(set_row(page, bridge_id(10))).to_have_attribute("data-newest", "false")
    expect(page.locator("#ckpt-headline")).to_contain_text("global step 20")
    assert page.evaluate("window.notReloaded") is True
    # The open detail row survived the redraw.
    expect(files).to_have_count(5)
    damaged.locator("button", has_text="Files").click()
    # Rank 1's file came as a delta of that file alone: merged into the set's files.
    set_row(page, bridge_id(20)).locator("button", has_text="Files").click()
    expect(page.locator(f'tr[data-detail-for="{bridge_id(20)}"] tr[data-path]')).to_have_count(2)
    set_row(page, bridge_id(20)).locator("button", has_text="Files").click()
    page.mouse.move(0, 0)  # off the list, which would hold new sets back

    # After the first, only what changed is pushed (checkpoints_delta): a set deleted on disk goes,
    # a new one comes; the page applies each delta to the index it holds.
    page.evaluate("""() => {
      const s = window.rankwatchCheckpoints.socket;
      window.seen = { whole: 0, delta: 0 };
      s.on("checkpoints", () => window.seen.whole++);
      s.on("checkpoints_delta", () => window.seen.delta++);
    }""")
    for f in ten:
        f.unlink()
    expect(set_row(page, bridge_id(10))).to_have_count(0, timeout=WAIT_MS)
    save_bridge_set(run_dir, 30)
    expect(set_row(page, bridge_id(30))).to_have_attribute("data-newest", "true", timeout=WAIT_MS)
    seen = page.evaluate("window.seen")
    assert seen["whole"] == 0 and seen["delta"] >= 2, seen

    # A page that missed a delta (it holds another version than the one the next applies to)
    # asks for the whole index and shows it: nothing is pushed to the room for it.
    page.evaluate("window.rankwatchCheckpoints.latest.version -= 1")
    save_bridge_set(run_dir, 40)
    expect(set_row(page, bridge_id(40))).to_have_attribute("data-newest", "true", timeout=WAIT_MS)
    assert page.evaluate("window.seen.whole") == 0

    # A reconnect gets the whole index, with what changed while the page was away.
    page.evaluate("window.rankwatchCheckpoints.socket.disconnect()")
    expect(page.locator("#ckpt-connection")).not_to_have_text("live", timeout=WAIT_MS)
    save_bridge_set(run_dir, 50)
    for f in twenty:
        f.unlink()
    page.evaluate("window.rankwatchCheckpoints.socket.connect()")
    expect(set_row(page, bridge_id(50))).to_have_attribute("data-newest", "true", timeout=WAIT_MS)
    expect(set_row(page, bridge_id(20))).to_have_count(0)
    assert page.evaluate("window.seen.whole") == 1
    assert console_errors == []


@pytest.mark.parametrize("live_env", [LIVE], indirect=True)
def test_resume_verify_and_a_confirmed_delete(live_server, page, run_dir, console_errors):
    for g in (10, 20):
        save_bridge_set(run_dir, g)
    page.goto(live_server.url + "/checkpoints")
    newest = set_row(page, bridge_id(20))
    expect(newest).to_have_attribute("data-newest", "true", timeout=WAIT_MS)

    page.locator("#ckpt-headline-resume").click()
    dialog = page.locator("#resume-dialog")
    expect(dialog).to_be_visible()
    expect(page.locator("#resume-how")).to_contain_text("Relaunch the job unchanged")
    expect(page.locator("#resume-code")).to_contain_text(
        'f"{run}/checkpoints/rank_{rank}/rankwatch-3_4.ckpt"'
    )
    expect(page.locator("#resume-code")).to_contain_text("dataset.set_init_step(4)")
    dialog.locator("button", has_text="Close").click()
    expect(dialog).to_be_hidden()

    # A deep verify needs the operator token, which this tab does not hold yet.
    newest.locator('button[data-action="verify"]').click()
    expect(page.locator("#ckpt-flash")).to_contain_text("needs the operator token")

    older = set_row(page, bridge_id(10))
    older.locator('button[data-action="delete"]').click()
    expect(page.locator("#delete-dialog")).to_be_visible()
    expect(page.locator("#delete-protected")).to_be_hidden()
    expect(page.locator("#delete-token-label")).to_be_visible()  # no token in this tab yet
    submit = page.locator("#delete-submit")
    page.locator("#delete-reason").fill("keep the disk for the newest set")
    page.locator("#delete-token").fill(TOKEN)
    page.locator("#delete-confirm").fill("1")
    expect(submit).to_be_disabled()
    page.locator("#delete-confirm").fill("10")
    expect(submit).to_be_enabled()
    submit.click()
    expect(older).to_have_count(0, timeout=WAIT_MS)
    expect(page.locator("#ckpt-flash")).to_contain_text("Deleted 2 files of global step 10")
    assert not (run_dir / "checkpoints/rank_0/rankwatch-2_2.ckpt").exists()
    assert page.evaluate("sessionStorage.getItem('rankwatch.token')") == TOKEN

    # With the token (kept from the delete dialog) the verify runs.
    newest.locator('button[data-action="verify"]').click()
    expect(newest.locator('td[data-col="verify"]')).to_have_attribute("data-state", "ok", timeout=WAIT_MS * 3)
    expect(newest.locator('td[data-col="verify"]')).to_have_text("✓ all 2 load")

    # The newest complete set asks for "delete it anyway" before the button works.
    newest.locator('button[data-action="delete"]').click()
    expect(page.locator("#delete-protected")).to_be_visible()
    expect(page.locator("#delete-token-label")).to_be_hidden()
    page.locator("#delete-reason").fill("test")
    page.locator("#delete-confirm").fill("20")
    expect(submit).to_be_disabled()
    page.locator("#delete-cancel").click()
    expect(newest).to_have_count(1)
    assert console_errors == []


@pytest.mark.parametrize("live_env", [LIVE], indirect=True)
def test_the_list_holds_still_under_the_pointer_and_says_how_the_next_launch_resumes(
    live_server, page, run_dir, console_errors
):
    # Three launches of one script into one directory: MindSpore names them lenet, lenet_1, lenet_2.
    for prefix in ("lenet", "lenet_1", "lenet_2"):
        for r in (0, 1):
            save_small(
                run_dir / "ckpt" / f"rank_{r}" / f"{prefix}-1_8.ckpt",
                {"epoch_num": 1, "step_num": 8, "batch_num": 8, "global_step": 8},
            )
    page.goto(live_server.url + "/checkpoints")
    latest = set_row(page, "ckpt/rank_{rank}/lenet_2-{E}_{S}.ckpt#g8")
    expect(latest.locator(".ckpt-series")).to_have_text("launch 3 of 3 of the lenet series", timeout=WAIT_MS)
    expect(set_row(page, "ckpt/rank_{rank}/lenet-{E}_{S}.ckpt#g8").locator(".ckpt-series")).to_have_text(
        "launch 1 of 3 of the lenet series"
    )
    # No bridge set: the headline does not promise a resume the next launch will not do, and offers the pin.
    headline = page.locator("#ckpt-headline")
    expect(headline).to_contain_text("Newest complete set: global step 8")
    expect(headline).to_contain_text("An unchanged relaunch does not resume from it")
    expect(headline.locator("code")).to_have_text("RANKWATCH_RESUME_STEP=8")
    expect(headline).not_to_contain_text("Resume from")
    expect(page.locator("#ckpt-meta")).to_contain_text("3 sets, ")

    # The pointer rests on a row's Files button when a newer set arrives (it would go on top).
    files = latest.locator("button", has_text="Files")
    box = files.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    save_bridge_set(run_dir, 10)
    expect(page.locator("#ckpt-held")).to_contain_text("1 new set arrived", timeout=WAIT_MS)
    expect(set_row(page, bridge_id(10))).to_have_count(0)
    assert files.bounding_box() == box  # nothing moved, the note included
    # The click lands on the row that was under the pointer.
    page.mouse.click(x, y)
    expect(page.locator('tr[data-detail-for="ckpt/rank_{rank}/lenet_2-{E}_{S}.ckpt#g8"]')).to_be_visible()
    page.mouse.move(1, 1)
    expect(set_row(page, bridge_id(10))).to_have_count(0)  # its files are open: still held
    files.click()
    page.mouse.move(1, 1)
    expect(set_row(page, bridge_id(10))).to_have_attribute("data-newest", "true", timeout=WAIT_MS)
    expect(headline).to_contain_text("Resume from global step 10")
    expect(headline).to_contain_text("An unchanged relaunch with the bridge resumes from it.")
    assert console_errors == []
