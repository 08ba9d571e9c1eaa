"""The Slurm pieces that need no Slurm: the record, the signal note, the time left, the script, the requeue rule."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from app.run import slurmstop
from app.supervise import policy, slurm
from app.supervise.slurmscript import after_launch, render
from trainer_bridge.rundir import attempts, runfiles, schema
from trainer_bridge.rundir import slurm as rundir_slurm


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1-02:03:04", 93784.0),
        ("02:03:04", 7384.0),
        ("3:04", 184.0),
        ("UNLIMITED", None),
        ("INVALID", None),
        ("", None),
    ],
)
def test_squeue_time_left(text, seconds):
    assert slurm.parse_duration(text) == seconds


def test_the_scheduler_record_comes_from_slurms_variables():
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_RESTART_COUNT": "2",
        "SLURM_JOB_PARTITION": "gpu",
        "SLURM_JOB_NODELIST": "node[01-02]",
        "SLURM_JOB_NAME": "lenet",
    }
    assert rundir_slurm.scheduler(env) == {
        "kind": "slurm",
        "job_id": "42",
        "array_task_id": None,
        "restart_count": 2,
        "partition": "gpu",
        "nodelist": "node[01-02]",
        "job_name": "lenet",
        "kill_wait_s": None,  # rankwatch launch adds it (app/supervise/slurm.py scheduler_record)
    }
    assert rundir_slurm.scheduler({}) is None
    assert rundir_slurm.scheduler({"SLURM_JOB_ID": "x" * 100}) is None  # past the schema's bound
    assert rundir_slurm.scheduler({"SLURM_JOB_ID": "1", "SLURM_RESTART_COUNT": "-1"})["restart_count"] == 0


def test_the_signal_note_is_untrusted_input(tmp_path):
    assert rundir_slurm.read_note(tmp_path) is None
    rundir_slurm.write_note(tmp_path, "SIGTERM", 100.0, 25.0, "7", restart_count=2)
    assert rundir_slurm.read_note(tmp_path) == {
        "signal": "SIGTERM",
        "at": 100.0,
        "time_left_s": 25.0,
        "job_id": "7",
        "restart_count": 2,
    }
    assert rundir_slurm.read_note(tmp_path, since=101.0) is None  # older than the attempt
    path = rundir_slurm.note_path(tmp_path)
    for bad in (
        [1],
        {"signal": "SIGTERM", "at": "now"},
        {"signal": "", "at": 1},
        {"signal": "T", "at": float("inf")},
    ):
        path.write_text(json.dumps(bad))
        assert rundir_slurm.read_note(tmp_path) is None, bad
    path.write_text(json.dumps({"signal": "SIGTERM", "at": 1, "pad": "x" * 5000}))
    assert rundir_slurm.read_note(tmp_path) is None  # too large
    os.unlink(path)
    os.symlink(tmp_path / "elsewhere.json", path)
    (tmp_path / "elsewhere.json").write_text(json.dumps({"signal": "SIGTERM", "at": 1}))
    assert rundir_slurm.read_note(tmp_path) is None


def test_a_stop_from_an_earlier_runs_preemption_is_served_once_slurm_requeued_it(tmp_path):
    # scontrol requeue and PreemptMode=REQUEUE requeue the job themselves: the stop the signal asked
    # must not stop the requeued run at once (found with a real scontrol requeue).
    rundir_slurm.write_note(tmp_path, "SIGTERM", 100.0, None, "7", restart_count=0)
    asked = {"request_id": "r1", "requested_at": 101.0}
    env = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}
    why = slurm.stale_preemption(str(tmp_path), asked, env)
    assert (
        why == "the stop r1 followed Slurm's SIGTERM to run 0 of job 7, which Slurm requeued: this is run 1"
    )
    assert slurm.stale_preemption(str(tmp_path), None, env) is None  # the flag does not say stop
    assert (
        slurm.stale_preemption(str(tmp_path), asked, {**env, "SLURM_RESTART_COUNT": "0"}) is None
    )  # same run
    assert slurm.stale_preemption(str(tmp_path), asked, {**env, "SLURM_JOB_ID": "8"}) is None  # another job
    # A stop a person asked long after the signal is theirs: left as it is.
    assert slurm.stale_preemption(str(tmp_path), {"request_id": "r2", "requested_at": 500.0}, env) is None
    assert slurm.stale_preemption(str(tmp_path), {"request_id": "r3", "requested_at": "x"}, env) is None


def test_a_stop_after_slurms_signal_is_preempted(tmp_path):
    stop = {"kind": "stop", "before_first_step": False}
    assert slurm.preempted(stop, str(tmp_path), 50.0) == stop
    rundir_slurm.write_note(tmp_path, "SIGTERM", 100.0, None, "7")
    assert slurm.preempted(stop, str(tmp_path), 50.0) == {
        **stop,
        "kind": "preempted",
        "signal": "SIGTERM",
        "signalled_at": 100.0,
        "time_left_s": None,
    }
    assert slurm.preempted(stop, str(tmp_path), 150.0) == stop  # a note of an earlier attempt
    crash = {"kind": "crash", "before_first_step": False}
    assert slurm.preempted(crash, str(tmp_path), 50.0) == crash
    assert schema.build(schema.AttemptCause, **slurm.preempted(stop, str(tmp_path), 50.0)).kind == "preempted"


def supervised(run_dir, kind: str, code: int) -> None:
    attempts.append_record(
        run_dir,
        schema.build(
            schema.AttemptSupervised,
            kind="supervised",
            attempt=1,
            supervisor_pid=1,
            host="h",
            spawned_at=1.0,
            cause={"kind": kind, "signal": "SIGTERM" if kind == "preempted" else None},
            action="end",
            exit_code=code,
        ),
    )


def test_only_a_preempted_attempt_is_requeued_and_never_a_run_that_cannot_progress(tmp_path):
    env = {"SLURM_JOB_ID": "7"}
    runfiles.state_dir(tmp_path).mkdir(parents=True)
    for code in (policy.BUDGET, policy.STARTUP, policy.NO_PROGRESS):
        assert after_launch(str(tmp_path), code, env)[:2] == (code, False)
    assert after_launch(str(tmp_path), policy.FAILED, env)[:2] == (policy.FAILED, False)
    assert after_launch(str(tmp_path), 0, env)[:2] == (0, False)  # no attempt at all
    supervised(tmp_path, "stop", 0)
    assert after_launch(str(tmp_path), 0, env)[:2] == (0, False)
    supervised(tmp_path, "preempted", 0)
    code, again, told = after_launch(str(tmp_path), 0, env)
    assert (code, again) == (0, True) and told == "preempted by SIGTERM: requeueing job 7"


def test_the_template_is_valid_bash_and_quotes_the_training_command():
    text = render(
        ["train.py", "--name", "a b; rm -rf /", "$HOME"], job_name="j", nodes=2, workers=4, signal_s=90
    )
    assert (
        "#SBATCH --requeue" in text and "#SBATCH --signal=B:TERM@90" in text and "#SBATCH --nodes=2" in text
    )
    assert "TRAIN=(train.py --name 'a b; rm -rf /' '$HOME')" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_rankwatch_status_names_the_slurm_job_and_its_preemption(tmp_path):
    from click.testing import CliRunner

    from app.cli import main

    runfiles.state_dir(tmp_path).mkdir(parents=True)
    sched = {"kind": "slurm", "job_id": "42", "restart_count": 1, "partition": "gpu", "nodelist": "n1"}
    for n, cause in (
        (1, {"kind": "preempted", "signal": "SIGTERM", "time_left_s": 25.0}),
        (2, {"kind": "finished"}),
    ):
        attempts.append_record(
            tmp_path,
            schema.build(
                schema.AttemptSupervised,
                kind="supervised",
                attempt=n,
                supervisor_pid=1,
                host="h",
                spawned_at=float(n),
                cause=cause,
                action="end",
                exit_code=0,
                scheduler={**sched, "restart_count": n - 1},
            ),
        )
    out = CliRunner().invoke(main, ["status", "--run-dir", str(tmp_path)])
    assert (
        "Slurm job 42, restart 1, partition gpu, on n1; attempt 1 preempted by SIGTERM, 25 s left"
        in out.output
    ), out.output
    assert slurm.status_text([]) is None


def test_the_stop_fits_in_killwait_or_the_sentence_says_it_does_not():
    assert slurmstop.fits(40.4, 30) == (
        False,
        "this job needs about 40 s to stop; Slurm gives it 30 (KillWait): a preemption would kill it before "
        "every rank saved",
    )
    assert slurmstop.fits(12.0, 30)[0] is True
    assert slurmstop.fits(None, 30)[0] is None and slurmstop.fits(5.0, None)[0] is None
    assert slurm._KILL_WAIT.search("JobRequeue = 1\nKillWait                = 30 sec\n").group(1) == "30"


def test_the_stop_time_is_measured_from_slurms_signal_else_from_the_flag_seen(tmp_path):
    from tests.helpers.heartbeats import heartbeat, write_heartbeat

    assert slurmstop.measured_stop_s(str(tmp_path)) is None
    for rank, (seen, exited) in enumerate([(101.0, 104.0), (100.5, 109.5)]):
        hb = heartbeat(rank, 2, state="exited")
        hb["stop"] = {"source": "flag", "stage": "exited", "at": {"seen": seen, "exited": exited}}
        write_heartbeat(tmp_path, hb, history=False)
    assert slurmstop.measured_stop_s(str(tmp_path)) == 9.0  # first seen 100.5, last exit 109.5
    rundir_slurm.write_note(tmp_path, "SIGTERM", 98.0, None, "7")
    assert slurmstop.measured_stop_s(str(tmp_path)) == 11.5  # from the signal
    supervised(tmp_path, "preempted", 0)  # launch's record wins: signal to the last process gone
    attempts.append_record(
        tmp_path,
        schema.build(
            schema.AttemptSupervised,
            kind="supervised",
            attempt=2,
            supervisor_pid=1,
            host="h",
            spawned_at=90.0,
            cause={"kind": "preempted", "signal": "SIGTERM", "signalled_at": 98.0},
            ended_at=113.0,
            action="end",
            exit_code=0,
        ),
    )
    assert slurmstop.measured_stop_s(str(tmp_path)) == 15.0
