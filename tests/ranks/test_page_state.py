"""The run page at a glance (issue 21, "The page"): its state, its first seconds, ended
ranks, empty states, contrast and words.

A real ``python -m app`` and Chromium; heartbeats in the bridge's format, written by the
test (``tests/helpers/heartbeats.py``) or by the scale simulator, and msrun-format worker logs.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from playwright.sync_api import expect

from app.audit import AuditLog
from tests.helpers.app import AUTH, TOKEN
from tests.helpers.browser import WAIT_MS, cell, serious
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.helpers.incidents import COLLECTIVE, WAITING, fake_capture
from tests.helpers.liveserver import sign_in

pytestmark = pytest.mark.browser


@pytest.fixture
def keep_writing(run_dir):
    """Rewrites heartbeats from ``make(seq)`` every 0.3 s until the test ends, as live ranks do."""
    stop = threading.Event()
    threads = []

    def start(make):
        def loop():
            seq = 1
            while not stop.is_set():
                for hb in make(seq):
                    write_heartbeat(run_dir, hb)
                seq += 1
                stop.wait(0.3)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        threads.append(t)

    yield start
    stop.set()
    for t in threads:
        t.join()


def test_a_healthy_job_says_so_in_one_line_and_names_no_slowest_rank(
    live_server, page, simulator, console_errors
):
    simulator(2, period_s=0.3)
    page.goto(live_server.url + "/")
    pill = page.locator("#state-pill")
    expect(pill).to_have_attribute("data-state", "healthy", timeout=WAIT_MS)
    expect(pill).to_have_text(
        re.compile(r"^✓ All 2 ranks healthy · step [\d,]+ · loss [\d.]+ · [\d,]+ samples/s$"), timeout=WAIT_MS
    )
    # The columns a newcomer reads first, in words (issue 33, section 6: "Score", "1 / 54 (54)").
    speed = page.locator('#rank-table thead th[data-col="score"] button')
    expect(speed).to_have_text("Speed vs peers")
    expect(speed).to_have_attribute(
        "title", re.compile(r"^Relative performance: the other ranks' median / its own")
    )
    expect(page.locator('#rank-table thead th[data-col="global_step"] button')).to_have_text(
        "Epoch / step (global)"
    )
    # Jitter between two healthy ranks is no finding.
    expect(page.locator('[data-summary="slowest"]')).to_have_text(
        re.compile(r"^none: every rank within 1\.5x of the other ranks' median step"), timeout=WAIT_MS
    )
    # The idle stop panel does not stand between the state and the table.
    panel = page.locator("#stop-panel").bounding_box()
    table = page.locator("#rank-table").bounding_box()
    assert panel["y"] > table["y"], (panel, table)
    expect(page.locator("#stop-headline")).to_have_text(
        "No stop requested. The job trains until it ends or you press Stop gracefully."
    )
    # No stack capture yet on a healthy job: the grouped view says how to get one.
    page.locator("#stacks-load").click()
    expect(page.locator("#stacks-text")).to_contain_text('Press "Capture every rank now"', timeout=WAIT_MS)
    assert console_errors == []


def test_a_straggler_turns_the_state_red_with_the_count_and_is_named(
    live_server, page, simulator, console_errors
):
    simulator(4, period_s=0.3, slow={2: 3.0})
    page.goto(live_server.url + "/")
    pill = page.locator("#state-pill")
    expect(pill).to_have_attribute("data-state", "bad", timeout=WAIT_MS)
    expect(pill).to_contain_text("1 of 4 ranks unhealthy: 1 straggler")
    expect(page.locator('[data-summary="slowest"]')).to_contain_text("rank 2:", timeout=WAIT_MS)
    assert console_errors == []


def test_the_first_seconds_of_a_bridge_job_are_starting_not_a_warning(
    live_server, page, run_dir, keep_writing, console_errors
):
    """Before its first step a bridge job is "starting": no log-mode warnings, no empty axes."""
    logs = run_dir / "msrun_logs"
    logs.mkdir()
    for r in (0, 1):
        (logs / f"worker_{r}.log").write_text("[WARNING] ME: compiling the graph\n")
    # job.json names a rank 0 that runs (this process): the bridge is attached.
    write_job(run_dir, 2)
    page.goto(live_server.url + "/")
    expect(page.locator("#rank-table tbody tr")).to_have_count(2, timeout=WAIT_MS)
    expect(cell(page, 0, "health")).to_contain_text("starting", timeout=WAIT_MS)
    expect(page.locator("#state-pill")).to_have_text(
        "○ Starting: 2 of 2 ranks up, compiling", timeout=WAIT_MS
    )
    expect(page.locator("#state-pill")).to_have_attribute("data-state", "starting")
    expect(page.locator("#run-message")).not_to_contain_text("no rank writes Rankwatch heartbeats")
    expect(page.locator("#run-message")).to_contain_text("until the bridge's first heartbeats")
    page.wait_for_function("window.rankwatch && window.rankwatch.stop.status !== null", timeout=WAIT_MS)
    expect(page.locator("#stop-note")).to_be_hidden()
    # No data, no axis: a sentence instead of Plotly's January-to-November 2000.
    expect(page.locator("#chart-step-empty")).to_be_visible()
    expect(page.locator("#chart-step-time .main-svg")).to_have_count(0)

    # The bridge's heartbeats arrive, still before the first step.
    keep_writing(
        lambda seq: [
            heartbeat(
                r,
                2,
                seq=seq,
                state="starting",
                global_step=0,
                step_times_ms=[],
                step_time_ms=None,
                step_time_mean_ms=None,
                samples_per_s=None,
                last_step_at=None,
            )
            for r in (0, 1)
        ]
    )
    expect(cell(page, 1, "reason")).to_have_text(
        "up, waiting for the first step (compiling)", timeout=WAIT_MS
    )
    expect(page.locator("#state-pill")).to_have_text("○ Starting: 2 of 2 ranks up, compiling")
    expect(page.locator("#verdict-counts [data-verdict='starting']")).to_have_text("○ starting 2")
    assert console_errors == []


def test_ended_ranks_show_no_live_figures(live_server, page, run_dir, keep_writing, console_errors):
    write_job(run_dir, 2)
    now = {"state": "training"}
    keep_writing(
        lambda seq: [
            heartbeat(r, 2, seq=seq, global_step=40, cpu_percent=97.0, state=now["state"]) for r in range(2)
        ]
    )
    page.goto(live_server.url + "/")
    expect(cell(page, 0, "cpu_percent")).to_have_text("97", timeout=WAIT_MS)
    now["state"] = "exited"
    expect(cell(page, 0, "health")).to_contain_text("exited", timeout=WAIT_MS)
    for col in ("samples_per_s", "step_time_mean_ms", "cpu_percent"):
        expect(cell(page, 0, col)).to_have_text("–")
    expect(cell(page, 0, "cpu_percent")).to_have_attribute("title", "last: 97, before the rank ended")
    expect(page.locator("#state-pill")).to_have_text("■ Stopped · step 40 · loss 2.13", timeout=WAIT_MS)
    expect(page.locator("#state-pill")).to_have_attribute("data-state", "ended")
    assert console_errors == []


def test_no_job_shows_no_figures_and_says_nothing_twice(
    run_dir, tmp_path, page, live_env, console_errors, start_server
):
    run = run_dir / "not-yet"
    server = start_server(run, tmp_path / "dashboard.log", env=live_env)
    page.goto(server.url + "/")
    expect(page.locator("#run-message")).to_contain_text("does not exist", timeout=WAIT_MS)
    expect(page.locator("#state-pill")).to_have_text("No job yet")
    expect(page.locator('[data-summary="world_size"]')).to_have_text("–")
    page.wait_for_function("window.rankwatch && window.rankwatch.stop.status !== null", timeout=WAIT_MS)
    expect(page.locator("#stop-headline")).to_have_text("No stop requested.")
    assert page.locator("main").inner_text().count("does not exist") == 1
    expect(page.locator("#chart-loss-empty")).to_be_visible()
    expect(page.locator("#chart-loss .main-svg")).to_have_count(0)
    assert console_errors == []


@pytest.mark.parametrize("live_env", [{"TOKEN": TOKEN}], indirect=True)
def test_contrast_words_and_a_stop_button_that_says_why_it_is_off(live_server, page, run_dir, keep_writing):
    write_job(run_dir, 2)
    keep_writing(lambda seq: [heartbeat(r, 2, seq=seq) for r in range(2)])
    # A stop from the shell, as `rankwatch stop` records it: no token, a user.
    AuditLog(run_dir / "rankwatch" / "audit.sqlite3").record(
        "request", who="alice", remote_addr="shell alice@node-1", reason="from the shell", outcome="accepted"
    )
    page.goto(live_server.url + "/")
    stop = page.locator("#stop-open")
    expect(stop).to_be_disabled()
    expect(stop).to_have_text("Stop gracefully (needs the token)")
    assert stop.evaluate("b => getComputedStyle(b).backgroundColor") == "rgba(0, 0, 0, 0)"
    expect(page.locator("#state-pill")).to_have_attribute("data-state", "healthy", timeout=WAIT_MS)
    audit = page.locator("#audit-table tbody tr").first
    expect(audit).to_contain_text("from the shell (user alice@node-1)", timeout=WAIT_MS)
    assert "authenticated" not in audit.inner_text()
    # One time style, 24-hour, as the charts' axes.
    expect(audit.locator("td").first).to_have_text(re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d$"))
    assert serious(page) == []

    sign_in(page, live_server.url, TOKEN)
    expect(page.locator("#stop-open")).to_be_enabled(timeout=WAIT_MS)
    assert serious(page) == []
    page.goto(live_server.url + "/checkpoints")
    expect(page.locator("#ckpt-connection")).to_have_attribute("data-state", "live", timeout=WAIT_MS)
    expect(page.locator("#ckpt-headline")).not_to_have_text("Looking for checkpoints…", timeout=WAIT_MS)
    assert serious(page) == []


def test_a_stacks_grouping_from_before_the_ranks_ended_is_marked_stale(
    live_server, page, run_dir, console_errors
):
    write_job(run_dir, 2)
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2, seq=1, global_step=40))
        fake_capture(run_dir, r, WAITING, COLLECTIVE)
    page.goto(live_server.url + "/")
    page.locator("#stacks-load").click()
    group = page.locator("#stacks-groups > li summary")
    expect(group).to_contain_text("ranks 0-1 waiting in AllReduce", timeout=WAIT_MS)
    expect(group).not_to_contain_text("stale")
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2, seq=2, global_step=40, state="exited"))
    expect(cell(page, 1, "health")).to_contain_text("exited", timeout=WAIT_MS)
    page.locator("#stacks-load").click()
    expect(group).to_contain_text("stale: these ranks have ended since", timeout=WAIT_MS)
    expect(page.locator("#stacks-groups > li[data-stale]")).to_have_count(1)
    assert console_errors == []


@pytest.mark.parametrize("live_env", [{"TOKEN": TOKEN, "STOP_HOLDING_AFTER_S": 2.0}], indirect=True)
def test_holding_the_others_up_names_a_culprit_only_past_the_threshold_and_never_all(
    live_server, page, run_dir, keep_writing, console_errors
):
    write_job(run_dir, 2)
    seen = {"rid": None, "t": None}

    def beats(seq):
        out = []
        for r in range(2):
            stop = None
            if r == 0 and seen["rid"]:
                at = {"seen": seen["t"]}
                stop = {
                    "request_id": seen["rid"],
                    "source": "flag",
                    "stage": "seen",
                    "seen_step": seq,
                    "at": at,
                }
            out.append(heartbeat(r, 2, seq=seq, state="stopping" if stop else "training", stop=stop))
        return out

    keep_writing(beats)
    sign_in(page, live_server.url, TOKEN)
    expect(page.locator("#stop-open")).to_be_enabled(timeout=WAIT_MS)
    res = page.request.post(
        live_server.url + "/api/exit",
        data={"reason": "holding test"},
        headers=AUTH,
    )
    assert res.ok, res.text()
    rid = res.json()["request_id"]
    # Every rank still at "requested", past the threshold: nobody is behind anybody.
    page.wait_for_function(
        "() => { const s = window.rankwatch.stop.status; return s && s.request && s.ranks.length === 2"
        " && s.ranks.every(r => s.ranks[0].stage === 'requested' && Date.now() / 1000 - r.stage_since > 3); }",
        timeout=WAIT_MS,
    )
    status = page.request.get(live_server.url + "/api/exit").json()
    assert status["holding_up"] == [] and status["state"] == "requested"
    expect(page.locator("#stop-holding")).to_be_hidden()

    seen.update(rid=rid, t=time.time())
    holding = page.locator("#stop-holding")
    expect(holding).to_have_text('Holding the others up: rank 1 (still at "requested").', timeout=WAIT_MS)
    assert console_errors == []
