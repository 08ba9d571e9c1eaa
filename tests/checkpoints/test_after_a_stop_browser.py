"""Issue 33, section 5, in Chromium: the checkpoint browser after a stop.

A stop leaves two sets of one step: the script's periodic save and the
bridge's own. The ★ went to the periodic one, its "How to resume" said to pin
it while the headline said an unchanged relaunch resumes from the stop's set,
the copied command failed outside the venv and carried the old
``--master_port``, and Copy said nothing.
"""

from __future__ import annotations

import time

import pytest
from playwright.sync_api import expect

from app.checkpoints.relaunch import relaunch_command
from tests.helpers.app import TOKEN
from tests.helpers.checkpoints import bridge_id, periodic, save_bridge_set, sid
from tests.helpers.heartbeats import write_job
from tests.helpers.liveserver import sign_in

pytestmark = pytest.mark.browser

WAIT_MS = 60_000
LIVE = {"CHECKPOINT_SCAN_S": 0.3, "TOKEN": TOKEN}
VENV_MSRUN = "/home/u/rankwatch/.venv/bin/msrun"
LAUNCHER = [
    "/home/u/rankwatch/.venv/bin/python3",
    VENV_MSRUN,
    "--worker_num=2",
    "--local_worker_num=2",
    "--master_port=40123",
    "--join=True",
    "--log_dir",
    "runs/demo/msrun_logs",
    "/opt/job/train.py",
    "--epochs",
    "3",
]


def row(page, set_id: str):
    return page.locator(f'#ckpt-table tr.set-row[data-set-id="{set_id}"]')


@pytest.mark.parametrize("live_env", [LIVE], indirect=True)
def test_the_star_the_headline_and_how_to_resume_name_one_set(live_server, page, run_dir, console_errors):
    write_job(run_dir, 2, argv=["/opt/job/train.py", "--epochs", "3"], launcher_argv=LAUNCHER)
    save_bridge_set(run_dir, 10)
    save_bridge_set(run_dir, 20)
    # The script's periodic save at the stop step (epoch 3, step 4, as the bridge's), written
    # after it: the newest complete set, which took the ★.
    periodic(run_dir, 20, mtime=time.time(), name=(3, 4))
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    # The relaunch command is the operator's (a viewer without the token gets none: issue 32, P11).
    sign_in(page, live_server.url + "/", TOKEN)
    expect(page.locator("#operator-state")).to_have_text("operator", timeout=WAIT_MS)
    page.goto(live_server.url + "/checkpoints")

    stop_set, twin = row(page, bridge_id(20)), row(page, sid(20))
    expect(twin).to_have_attribute("data-newest", "true", timeout=WAIT_MS)
    expect(stop_set).to_have_attribute("data-star", "true", timeout=WAIT_MS)
    expect(stop_set.locator(".ckpt-newest")).to_have_text("★ an unchanged relaunch resumes here")
    expect(twin).to_have_attribute("data-star", "false")
    expect(page.locator("#ckpt-table .ckpt-newest")).to_have_count(1)
    # One group per step, the ★ set first, each saying it shares its step.
    ids = page.locator("#ckpt-table tr.set-row").evaluate_all("rows => rows.map(r => r.dataset.setId)")
    assert ids.index(sid(20)) == ids.index(bridge_id(20)) + 1, ids
    expect(twin).to_have_class("set-row same-step")
    expect(twin.locator(".ckpt-same-step")).to_contain_text("same step as the ")
    expect(stop_set.locator(".ckpt-same-step")).to_contain_text("same step as the ")

    headline = page.locator("#ckpt-headline")
    expect(headline).to_contain_text("An unchanged relaunch with the bridge resumes from it (★)")
    expect(headline).not_to_contain_text("pin it")

    # The headline's button opens the ★ set, and its answer agrees with the headline.
    page.locator("#ckpt-headline-resume").click()
    dialog = page.locator("#resume-dialog")
    expect(page.locator("#resume-how")).to_contain_text("Relaunch the job unchanged", timeout=WAIT_MS)
    command = page.locator("#resume-command")
    expect(command).to_contain_text(f"{VENV_MSRUN} --worker_num=2 --local_worker_num=2")
    expect(command).not_to_contain_text("--master_port")
    expect(page.locator("#resume-command-notes")).to_contain_text("--master_port is left out")
    copy = dialog.locator('button[data-copy="#resume-command"]')
    copy.click()
    expect(copy).to_have_text("Copied ✓")
    assert page.evaluate("navigator.clipboard.readText()") == command.text_content()
    dialog.locator("form[method=dialog] button").click()

    # The periodic twin's answer: nothing to pin, the relaunch resumes at its step already.
    twin.locator("button", has_text="Resume").click()
    expect(page.locator("#resume-how")).to_contain_text("nothing to pin", timeout=WAIT_MS)
    expect(command).not_to_contain_text("RANKWATCH_RESUME_STEP")
    assert console_errors == []


def test_the_command_without_a_recorded_launcher_says_to_activate_the_environment():
    command, notes = relaunch_command({"argv": ["train.py"], "world_size": 1}, 1, {})
    assert command.startswith("msrun --worker_num=1") and any("activate" in n for n in notes)
    # A launcher path that is no msrun script is not used.
    odd = {**{"argv": ["train.py"], "world_size": 1}, "launcher_argv": ["/tmp/x;rm -rf ~/msrun", "train.py"]}
    command, _ = relaunch_command(odd, 1, {})
    assert command.startswith("msrun ")
