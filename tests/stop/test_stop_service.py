"""The stop service on real files and a real SQLite audit trail, driven by heartbeats."""

from __future__ import annotations

import json
import threading
import time

import pytest

from app.audit import AuditLog
from app.errors import StopRefused
from app.run.jobend import StopInputs
from app.stop.service import StopService
from trainer_bridge.rundir import runfiles


@pytest.fixture
def service(tmp_path):
    return StopService(str(tmp_path), AuditLog(tmp_path / "audit.sqlite3"), deadline_s=900, auto_rearm=True)


def hb(rank, rid=None, stage=None, stop_step=None, **at):
    stop = None
    if stage:
        stop = {
            "request_id": rid,
            "source": "flag",
            "stage": stage,
            "seen_step": 3,
            "stop_step": stop_step,
            "checkpoint": {
                "path": f"checkpoints/rank_{rank}/rankwatch-1_{stop_step}.ckpt",
                "bytes": 1000,
                "seconds": 0.5,
            }
            if stage in ("saved", "exited")
            else None,
            "at": at,
        }
    return {
        "rank": rank,
        "state": "exited" if stage == "exited" else "training",
        "stop": stop,
        "step_time_mean_ms": 100.0,
        "sync_every": 5,
    }


def test_request_writes_native_flag_and_audits(service, tmp_path):
    rid, created, *_ = service.request("npu 3 ECC", "alice", "127.0.0.1")
    flag = json.loads(runfiles.flag_path(tmp_path).read_text())
    assert created and flag["GracefulExit"] == 1 and flag["request_id"] == rid
    assert flag["reason"] == "npu 3 ECC" and flag["requested_by"] == "alice"
    [row] = service.audit.rows()
    assert (row["action"], row["who"], row["outcome"], row["request_id"]) == (
        "request",
        "alice",
        "accepted",
        rid,
    )


