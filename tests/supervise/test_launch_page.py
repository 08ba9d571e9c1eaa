"""The attempts timeline (Chromium) names each supervised attempt's cause and its restart's downtime."""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import expect

from trainer_bridge.rundir import runfiles

pytestmark = pytest.mark.browser

T = 1.7e9


def test_the_timeline_names_the_cause_and_the_downtime(run_dir, live_server, page, console_errors):
    lines = [
        {
            "kind": "start",
            "attempt": 1,
            "launch": "aaa",
            "started_at": T,
            "world_size": 2,
            "hosts": ["a"],
            "first_step": 1,
        },
        {
            "kind": "supervised",
            "attempt": 1,
            "launch": "aaa",
            "supervisor_pid": 100,
            "host": "a",
            "spawned_at": T - 5,
            "cause": {"kind": "crash", "rank": 1, "host": "a", "role": "worker", "signal": "SIGKILL"},
            "fault_at": T + 15,
            "detected_at": T + 15.2,
            "ended_at": T + 20.2,
            "relaunched_at": T + 20.7,
            "restarted_by": "launch",
            "action": "relaunch",
        },
        {
            "kind": "supervised",
            "attempt": 2,
            "supervisor_pid": 100,
            "host": "a",
            "spawned_at": T + 21,
            "world_size": 2,
            "cause": {
                "kind": "crash",
                "rank": 0,
                "role": "worker",
                "exit_code": 1,
                "error": "ModuleNotFoundError: No module named 'x'",
                "before_first_step": True,
            },
            "action": "end",
            "exit_code": 5,
            "note": "the same failure twice in a row before the first step; ending the run",
        },
    ]
    path = runfiles.attempts_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    page.goto(live_server.url)
    first = page.locator("#attempts-list li[data-attempt='1'][data-cause='crash'] .attempt-cause")
    expect(first).to_contain_text("cause: rank 1 on a killed by SIGKILL", timeout=60_000)
    expect(first).to_contain_text("relaunched by rankwatch launch (down 5.7 s: detected 0.2 s, ended 5.0 s")
    second = page.locator("#attempts-list li[data-attempt='2']")
    expect(second).to_contain_text("crashed: ModuleNotFoundError: No module named 'x'")
    expect(second.locator(".attempt-cause")).to_contain_text("exit status 1")
    expect(second.locator(".attempt-cause")).to_contain_text("the same failure twice in a row")
    # Above the timeline: the goodput (no step time in these lines: not known), restarts, downtime,
    # and, since the supervisor gave up (the startup rule, exit 5), that the run needs attention.
    good = page.locator("#attempts-goodput[data-gave-up]")
    expect(good).to_have_text(
        "goodput not known yet · 1 automatic restart · 0 steps lost · 5.7 s down · ⚠ rankwatch launch ended the run "
        "(exit 5): the same failure twice in a row before the first step; ending the run"
    )
    assert console_errors == []


def test_a_rollback_is_named_with_its_evidence_and_the_next_attempt_its_skipped_steps(
    run_dir, live_server, page, console_errors
):
    start = {"kind": "start", "world_size": 2, "hosts": ["a"]}
    lines = [
        {**start, "attempt": 1, "launch": "aaa", "started_at": T, "first_step": 1},
        {
            "kind": "supervised",
            "attempt": 1,
            "launch": "aaa",
            "supervisor_pid": 100,
            "host": "a",
            "spawned_at": T - 5,
            "cause": {
                "kind": "rollback",
                "rule": "nonfinite",
                "evidence": "nonfinite: rank 0 at global step 31: nan",
                "from_step": 31,
                "to_set": "ckpt/rank_{rank}/lenet-{E}_{S}.ckpt#g20",
                "to_step": 20,
                "skip_batches": 5,
                "rung": 1,
            },
            "ended_at": T + 20.2,
            "relaunched_at": T + 20.7,
            "restarted_by": "launch",
            "action": "relaunch",
            "resume": {"set": "ckpt/rank_{rank}/lenet-{E}_{S}.ckpt#g20", "global_step": 20},
        },
        {
            **start,
            "attempt": 2,
            "launch": "bbb",
            "started_at": T + 30,
            "first_step": 36,
            "resumed_from": {"set": "ckpt/rank_{rank}/lenet-{E}_{S}.ckpt#g20", "global_step": 20},
            "skipped": [21, 35],
        },
    ]
    path = runfiles.attempts_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    page.goto(live_server.url)
    first = page.locator("#attempts-list li[data-attempt='1'][data-cause='rollback'] .attempt-cause")
    expect(first).to_contain_text(
        "cause: loss-spike rollback (nonfinite): nonfinite: rank 0 at global step 31: nan; from global step 31 "
        "back to global step 20 (set ckpt/rank_{rank}/lenet-{E}_{S}.ckpt#g20), 5 batches skipped past it",
        timeout=60_000,
    )
    expect(first).to_contain_text("relaunched by rankwatch launch")
    second = page.locator("#attempts-list li[data-attempt='2'] .attempt-skipped")
    expect(second).to_have_text(
        " · skipped the batches of global steps 21–35, untrained (a loss-spike rollback)"
    )
    # Its resume in words; the set's id only in the tooltip (issue 33, section 6).
    head = page.locator("#attempts-list li[data-attempt='2'] > span").first
    expect(head).to_contain_text(" · resumed from global step 20 · ")
    expect(head).not_to_contain_text("#g20")
    expect(head).to_have_attribute(
        "title", "Resumed from the checkpoint set ckpt/rank_{rank}/lenet-{E}_{S}.ckpt#g20"
    )
    assert console_errors == []
