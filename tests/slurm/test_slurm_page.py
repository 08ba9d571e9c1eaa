"""The attempts timeline (Chromium) says an attempt was preempted by Slurm, under which job and restart,
and that the stop would not fit in the KillWait launch recorded."""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import expect

from trainer_bridge.rundir import runfiles

pytestmark = pytest.mark.browser

T = 1.7e9
SLURM = {"kind": "slurm", "job_id": "42", "partition": "gpu", "nodelist": "node[01-02]", "job_name": "lenet"}


def test_the_timeline_shows_a_preemption_and_the_requeued_attempt(run_dir, live_server, page, console_errors):
    lines = [
        {"kind": "start", "attempt": 1, "launch": "aaa", "started_at": T, "world_size": 2, "hosts": ["a"]},
        {
            "kind": "end",
            "attempt": 1,
            "launch": "aaa",
            "ended_at": T + 60,
            "end": "graceful_stop",
            "last_step": 40,
            "request_id": "req-1",
            "requested_by": "slurm-user",
            "source": "flag",
        },
        {
            "kind": "supervised",
            "attempt": 1,
            "launch": "aaa",
            "supervisor_pid": 100,
            "host": "a",
            "spawned_at": T - 5,
            "cause": {"kind": "preempted", "signal": "SIGTERM", "signalled_at": T + 50, "time_left_s": 25.0},
            "ended_at": T + 61,
            "action": "end",
            "exit_code": 0,
            "scheduler": {**SLURM, "restart_count": 0},
        },
        {
            "kind": "start",
            "attempt": 2,
            "launch": "bbb",
            "started_at": T + 200,
            "world_size": 2,
            "hosts": ["a"],
        },
        {
            "kind": "end",
            "attempt": 2,
            "launch": "bbb",
            "ended_at": T + 260,
            "end": "finished",
            "last_step": 90,
        },
        {
            "kind": "supervised",
            "attempt": 2,
            "launch": "bbb",
            "supervisor_pid": 200,
            "host": "a",
            "spawned_at": T + 195,
            "first_step": 41,
            "cause": {"kind": "finished"},
            "action": "end",
            "exit_code": 0,
            "scheduler": {**SLURM, "restart_count": 1, "kill_wait_s": 5},
        },
    ]
    path = runfiles.attempts_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    page.goto(live_server.url)
    first = page.locator("#attempts-list li[data-attempt='1'][data-cause='preempted']")
    expect(first.locator(".attempt-cause")).to_contain_text(
        "preempted by the scheduler (SIGTERM, 25 s left): saved and stopped gracefully", timeout=60_000
    )
    expect(first.locator(".attempt-scheduler")).to_have_text(" · Slurm job 42, partition gpu on node[01-02]")
    second = page.locator("#attempts-list li[data-attempt='2'][data-scheduler='slurm']")
    expect(second.locator(".attempt-scheduler")).to_contain_text("Slurm job 42 (requeued, restart 1)")
    # The preemption's stop took 11 s (signal to the last process gone); launch recorded KillWait 5.
    expect(page.locator("#attempts-note")).to_contain_text(
        "⚠ Slurm job 42: this job needs about 11 s to stop; Slurm gives it 5 (KillWait): a preemption would "
        "kill it before every rank saved"
    )
    assert console_errors == []
