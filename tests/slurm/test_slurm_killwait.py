"""A stop that would not fit in Slurm's KillWait is said before a preemption: API, alert, page (issue 35).

The attempts are written as ``rankwatch launch`` writes them under Slurm
(its scheduler record carries ``kill_wait_s``); the dashboard is the real
app with its real watcher tick, and the webhook receiver a real HTTP server.
The real-Slurm test (``test_slurm_jobs.py``) checks that launch records
KillWait; the page in Chromium is ``test_slurm_page.py``.
"""

from __future__ import annotations

import json

import pytest

from app import attempts
from app.run import slurmstop
from tests.helpers.app import AUTH, make_app
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import runfiles

T = 1.7e9


def supervised(attempt: int, kill_wait: int | None, **more) -> dict:
    sched = {"kind": "slurm", "job_id": "42", "restart_count": attempt - 1}
    if kill_wait is not None:
        sched["kill_wait_s"] = kill_wait
    return {
        "kind": "supervised",
        "attempt": attempt,
        "launch": f"L{attempt}",
        "supervisor_pid": 100 + attempt,
        "host": "a",
        "spawned_at": T + 100 * attempt,
        "action": "end",
        "exit_code": 0,
        "scheduler": sched,
        "cause": {"kind": "finished"},
        **more,
    }


def start_line(n: int) -> dict:
    return {
        "kind": "start",
        "attempt": n,
        "launch": f"L{n}",
        "started_at": T + 100 * n + 5,
        "world_size": 2,
        "hosts": ["a"],
        "first_step": 1,
    }


def write_attempts(run_dir, records) -> list[dict]:
    """attempts.jsonl with each supervised record after its attempt's start line; the rows as folded."""
    lines = []
    for rec in records:
        n = rec["attempt"]
        lines.append(start_line(n))
        lines.append(rec)
    path = runfiles.attempts_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return attempts.rows(run_dir)


def stopped_ranks(run_dir, seen: float, exited: list[float]) -> None:
    """Both ranks' last heartbeats, as a graceful stop leaves them: seen the flag, saved, exited."""
    for rank, at in enumerate(exited):
        hb = heartbeat(rank, 2, state="exited")
        hb["stop"] = {"source": "flag", "stage": "exited", "at": {"seen": seen, "exited": at}}
        write_heartbeat(run_dir, hb, history=False)


@pytest.fixture
def receiver(make_receiver):
    return make_receiver().start()


def test_the_verdict_takes_the_newest_record_and_the_measured_stop_else_the_estimate(run_dir):
    write_job(run_dir, 2)
    assert slurmstop.verdict(str(run_dir), []) is None  # not under Slurm
    # KillWait not recorded by the newest Slurm attempt: an older record is not trusted.
    assert (
        slurmstop.verdict(str(run_dir), write_attempts(run_dir, [supervised(1, 5), supervised(2, None)]))
        is None
    )
    rows = write_attempts(run_dir, [supervised(1, 30)])
    assert slurmstop.verdict(str(run_dir), rows) == {
        "fits": None,
        "needs_s": None,
        "kill_wait_s": 30,
        "job_id": "42",
        "text": "Slurm gives a stop 30 s (KillWait); this job's stop time is not known yet",
    }
    # Before any stop: the dialog's estimate, asked only then.
    assert slurmstop.verdict(str(run_dir), rows, estimate=lambda: 41.6)["fits"] is False
    stopped_ranks(run_dir, T + 10, [T + 14, T + 19.5])  # measured: 9.5 s
    said = slurmstop.verdict(str(run_dir), rows, estimate=lambda: pytest.fail("the estimate was asked"))
    assert (said["fits"], said["needs_s"]) == (True, 9.5)
    # A preemption's record wins: from Slurm's signal to the last process gone.
    preempted = supervised(
        1, 5, cause={"kind": "preempted", "signal": "SIGTERM", "signalled_at": T + 100}, ended_at=T + 112
    )
    said = slurmstop.verdict(str(run_dir), write_attempts(run_dir, [preempted]))
    assert said == {
        "fits": False,
        "needs_s": 12.0,
        "kill_wait_s": 5,
        "job_id": "42",
        "text": "this job needs about 12 s to stop; Slurm gives it 5 (KillWait): a preemption would kill it "
        "before every rank saved",
    }


