"""The log ranks' stop stages and the job's end, as pure facts (``app.run.jobend`` and the stop service)."""

from __future__ import annotations

from app.audit import AuditLog
from app.run.jobend import JobFacts, StopInputs, log_stage
from app.stop.service import StopService
from trainer_bridge.rundir import runfiles

T0 = 1_000_000.0


def test_a_graceful_exit_line_older_than_the_request_belongs_to_an_earlier_stop():
    facts = JobFacts(triggered={0: T0 - 60}, ended={0: (T0 + 5, "process 1 is gone")})
    assert log_stage(0, facts, T0)["stage"] == "requested"
    facts = JobFacts(triggered={0: T0 + 2}, ended={})
    assert log_stage(0, facts, T0) == {"stage": "saving", "at": {"saving": T0 + 2}}
    facts = JobFacts(triggered={0: T0 + 2}, ended={0: (T0 + 1, "exited")})
    # The end was seen first (a coarse mtime): exited is never before saving.
    assert log_stage(0, facts, T0) == {"stage": "exited", "at": {"saving": T0 + 2, "exited": T0 + 2}}


def test_the_job_has_ended_only_when_every_rank_has_and_msrun_is_not_known_to_run():
    ended = {0: (T0, "finished"), 1: (T0, "process 7 is gone")}
    assert JobFacts(ended=ended).job_ended(2)
    assert not JobFacts(ended=ended, launcher_alive=True).job_ended(2)
    assert not JobFacts(ended={0: (T0, "finished")}).job_ended(2)
    assert not JobFacts().job_ended(0)


def test_a_log_stop_completes_by_the_bridges_rule_and_a_cancel_is_refused_once_saving(run_dir):
    stop = StopService(
        str(run_dir),
        AuditLog(str(runfiles.state_dir(run_dir) / "audit.sqlite3")),
        deadline_s=30,
        auto_rearm=True,
    )
    rid, *_ = stop.request("test", "tester", None)
    at = runfiles.read_flag(run_dir).raw["requested_at"]
    ranks = {0: None}
    saving = JobFacts(triggered={0: at + 1})
    status = stop.status(at + 2, StopInputs(ranks, 1, facts=saving))
    assert status["state"] == "stopping" and status["can_cancel"] is False
    done = JobFacts(triggered={0: at + 1}, ended={0: (at + 3, "exited")})
    stop.tick(inputs=StopInputs(ranks, 1, facts=done))
    status = stop.status(at + 4, StopInputs(ranks, 1, facts=done))
    assert status["state"] == "rearmed" and status["summary"].startswith("all 1 ranks stopped")
    assert runfiles.read_flag(run_dir).raw.get("outcome") is None
    assert [r["action"] for r in stop.audit.rows(limit=5)] == ["rearm", "complete", "request"]
