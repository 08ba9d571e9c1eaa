"""``rankwatch launch`` around real msrun jobs (2 ranks, CPU, the demo's LeNet5).

Every wait is for an event (a heartbeat, a process gone, the supervisor's
exit); the timeouts are failure guards. Durations are measured and printed
(``MEASURED``), never asserted.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from click.testing import CliRunner

from app.attempts import answer as attempts_answer
from app.cli import main as cli_main
from app.cli.common import open_cli_run
from app.run import goodput
from app.supervise import policy
from tests.helpers.app import AUTH, FAST_SETTINGS, make_app, wait_for
from tests.helpers.faults import held_rename, measure
from tests.helpers.jobs import STOPPED_RANK_ENV, UNTIL_STOPPED, DemoJob, write_flag
from tests.helpers.launch import LaunchJob, runs_row, wait_gone
from tests.helpers.storage import fill, small_tmpfs
from trainer_bridge.rundir import gaspfiles, runfiles

pytestmark = pytest.mark.msrun

# 500 samples, 2 ranks, batch 8 (LaunchJob's defaults): 31 steps an epoch. Two epochs: a kill at step 25 leaves a
# relaunch some 35 steps to train (every step a relaunch trains costs the suite time).
EPOCHS = 2
TRAIN = ["--epochs", str(EPOCHS), "--step-delay", "0.05", "--ckpt-every", "10"]
FAST = ["--backoff-s", "0.5", "--grace-s", "5"]


def step(job: LaunchJob, rank: int) -> int:
    hb = job.heartbeat(rank) or {}
    return hb.get("global_step") or 0


def down_total(row: dict) -> float | None:
    return (row.get("downtime") or {}).get("total_s")


def test_a_killed_rank_is_relaunched_from_the_newest_set_and_nothing_of_it_is_left(tmp_path, make_receiver):
    """kill -9 of rank 1 mid-training: attempt 2 resumes from the newest complete set and trains to the end."""
    with LaunchJob(tmp_path / "run", TRAIN, FAST) as job:
        job.wait_until(lambda: step(job, 1) >= 25, "rank 1 past global step 25")
        first = job.marked()
        assert {p.environ()["MS_ROLE"] for p in first if "MS_ROLE" in p.environ()} == {
            "MS_WORKER",
            "MS_SCHED",
        }
        killed_at = step(job, 1)
        job.workers()[1].send_signal(signal.SIGKILL)
        t_kill = time.time()
        # A second supervisor on the same run directory is refused, and starts nothing.
        second = LaunchJob(tmp_path / "run", TRAIN, FAST).start()
        assert second.wait() == policy.REFUSED
        assert "another rankwatch launch supervises" in second.output()
        # No process of attempt 1 outlives it: all are gone before attempt 2 trains.
        job.wait_until(lambda: len(job.rows()) >= 2 and job.rows()[1]["launch"], "attempt 2's start line")
        assert wait_gone([p.pid for p in first], timeout=5) == [], "a process of attempt 1 outlived it"
        assert job.wait() == 0, job.output()
    a, b = job.rows()
    cause = a["cause"]
    assert (cause["kind"], cause["rank"], cause["signal"], cause["role"]) == ("crash", 1, "SIGKILL", "worker")
    assert a["restarted_by"] == "launch" and a["end"] == "failed" and "rank 1" in a["error"]
    sup = a["supervisor"]
    assert sup["fault_at"] <= sup["detected_at"] <= sup["ended_at"] <= sup["relaunched_at"]
    # The dying gasp: rank 0 saved its replica at its last finished step, in MindIO TTP's layout, one
    # copy per rank; it is newer than every periodic set (every 10 steps), and attempt 2 resumed from it.
    resumed = b["resumed_from"]["global_step"]
    assert b["resumed_from"]["set"].startswith("ttp_checkpoints/ttp_saved_checkpoints-step_{G}/rank_{rank}/")
    assert resumed == b["supervisor"]["first_step"] - 1 and resumed >= killed_at - 1
    assert f"dying gasp: rank 0 saved its replica at global step {resumed}" in a["supervisor"]["note"]
    assert a["supervisor"]["resume"]["global_step"] == resumed
    gasp_set = tmp_path / "run" / "ttp_checkpoints" / f"ttp_saved_checkpoints-step_{resumed}"
    assert sorted(p.name for p in gasp_set.iterdir()) == ["rank_0", "rank_1"]
    assert job.steps_logged(0)[0] == resumed + 1 and job.steps_logged(0)[-1] == EPOCHS * job.steps_per_epoch
    assert b["end"] == "finished" and b["cause"]["kind"] == "finished"
    assert job.marked() == []
    # The goodput (app/run/goodput.py) from the real files: every global step is kept once, attempt 1's
    # steps past the set attempt 2 resumed from are lost, and the downtime is in the wall time only.
    state = open_cli_run(tmp_path / "run").state
    state.scan(time.time())
    beats, _ = state.heartbeats()
    g = state.goodput(attempts_answer(state.run_dir, beats, state.job_ended())["attempts"], time.time())
    assert g["kept_steps"] == EPOCHS * job.steps_per_epoch and g["steps_lost"] == a["last_step"] - resumed
    assert g["restarts"] == 1 and g["restarts_by_launch"] == 1 and g["downtime_s"] == down_total(a)
    assert g["wall_s"] >= b["ended_at"] - a["started_at"] and 0 < g["kept_s"] < g["wall_s"]
    assert 0 < g["goodput"] < 1
    # rankwatch status and rankwatch runs say the same.
    status = CliRunner().invoke(cli_main, ["status", "--run-dir", str(tmp_path / "run")])
    assert status.exit_code == 0, status.output
    assert goodput.text(g) in " ".join(status.output.split()), status.output
    body = json.loads(CliRunner().invoke(cli_main, ["runs", str(tmp_path), "--json"]).output)
    (run,) = [r for r in body["runs"] if r["id"].endswith("run")]
    assert (run["goodput"], run["restarts"], run["steps_lost"]) == (g["goodput"], 1, g["steps_lost"])
    # The restart is announced once, through a real webhook receiver.
    (alert,) = alerts_of(tmp_path / "run", make_receiver().start(), 1)
    assert (alert["event"], alert["attempt"], alert["resume"]["global_step"]) == ("restart", 1, resumed)
    assert alert["cause"]["signal"] == "SIGKILL" and alert["downtime"] == a["downtime"]
    assert f"rankwatch launch relaunched it from global step {resumed}" in alert["text"]
    measure("launch: goodput of the kill -9 job", g["goodput"] * 100, "%", wall_s=g["wall_s"])
    down = a["downtime"]
    measure("launch: kill -9 to detection", down["fault_to_detected_s"])
    measure("launch: detection to attempt ended", down["detected_to_ended_s"])
    measure("launch: ended to relaunched", down["ended_to_relaunched_s"])
    measure("launch: relaunched to the bridge's start", down["relaunched_to_bridge_start_s"])
    measure("launch: kill -9 to detection (test clock)", sup["detected_at"] - t_kill)
    measure("launch: kill -9 to relaunch (test clock)", sup["relaunched_at"] - t_kill)


def test_a_rank_killed_inside_a_periodic_save_leaves_a_set_that_is_never_resumed(tmp_path):
    """kill -9 of rank 1 inside its ModelCheckpoint save of step 20: that set is incomplete (rank 0's file
    written, rank 1's a .tmp), so attempt 2 resumes from step 10, says why, and trains to the end."""
    run = tmp_path / "run"
    one_epoch = ["--epochs", "1", *TRAIN[2:]]  # 31 steps: saves at 10, 20 and 30
    held = run / "ckpt_of_rank" / "1" / "lenet-1_20.tmp"
    # Without the dying gasp, which would save rank 0's replica at step 20 and hide the choice.
    with LaunchJob(run, one_epoch, [*FAST, "--gasp-s", "0"]) as job:
        job.wait_until(lambda: job.heartbeat(1), "rank 1's first heartbeat")
        victim = job.workers()[1]
        with held_rename(victim.pid, held):
            # Written and not yet renamed: rank 1 is inside MindSpore's save of step 20, and stays there.
            job.wait_until(held.exists, "rank 1 inside its save of step 20", poll=0.02)
            victim.send_signal(signal.SIGKILL)
        assert job.wait() == 0, job.output()
    assert (
        not held.with_suffix(".ckpt").exists() and (run / "ckpt_of_rank" / "0" / "lenet-1_20.ckpt").exists()
    )
    a, b = job.rows()
    assert (a["cause"]["kind"], a["cause"]["rank"], a["cause"]["signal"]) == ("crash", 1, "SIGKILL")
    assert a["last_step"] >= 20 and b["resumed_from"]["global_step"] == 10
    assert b["resumed_from"]["set"].startswith("ckpt_of_rank/"), b["resumed_from"]
    assert "#g20: incomplete: rank(s) 1 missing" in job.output(), job.output()
    assert b["end"] == "finished" and job.steps_logged(0) == list(range(11, 32))
    # `rankwatch checkpoints` (the browser's answer) says the same of the set: rank 0's file alone.
    listed = CliRunner().invoke(cli_main, ["checkpoints", str(run), "--json"])
    assert listed.exit_code == 0, listed.output
    (g20,) = [s for s in json.loads(listed.output)["checkpoints"]["sets"] if s["global_step"] == 20]
    assert not g20["complete"] and g20["ranks_missing"] == [1], g20


def test_a_hung_rank_ends_its_attempt_as_a_hang_and_the_job_goes_on(tmp_path):
    """The hang rule (--hang-restart-s, restart mode): rank 1 stopped with SIGSTOP is stalled; 10 s later
    rank 0, blocked in the AllReduce with it, saves its replica (the dying gasp, the hung rank not
    asked), the attempt ends with cause hang (SIGKILL ends a stopped process) and attempt 2 goes on
    from rank 0's last finished step; both its ranks killed at once, attempt 3 resumes from the newest
    periodic set and trains to the end."""
    # 10 s: well past a slow step on a loaded machine, well within the survivor's 30 s collective timeout.
    hang = [*FAST, "--hang-restart-s", "10", "--hang-mode", "restart"]
    # The dashboard's verdict, with its test thresholds: a stopped process is stalled at its first probe.
    env = {f"RANKWATCH_{k}": str(FAST_SETTINGS[k]) for k in ("STALL_MIN_S", "PROCESS_CHECK_AFTER_S")}
    env.update(STOPPED_RANK_ENV)  # the hang rule, not MindSpore's node timeout, must end the stopped rank
    with LaunchJob(tmp_path / "run", TRAIN, hang, env=env) as job:
        job.wait_until(lambda: step(job, 1) >= 25, "rank 1 past global step 25")
        stopped = job.workers()[1]
        stopped.send_signal(signal.SIGSTOP)
        # Rank 1's heartbeat, read once it is stopped, is its last word: rank 0 cannot finish a step
        # rank 1 has not given its gradients to, so rank 0's last finished step is at least this one.
        hung_at = step(job, 1)
        # Then, in attempt 2, both ranks die at once: no survivor can save, the next attempt resumes
        # from the newest periodic set.
        # Step 45 of 62: attempt 2 has saved sets past its resume point, and the kill lands well before
        # the end (a kill after the last step and the final save would leave attempt 3 nothing to train).
        job.wait_until(lambda: len(job.rows()) >= 2 and step(job, 0) >= 45, "attempt 2 past global step 45")
        both = job.workers()
        for p in both.values():
            p.send_signal(signal.SIGKILL)
        killed_at = max(step(job, 0), step(job, 1))
        assert job.wait() == 0, job.output()
    a, b, c = job.rows()
    assert b["cause"]["kind"] == "crash" and b["cause"]["signal"] == "SIGKILL"
    assert "saved its replica" not in (b["supervisor"].get("note") or "")
    # A periodic set attempt 2 saved (MindSpore's, not a dying gasp's), none of it newer than the kill.
    again = c["resumed_from"]["global_step"]
    assert c["resumed_from"]["set"].startswith("ckpt_of_rank/"), c["resumed_from"]
    assert b["resumed_from"]["global_step"] < again <= killed_at and c["end"] == "finished", (
        again,
        killed_at,
    )
    # The hang's dying gasp is the only one: both ranks killed at once leave no survivor to save.
    saved = b["resumed_from"]["global_step"]
    assert [p.name for p in (tmp_path / "run").glob("ttp_checkpoints/ttp_saved_checkpoints-step_*")] == [
        f"ttp_saved_checkpoints-step_{saved}"
    ]
    cause = a["cause"]
    assert (cause["kind"], cause["rank"], cause["pid"], cause["role"]) == ("hang", 1, stopped.pid, "worker")
    assert cause["error"].startswith("stalled for over 10 s: ") and "is stopped" in cause["error"], cause
    assert a["restarted_by"] == "launch" and f"rank 1 (pid {stopped.pid} on " in a["error"]
    assert f"attempt 1 failed: rank 1 (pid {stopped.pid} on" in job.output() and " hung: " in job.output()
    # The dying gasp for a hang: rank 0 saved at its last finished step, and attempt 2 resumed from
    # it, so no step of attempt 1 is lost (without it, the steps since the last periodic set are).
    assert f"dying gasp: rank 0 saved its replica at global step {saved}" in a["supervisor"]["note"]
    assert "asked rank(s) 0 to save their replica" in job.output(), job.output()
    assert b["resumed_from"]["set"].startswith("ttp_checkpoints/"), b["resumed_from"]
    assert saved >= hung_at and a["last_step"] == saved, (saved, hung_at, a["last_step"])
    logged = job.steps_logged(0)
    assert logged and logged[-1] == EPOCHS * job.steps_per_epoch, (again, logged[-3:], job.output())
    assert job.marked() == []
    measure(
        "launch: SIGSTOP to the hang's detection",
        a["supervisor"]["detected_at"] - a["supervisor"]["fault_at"],
    )


def test_a_script_that_fails_at_import_ends_the_run_by_the_startup_rule(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import rankwatch_no_such_module  # noqa\n")
    # A long backoff the startup rule never waits out (the run would outlast the guard).
    job = LaunchJob(
        tmp_path / "run", [], ["--backoff-s", "600", "--max-restarts", "5"], script=script, join=False
    )
    with job:
        assert job.wait(timeout=400) == policy.STARTUP, job.output()
    out = job.output()
    assert "the same failure twice in a row before the first step" in out
    assert "ModuleNotFoundError: No module named 'rankwatch_no_such_module'" in out
    assert "relaunching in" not in out
    rows = job.rows()
    assert [r["attempt"] for r in rows] == [1, 2]
    for r in rows:
        assert r["cause"]["kind"] == "crash" and r["cause"]["before_first_step"]
        assert "rankwatch_no_such_module" in r["cause"]["error"] and r["end"] == "failed"
    assert rows[0]["restarted_by"] == "launch" and rows[1]["supervisor"]["exit_code"] == policy.STARTUP
    assert job.marked() == []


def alerts_of(run_dir, receiver, n: int) -> list[dict]:
    """The alerts a dashboard on ``run_dir`` sends to ``receiver`` (``n`` of them), each once: a second
    dashboard on the same run sends none again."""
    settings = {"WEBHOOK_URL": receiver.url, "ALERT_GROUP_S": 0.1}
    first = make_app(run_dir, **settings)
    first.extensions["rankwatch"].watcher.tick()
    mine = ("restart", "launch_gave_up")  # not the ranks' verdicts
    got = receiver.wait_for(
        lambda p: len(x := [e for e in p if e["event"] in mine]) >= n and x, f"{n} alert(s)"
    )
    sender = first.extensions["rankwatch"].incidents.alerts.sender
    wait_for(lambda: len(sender.rows()) >= n, "the delivery log's rows")
    again = make_app(run_dir, **settings)
    again.extensions["rankwatch"].watcher.tick()
    assert again.extensions["rankwatch"].incidents.restarts._seen, "the second dashboard read no attempt"
    assert again.extensions["rankwatch"].incidents.alerts.sender.raised == 0
    return got


def test_the_budget_and_the_no_progress_rule_have_their_own_exit_codes(tmp_path, make_receiver):
    crash = [*TRAIN, "--crash-rank", "1", "--crash-at", "25"]
    # Without the dying gasp (which would save step 25, past the crash), so each attempt resumes from
    # the last periodic set and crashes again at 25.
    nogasp = [*FAST, "--gasp-s", "0"]
    # The disk is full when the dying gasp comes: RUN/ttp_checkpoints is a filled tmpfs of its own.
    # The survivor's save fails, no partial set is left, and the relaunch below resumes from a
    # periodic set (a gasp set would be at step 24 or 25).
    ttp = tmp_path / "budget" / gaspfiles.TTP_DIR
    with small_tmpfs(ttp, "256k"):
        filler = fill(ttp)
        with LaunchJob(tmp_path / "budget", crash, [*FAST, "--max-restarts", "0"]) as job:
            assert job.wait() == policy.BUDGET, job.output()
        assert list(ttp.iterdir()) == [filler]
    (row,) = job.rows()
    gasp = row["supervisor"].get("note") or ""
    assert "dying gasp: " in gasp and "saved its replica" not in gasp, gasp
    # The survivor answers in the window unless the machine is too loaded for it: then nothing is said.
    assert "No space left on device" in gasp or "no survivor answered" in gasp, gasp
    assert row["cause"]["error"] == "RuntimeError: injected crash at global step 25 (--crash-rank)"
    assert row["cause"]["rank"] == 1 and row["cause"]["exit_code"] not in (None, 0)
    assert "restart budget is used up (0 of 0" in job.output()
    # The run needs a person: the landing page's row says why.
    row = runs_row(tmp_path, tmp_path / "budget")
    assert (
        row["needs_attention"] and "ended the run (exit 4): the restart budget is used up" in row["gave_up"]
    )
    # The newest periodic set (step 20) is corrupt: rank 1's file cut short, as by a full disk.
    (cut,) = (tmp_path / "budget" / "ckpt_of_rank" / "1").glob("*_20.ckpt")
    cut.write_bytes(cut.read_bytes()[:300])
    # The same run again, with budget: attempt 2 resumes from the set before (step 10), says why, and
    # crashes at 25 again.
    with LaunchJob(tmp_path / "budget", crash, [*nogasp, "--max-restarts", "3", "--no-progress", "1"]) as job:
        assert job.wait() == policy.NO_PROGRESS, job.output()
    rows = job.rows()
    assert [r["attempt"] for r in rows] == [1, 2]
    assert rows[1]["resumed_from"]["global_step"] == 10 and not rows[1]["supervisor"]["progressed"]
    assert "passed over: " in job.output() and "#g20: corrupt on rank(s) 1" in job.output(), job.output()
    assert "without training past global step 25" in job.output()
    # The landing page's row: attempt 2 was a relaunch by hand (a restart, not by launch), the steps it
    # trained again are lost, and the supervisor gave up on the run.
    row = runs_row(tmp_path, tmp_path / "budget")
    assert (row["restarts"], row["steps_lost"]) == (1, rows[0]["last_step"] - 10)
    assert row["needs_attention"] and "(exit 93)" in row["gave_up"]
    # An alert for each time the supervisor gave up, from the real file through a real receiver.
    got = alerts_of(tmp_path / "budget", make_receiver().start(), 2)
    assert [(p["event"], p["attempt"], p["exit_code"]) for p in got] == [
        ("launch_gave_up", 1, 4),
        ("launch_gave_up", 2, 93),
    ]
    assert "the run needs attention" in got[1]["text"] and got[1]["cause"]["rank"] == 1


def test_a_killed_supervisor_leaves_no_orphan_and_the_next_one_continues(tmp_path):
    run = tmp_path / "run"
    with LaunchJob(run, TRAIN, FAST) as job:
        job.wait_until(lambda: step(job, 0) >= 12, "global step 12")
        attempt = [p.pid for p in job.marked()]
        assert len(attempt) >= 3  # the scheduler and two workers
        os.kill(job.proc.pid, signal.SIGKILL)
        job.proc.wait()
        assert wait_gone(attempt, timeout=120) == [], "the job outlived its supervisor"
    with LaunchJob(run, TRAIN, FAST) as again:
        assert again.wait() == 0, again.output()
    a, b = again.rows()
    # The keeper's SIGTERM reaches the bridge, which stops the ranks gracefully (a set at one step) if
    # they can agree in the grace period; else SIGKILL leaves them killed.
    assert a["end"] in ("graceful_stop", "killed") and b["attempt"] == 2
    if a["end"] == "graceful_stop":
        assert a["source"] == "sigterm" and b["resumed_from"]["global_step"] == a["last_step"]
    else:
        assert b["resumed_from"]["global_step"] >= 10
    assert b["end"] == "finished" and again.marked() == []


def test_a_stop_is_never_relaunched_and_ctrl_c_stops_gracefully_then_at_once(tmp_path):
    run = tmp_path / "run"
    long = ["--epochs", "1000", "--step-delay", "0.05", "--ckpt-every", "10"]
    # A stop from the page or rankwatch stop (the flag): the ranks save and exit; not a failure.
    with LaunchJob(run, long, FAST) as job:
        job.wait_until(lambda: step(job, 0) >= 5, "global step 5")
        write_flag(run, request_id="req-page")
        assert job.wait() == 0, job.output()
    (a,) = job.rows()
    assert a["end"] == "graceful_stop" and a["cause"]["kind"] == "stop" and a["restarted_by"] is None
    stop_step = a["last_step"]
    runfiles.write_flag(run, False)  # re-armed, as the dashboard does once a stop is done
    # Ctrl-C to rankwatch launch: the same graceful stop, asked through rankwatch stop's request.
    with LaunchJob(run, long, FAST) as job:
        job.wait_until(lambda: step(job, 0) > stop_step + 3, "training past the stop")
        os.kill(job.proc.pid, signal.SIGINT)
        assert job.wait() == 0, job.output()
    b = job.rows()[1]
    assert b["resumed_from"]["global_step"] == stop_step  # the new supervisor resumed from the stop's set
    assert b["end"] == "graceful_stop" and b["cause"]["kind"] == "stop"
    assert "graceful stop requested" in job.output() and job.marked() == []
    runfiles.write_flag(run, False)
    # Twice: everything ends at once. A script without the bridge never obeys the first (nor could a
    # bridge job be relied on to take longer to stop than the test takes to press again).
    for log in (run / "msrun_logs").glob("worker_*.log"):
        log.unlink()  # the last attempt's steps
    job = LaunchJob(run, [*long, "--no-bridge"], FAST)
    told = len(job.output())  # the three supervisors share one output file
    with job:
        job.wait_until(lambda: len(job.steps_logged(0)) > 3, "steps in worker 0's log")
        pids = [p.pid for p in job.marked()]
        os.kill(job.proc.pid, signal.SIGINT)
        job.wait_until(lambda: "waiting for the job to stop" in job.output()[told:], "the first Ctrl-C taken")
        os.kill(job.proc.pid, signal.SIGINT)
        assert job.wait() == policy.INTERRUPTED, job.output()
    assert wait_gone(pids, timeout=5) == []
    c = job.rows()[2]
    assert c["attempt"] == 3 and c["cause"]["kind"] == "interrupted" and c["supervisor"]["exit_code"] == 130


def test_where_mindcluster_owns_recovery_the_supervisor_only_records(tmp_path):
    """MINDX_TASK_ID set: the command runs as written (msrun's own --join True ends the job), nothing is
    relaunched, and the attempt's record says what happened."""
    with LaunchJob(tmp_path / "run", TRAIN, FAST, env={"MINDX_TASK_ID": "job-1"}) as job:
        job.wait_until(lambda: step(job, 1) >= 12, "rank 1 past global step 12")
        job.workers()[1].send_signal(signal.SIGKILL)
        assert job.wait() == policy.FAILED, job.output()
    out = job.output()
    assert "--join=True" in out and "--join=False" not in out and "recorded only" in out
    (row,) = job.rows()
    # msrun (--join True) reaped rank 1, so its signal is unknown here; it was gone first.
    assert row["cause"]["rank"] == 1 and "process was gone" in row["cause"]["error"]
    assert row["supervisor"]["action"] == "record_only" and row["restarted_by"] is None
    assert job.marked() == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_the_demo_under_launch_stops_gracefully_on_ctrl_c(tmp_path, sig):
    """``rankwatch demo``'s way (--supervise): Ctrl-C typed on its terminal (a pty: the line discipline
    signals the whole foreground group, as a person's Ctrl-C does) or SIGTERM is a graceful stop
    through rankwatch launch, and the terminal says where it stopped (issue 33, section 3)."""
    on_pty = sig == signal.SIGINT
    demo = DemoJob(
        tmp_path / "demo", epochs=UNTIL_STOPPED, step_delay=0.05, extra=["--supervise"], terminal=on_pty
    )
    with demo as job:
        job.wait_for_step(5)
        if on_pty:
            job.ctrl_c()
        else:
            os.kill(job.proc.pid, sig)
        assert job.wait() == 0, job.logs()
        job.stopped_together()
    (row,) = LaunchJob.rows_of(tmp_path / "demo")
    assert row["cause"]["kind"] == "stop" and row["end"] == "graceful_stop"
    said = job.output_path.read_text()
    assert "stopping gracefully" in said
    assert f"stopped gracefully at global step {row['last_step']}: every rank saved" in said, said
    # Ended by its operator: "stopped" on the runs table, never "failed, 2 dead" (issue 33, section 3).
    app = make_app(tmp_path / "demo")
    try:
        (run,) = app.test_client().get("/api/runs", headers=AUTH).get_json()["runs"]
    finally:
        app.extensions["rankwatch"].watcher.stop()
    assert run["state"] == "stopped" and not run["needs_attention"], run


def test_a_job_launched_without_the_supervisor_is_not_trampled(tmp_path):
    """A live job in the run directory (started by hand): rankwatch launch refuses before msrun starts."""
    run = tmp_path / "run"
    with DemoJob(run, epochs=UNTIL_STOPPED, step_delay=0.05) as plain:
        plain.wait_for_step(3)
        logs = [run / "msrun_logs" / name for name in ("worker_0.log", "worker_1.log", "launcher.log")]
        before = [path.read_bytes() for path in logs]
        job = LaunchJob(run, TRAIN, FAST).start()
        assert job.wait() == policy.REFUSED, job.output()
        assert "refusing to start: another launch of a job is training" in job.output()
        assert "attempt 1:" not in job.output() and job.marked() == []
        assert all(h["state"] == "training" for h in plain.heartbeats())
        # msrun truncated the running job's logs before the bridge refused (issue 33, section 2):
        # refused before msrun starts, they have only grown.
        for path, old in zip(logs, before, strict=True):
            assert old and path.read_bytes().startswith(old), path


def losses(job: LaunchJob, rank: int) -> dict[int, str]:
    """Global step -> the loss LossMonitor printed (as text: compared bit for bit)."""
    import re

    text = (job.run_dir / "msrun_logs" / f"worker_{rank}.log").read_text(errors="replace")
    per = job.steps_per_epoch
    return {
        (int(e) - 1) * per + int(s): loss
        for e, s, loss in re.findall(r"^epoch: (\d+) step: (\d+), loss is (\S+)$", text, re.M)
    }


def test_a_resume_from_the_dying_gasp_gives_the_losses_of_a_run_without_the_fault(tmp_path):
    """The proof: the replica saved while the survivor was blocked is its last finished step, exactly."""
    exact = ["--epochs", "2", "--step-delay", "0.05", "--no-shuffle", "--monitors"]
    # 160 samples: 10 steps an epoch, 20 a run (not 62). The kill, at step 5, is in the first
    # epoch, so the resumed run crosses an epoch boundary, as with 31-step epochs and a kill at 20.
    # The two jobs side by side: the losses do not depend on the pace, and most of a job's time is
    # MindSpore's start and end, waiting, which the two then share.
    with (
        LaunchJob(tmp_path / "clean", exact, FAST, samples=160) as clean,
        LaunchJob(tmp_path / "fault", exact, FAST, samples=160) as job,
    ):
        job.wait_until(lambda: step(job, 1) >= 5, "rank 1 past global step 5")
        job.workers()[1].send_signal(signal.SIGKILL)
        assert job.wait() == 0, job.output()
        assert clean.wait() == 0, clean.output()
    reference = losses(clean, 0)
    assert len(reference) == 2 * clean.steps_per_epoch
    a, b = job.rows()
    resumed = b["resumed_from"]["global_step"]
    assert b["resumed_from"]["set"].startswith("ttp_checkpoints/")
    after = losses(job, 0)  # attempt 2's log (msrun rewrote it)
    assert min(after) == resumed + 1 and max(after) == 2 * job.steps_per_epoch
    assert after == {s: reference[s] for s in after}, "the resumed run's losses differ from the clean run's"