def test_the_api_and_one_alert_say_it_before_a_preemption(run_dir, receiver):
    write_job(run_dir, 2)
    stopped_ranks(run_dir, T + 10, [T + 14, T + 19.5])  # the last stop took 9.5 s
    write_attempts(run_dir, [supervised(1, 5)])
    app = make_app(run_dir, WEBHOOK_URL=receiver.url)
    watcher = app.extensions["rankwatch"].watcher
    body = app.test_client().get("/api/attempts", headers=AUTH).get_json()
    assert body["slurm_stop"]["fits"] is False and body["slurm_stop"]["needs_s"] == 9.5
    for _ in range(3):
        watcher.tick()
    got = receiver.wait_for(lambda p: [x for x in p if x["event"] == "slurm_kill_wait"], "the KillWait alert")
    assert got[0]["text"].endswith(
        "Slurm job 42: this job needs about 10 s to stop; Slurm gives it 5 (KillWait): a preemption would kill it before every rank saved"
    )
    assert (got[0]["needs_s"], got[0]["kill_wait_s"]) == (9.5, 5)
    # Once per job and KillWait, however many ticks see it: a new attempt of the same job says
    # nothing more; a new KillWait does. The sender delivers in order, so by the time the second
    # alert arrives a repeat of the first would have too.
    write_attempts(run_dir, [supervised(1, 5), supervised(2, 5)])
    for _ in range(3):
        watcher.tick()
    write_attempts(run_dir, [supervised(1, 5), supervised(2, 5), supervised(3, 6)])
    watcher.tick()
    receiver.wait_for(lambda p: [x for x in p if x.get("kill_wait_s") == 6], "the alert for KillWait 6")
    assert [x["kill_wait_s"] for x in receiver.events("slurm_kill_wait")] == [5, 6]
    # A KillWait that fits: the API says so, and no alert.
    write_attempts(run_dir, [supervised(1, 5), supervised(2, 5), supervised(3, 6), supervised(4, 60)])
    assert app.test_client().get("/api/attempts", headers=AUTH).get_json()["slurm_stop"]["fits"] is True


def test_a_running_job_whose_stop_would_not_fit_needs_attention_on_the_runs_page(tmp_path):
    """Attempt 1 was preempted and took 12 s to stop, KillWait is 5; attempt 2 trains: the runs table
    says so while it trains. The same history with the job ended needs nothing."""
    from app import create_app

    root = tmp_path / "root"
    preempted = supervised(
        1, 5, cause={"kind": "preempted", "signal": "SIGTERM", "signalled_at": T + 100}, ended_at=T + 112
    )
    for name, state in (("training", "training"), ("ended", "finished")):
        run = root / name
        write_job(run, 2)
        write_attempts(run, [preempted])
        with runfiles.attempts_path(run).open("a") as f:  # attempt 2 started, not ended
            f.write(json.dumps(start_line(2)) + "\n")
        for rank in range(2):
            write_heartbeat(run, heartbeat(rank, 2, state=state), history=False)
    app = create_app({"RUNS_ROOT": str(root), "TESTING": True, "STALL_MIN_S": 600.0, "DEAD_AFTER_S": 900.0})
    try:
        body = app.test_client().get("/api/runs", headers=AUTH).get_json()
        rows = {r["id"]: r for r in body["runs"]}
        training, ended = rows["training"], rows["ended"]
        assert training["needs_attention"] is True and training["slurm_stop"].startswith(
            "this job needs about 12 s to stop; Slurm gives it 5 (KillWait)"
        ), training
        assert training["attempts"] == 2
        assert ended["needs_attention"] is False and ended["slurm_stop"] is None, ended
        assert body["needs_attention"] == 1
    finally:
        app.extensions["rankwatch_runs"].stop()
