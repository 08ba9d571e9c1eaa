"""Real batch jobs of the 2-rank CPU demo through ``rankwatch slurm template`` on a real Slurm.

Every wait is for an event (a heartbeat, the job's state in ``scontrol show
job``, an attempt line); the timeouts are failure guards. The time from
Slurm's signal to the last rank's exit is measured and printed (``MEASURED``),
never asserted: docs/slurm.md quotes it.
"""

from __future__ import annotations

import re
import sys
import time

import pytest

from app.supervise import policy
from tests.helpers.jobs import UNTIL_STOPPED, wait_for_job, write_flag
from tests.helpers.slurm import Slurm, demo_script
from trainer_bridge.demo.__main__ import job_env
from trainer_bridge.rundir import attempts, runfiles

pytestmark = pytest.mark.msrun

TRAIN = ["--epochs", str(UNTIL_STOPPED), "--step-delay", "0.05", "--ckpt-every", "0"]


def job_environment() -> dict:
    return {k: v for k, v in job_env().items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}


def rows(run_dir) -> list[dict]:
    return attempts.fold(attempts.read_lines(run_dir)[0])


def steps(run_dir) -> list[int]:
    beats = [runfiles.read_json_or_none(runfiles.heartbeat_path(run_dir, r)) or {} for r in (0, 1)]
    return [hb.get("global_step") or 0 for hb in beats]


# The template's --signal=B:TERM@N: Slurm's warning N seconds before the time limit (the opt-in).
WARN_S = 150


def time_limit_now(slurm: Slurm, job: str) -> int:
    """Cut the job's time limit so that Slurm's warning is due now, with a minute left to stop in.

    A real time limit, reached while the job trains: Slurm looks at limits about every 30 s, so a
    limit fixed at submission would warn at a moment the test cannot choose. The new limit, T
    minutes from the job's start, puts T - WARN_S behind the elapsed time E and T beyond E + 90 s:
    the warning goes out at Slurm's next look (within 30 s), the kill no sooner than E + 90 s.
    """
    elapsed = run_time_s(slurm.job(job)["RunTime"])
    minutes = (elapsed + WARN_S) // 60
    slurm.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}"])
    return minutes


def run_time_s(text: str) -> int:
    """``scontrol``'s ``RunTime`` ([D-]HH:MM:SS) in seconds."""
    days, _, hms = text.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + s


def test_a_time_limit_saves_requeues_and_the_next_run_resumes_as_attempt_2(slurm: Slurm, tmp_path):
    run = tmp_path / "run"
    script = demo_script(tmp_path, run, TRAIN, signal_s=WARN_S)
    out = tmp_path / "job.out"
    job = slurm.sbatch(script, "-o", str(out), "--time=10", env=job_environment())
    log = lambda: out.read_text(errors="replace") if out.exists() else ""  # noqa: E731

    wait_for_job("both ranks at global step 3", lambda: min(steps(run)) >= 3 or slurm_failed(slurm, job, log))
    signalled = time.time()
    limit = time_limit_now(slurm, job)

    # The first run of the job ends: every rank saved at one step, the attempt is preempted, Slurm requeues.
    first = wait_for_job(
        "attempt 1 preempted",
        lambda: (
            [r for r in rows(run) if (r.get("cause") or {}).get("kind") == "preempted"]
            or slurm_failed(slurm, job, log)
        ),
    )[0]
    # The requeued run gets its ten minutes back, so that Slurm does not warn it at once too.
    slurm.run(["scontrol", "update", f"JobId={job}", "TimeLimit=10"])
    assert first["attempt"] == 1 and first["end"] == "graceful_stop", (first, limit)
    cause, sched = first["cause"], first["supervisor"]["scheduler"]
    assert cause["signal"] == "SIGTERM" and cause["signalled_at"] >= signalled - 1
    assert sched["kind"] == "slurm" and sched["job_id"] == job and sched["restart_count"] == 0
    assert sched["partition"] == slurm.partition and sched["nodelist"] == slurm.node
    assert sched["kill_wait_s"] == slurm.kill_wait_s  # from scontrol: what the page's check compares with
    # The stop's estimate (the dialog's, with the save time measured at this stop) against KillWait.
    check = slurm.run([sys.executable, "-m", "app.cli", "slurm", "check", "--run-dir", str(run)], check=False)
    told = re.search(r"this job needs about (\d+) s to stop; Slurm gives it 30 \(KillWait\)", check.stdout)
    assert told and check.returncode == (1 if "would kill it" in check.stdout else 0), check
    saved = first["last_step"]
    stopped = first["supervisor"]["ended_at"]
    print(
        f"\nMEASURED time-limit warning (the batch shell's trap) to every rank saved and exited: "
        f"{stopped - cause['signalled_at']:.1f} s (KillWait {slurm.kill_wait_s} s); rankwatch slurm check's "
        f"figure: {slurm_measured(run):.1f} s; the time limit cut to {limit} min, the warning {WARN_S} s before it"
    )

    slurm.wait_job(
        job,
        lambda f: f.get("Restarts") == "1" and f.get("JobState") in ("PENDING", "RUNNING"),
        "requeued once",
    )
    assert "preempted by SIGTERM: requeueing job" in log(), log()

    second = attempt_2(slurm, job, run, log)
    assert second["resumed_from"]["global_step"] == saved, second
    assert second["first_step"] == saved + 1
    wait_for_job("attempt 2 past its first step", lambda: min(steps(run)) > saved)
    beats = [runfiles.read_json_or_none(runfiles.heartbeat_path(run, r)) for r in (0, 1)]
    assert {hb["launch"] for hb in beats} == {second["launch"]}
    # A stop from the page (the flag) ends the requeued job by itself: a clean exit, not requeued again.
    write_flag(run, request_id="req-page")
    fields = slurm.wait_job(job, lambda f: f.get("JobState") in ("COMPLETED", "FAILED"), "the job ended")
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", (fields, log())
    again = rows(run)[1]
    assert again["attempt"] == 2 and again["cause"]["kind"] == "stop", again
    assert again["supervisor"]["scheduler"]["restart_count"] == 1
    assert "the run ended (stop); not requeued" in log()