def test_concurrent_requests_make_one_request_and_two_audit_rows(service, tmp_path):
    results, barrier = [], threading.Barrier(2)

    def press(who):
        barrier.wait()
        results.append(service.request("same moment", who, "127.0.0.1"))

    threads = [threading.Thread(target=press, args=(w,)) for w in ("alice", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({rid for rid, *_ in results}) == 1
    assert sorted(created for _, created, *_ in results) == [False, True]
    rows = service.audit.rows()
    assert len(rows) == 2 and {r["outcome"].split(":")[0] for r in rows} == {"accepted", "duplicate"}


def test_lifecycle_and_summary(service):
    rid, *_ = service.request("r", "alice", None)
    t = time.time()
    ranks = {0: hb(0), 1: hb(1)}
    s = service.status(t, StopInputs(ranks, 2))
    assert s["state"] == "requested" and [r["stage"] for r in s["ranks"]] == ["requested"] * 2
    # Every rank at the same stage: nobody is behind anybody.
    assert s["can_cancel"] and s["holding_up"] == []
    assert service.status(t + 60, StopInputs(ranks, 2))["holding_up"] == []

    ranks = {0: hb(0, rid, "seen", seen=t), 1: hb(1)}
    s = service.status(t, StopInputs(ranks, 2))
    # Behind, but only just: a normal stop, no culprit yet.
    assert s["state"] == "stopping" and s["holding_up"] == [] and s["can_cancel"]
    assert service.status(t + service.follow.holding_after_s + 1, StopInputs(ranks, 2))["holding_up"] == [1]

    ranks = {0: hb(0, rid, "agreed", 8, agreed=t), 1: hb(1, rid, "saving", 8, saving=t)}
    s = service.status(t + service.follow.holding_after_s + 1, StopInputs(ranks, 2))
    assert not s["can_cancel"] and s["stop_step"] == 8 and s["holding_up"] == [0]

    ranks = {r: hb(r, rid, "exited", 8, exited=t + 2) for r in (0, 1)}
    s = service.status(t + 3, StopInputs(ranks, 2))
    assert s["state"] == "completed" and s["holding_up"] == []
    assert s["summary"].startswith("all 2 ranks stopped after step 8, 2 checkpoints, ")


def test_late_rank_is_flagged_after_the_deadline(tmp_path):
    service = StopService(str(tmp_path), AuditLog(tmp_path / "a.sqlite3"), deadline_s=10, auto_rearm=True)
    rid, *_ = service.request("r", "alice", None)
    now = time.time()
    ranks = {0: hb(0, rid, "saved", 4, saved=now), 1: hb(1)}
    assert service.status(now + 5, StopInputs(ranks, 2))["late"] == []
    assert service.status(now + 60, StopInputs(ranks, 2))["late"] == [0, 1]


def test_cancel_only_before_agreement(service, tmp_path):
    rid, *_ = service.request("r", "alice", None)
    with pytest.raises(StopRefused) as e:
        service.cancel("bob", None, "oops", StopInputs({0: hb(0, rid, "agreed", 4)}, 1))
    assert e.value.status == 409
    assert runfiles.read_flag(tmp_path).exit  # nothing changed

    assert service.cancel("bob", None, "oops", StopInputs({0: hb(0, rid, "seen")}, 1)) == rid
    flag = json.loads(runfiles.flag_path(tmp_path).read_text())
    assert flag["GracefulExit"] == 0 and flag["cancelled"] == rid
    assert service.status(time.time(), StopInputs({0: hb(0)}, 1))["state"] == "cancelled"
    outcomes = [(r["action"], r["outcome"].split(":")[0]) for r in service.audit.rows()]
    assert outcomes == [("cancel", "accepted"), ("cancel", "refused"), ("request", "accepted")]


def test_tick_records_completion_once_and_rearms(service, tmp_path):
    rid, *_ = service.request("r", "alice", None)
    done = {r: hb(r, rid, "exited", 8, exited=time.time()) for r in (0, 1)}
    service.tick(inputs=StopInputs({0: done[0], 1: hb(1, rid, "saved", 8)}, 2))
    assert runfiles.read_flag(tmp_path).exit  # not complete yet
    service.tick(inputs=StopInputs(done, 2))
    service.tick(inputs=StopInputs(done, 2))
    flag = json.loads(runfiles.flag_path(tmp_path).read_text())
    assert flag["GracefulExit"] == 0 and flag["rearmed_after"] == rid
    actions = [r["action"] for r in service.audit.rows()]
    assert actions == ["rearm", "complete", "request"]
    assert service.status(time.time(), StopInputs(done, 2))["state"] == "rearmed"
    # The measured save time feeds the next stop's estimate.
    assert service.estimate(StopInputs(done, 2))["save_s"] == 0.5


def test_after_a_relaunch_the_served_stop_is_the_last_stop_not_the_current_one(service, tmp_path):
    """Issue 17/21: after a stop, its re-arm and a relaunch, the panel said every rank was "requested"."""
    rid, *_ = service.request("npu 3 ECC", "alice", None)
    requested_at = json.loads(runfiles.flag_path(tmp_path).read_text())["requested_at"]
    done = {
        r: {**hb(r, rid, "exited", 8, exited=time.time()), "started_at": requested_at - 60} for r in (0, 1)
    }
    service.tick(inputs=StopInputs(done, 2))
    assert service.status(time.time(), StopInputs(done, 2))["state"] == "rearmed"
    # The relaunch: new processes, whose heartbeats carry no stop.
    relaunched = {r: {**hb(r), "started_at": requested_at + 5} for r in (0, 1)}
    status = service.status(time.time(), StopInputs(relaunched, 2))
    assert status["state"] == "idle" and status["request"] is None and status["ranks"] == []
    last = status["last_stop"]
    assert (last["request_id"], last["outcome"], last["reason"]) == (rid, "completed", "npu 3 ECC")
    # One rank of the earlier launch still reporting: the stop is still about this job.
    mixed = {0: relaunched[0], 1: done[1]}
    assert service.status(time.time(), StopInputs(mixed, 2))["state"] == "rearmed"


def test_rearm_refused_mid_stop_unless_forced(service, tmp_path):
    rid, *_ = service.request("r", "alice", None)
    ranks = {0: hb(0, rid, "saving", 3), 1: hb(1)}
    with pytest.raises(StopRefused) as e:
        service.rearm("bob", None, None, inputs=StopInputs(ranks, 2))
    assert e.value.status == 409 and runfiles.read_flag(tmp_path).exit
    service.rearm("bob", None, "rank 1 is dead", force=True, inputs=StopInputs(ranks, 2))
    assert not runfiles.read_flag(tmp_path).exit
    assert service.audit.rows()[0]["outcome"] == "accepted (forced before completion)"


def test_status_reports_an_unreadable_flag(service, tmp_path):
    runfiles.flag_path(tmp_path).write_text("{garbage")
    s = service.status(time.time(), StopInputs({}, 0))
    assert s["flag"] is None and "not valid JSON" in s["flag_error"]


def test_audit_survives_a_new_service(tmp_path):
    StopService(str(tmp_path), AuditLog(tmp_path / "a.sqlite3"), deadline_s=1, auto_rearm=False).request(
        "r", "alice", None
    )
    again = AuditLog(tmp_path / "a.sqlite3")
    assert [r["action"] for r in again.rows()] == ["request"]
    assert "".join(again.iter_csv()).splitlines()[0].startswith("id,at,action")


HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_stop_ending_while_another_observer_holds_the_lock_warns_of_nothing(service, tmp_path, caplog):
    """Issue 33, section 6: an ordinary `rankwatch stop` printed ".flag.lock held by another process for 0 s".

    At a stop's end the dashboard and the waiting CLI both record it; one of them
    holds the flag lock, and the other's one try finds it busy. That is no problem.
    """
    import subprocess
    import sys

    from app.stop.service import LOCK_NAME

    rid, *_ = service.request("r", "alice", None)
    done = {r: hb(r, rid, "exited", 8, exited=time.time()) for r in (0, 1)}
    lock = tmp_path / runfiles.STATE_DIR / LOCK_NAME
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with caplog.at_level("WARNING", logger="app.stop.service"):
            service.tick(inputs=StopInputs(done, 2))
    finally:
        holder.communicate("")
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
    assert [r["action"] for r in service.audit.rows()] == ["rearm", "complete", "request"]


def test_a_lock_file_that_is_not_a_file_is_still_warned_of(service, tmp_path, caplog):
    from app.stop.service import LOCK_NAME

    rid, *_ = service.request("r", "alice", None)
    done = {r: hb(r, rid, "exited", 8, exited=time.time()) for r in (0, 1)}
    lock = tmp_path / runfiles.STATE_DIR / LOCK_NAME
    lock.unlink(missing_ok=True)
    lock.mkdir()
    with caplog.at_level("WARNING", logger="app.stop.service"):
        service.tick(inputs=StopInputs(done, 2))
    assert any("no usable lock file" in r.getMessage() for r in caplog.records), caplog.records