def slurm_measured(run) -> float:
    from app.run.slurmstop import measured_stop_s

    return measured_stop_s(str(run))


def attempt_2(slurm: Slurm, job: str, run, log) -> dict:
    """The requeued run's attempt, once it has launched: Slurm starts the requeued job by itself once
    its credential has expired (``CRED_EXPIRE_S``, tests/helpers/slurm.py); starting it sooner
    (``scontrol update StartTime=now``) raced slurmd, which then refused it ("Job credential revoked")."""
    return wait_for_job(
        "attempt 2 training",
        lambda: (
            [r for r in rows(run) if r["attempt"] == 2 and r.get("launch")] or slurm_failed(slurm, job, log)
        ),
        every_s=0.5,
    )[0]


def slurm_failed(slurm: Slurm, job: str, log) -> bool:
    state = slurm.job(job).get("JobState")
    if state in ("FAILED", "COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
        raise AssertionError(f"job {job} {state} before training\n{log()}\n{slurm.logs()}")
    return False


def test_a_script_failing_at_import_is_not_requeued(slurm: Slurm, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import rankwatch_no_such_module  # noqa\n")
    run = tmp_path / "run"
    script = demo_script(tmp_path, run, [], script=broken)
    out = tmp_path / "job.out"
    job = slurm.sbatch(script, "-o", str(out), env=job_environment())
    fields = slurm.wait_job(job, lambda f: f.get("JobState") in ("FAILED", "COMPLETED"), "the job ended", 400)
    text = out.read_text(errors="replace")
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == f"{policy.STARTUP}:0", (fields, text)
    assert fields["Restarts"] == "0", fields
    assert f"rankwatch launch exited {policy.STARTUP}: the run cannot progress; not requeued" in text
    assert [r["cause"]["kind"] for r in rows(run)] == ["crash", "crash"]


def test_scontrol_requeue_signals_every_process_and_the_requeued_run_trains_on(slurm: Slurm, tmp_path):
    """``scontrol requeue`` (as ``PreemptMode=REQUEUE``): Slurm signals every process of the step and
    requeues the job itself. The ranks save on their SIGTERM; the attempt is ``preempted``, not a
    crash; and the requeued run does not read the stop its predecessor was asked and stop at once
    (before, attempt 1 read as a crash of msrun's scheduler and attempt 2 ended 'stop' right after
    its resume)."""
    run = tmp_path / "run"
    out = tmp_path / "job.out"
    job = slurm.sbatch(demo_script(tmp_path, run, TRAIN), "-o", str(out), env=job_environment())
    log = lambda: out.read_text(errors="replace") if out.exists() else ""  # noqa: E731
    wait_for_job("both ranks at global step 3", lambda: min(steps(run)) >= 3 or slurm_failed(slurm, job, log))
    slurm.run(["scontrol", "requeue", job])
    first = wait_for_job("attempt 1 ended", lambda: [r for r in rows(run) if r.get("supervisor")])[0]
    assert first["cause"]["kind"] == "preempted" and first["cause"]["signal"] == "SIGTERM", (first, log())

    second = attempt_2(slurm, job, run, log)
    assert second["resumed_from"] is not None, f"{first}\n{second}\n{log()}"
    saved = second["resumed_from"]["global_step"]
    # The requeued run trains on past its resume: the stale stop was re-armed, and said so.
    wait_for_job(
        "attempt 2 past its first step",
        lambda: (
            min(steps(run)) > saved or [r for r in rows(run) if r["attempt"] == 2 and r.get("supervisor")]
        ),
    )
    # Re-armed by whichever came first: the batch script's last line, if Slurm let it run, or the
    # requeued run's rankwatch launch (slurm.stale_preemption, unit-tested in test_slurm_unit.py).
    assert min(steps(run)) > saved, (rows(run), log())
    write_flag(run, request_id="req-page")
    fields = slurm.wait_job(job, lambda f: f.get("JobState") in ("COMPLETED", "FAILED"), "the job ended")
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", (fields, log())
