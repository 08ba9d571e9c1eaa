"""attempts.jsonl without MindSpore: the reader against garbage, the fold, the writer against a bad
file, what a launch's heartbeats say about its end, and which ranks count as another live launch.

The msrun side (launch, stop, relaunch, pinned relaunch, a refused second launch) is
tests/ranks/test_attempts_msrun.py.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time

import pytest

from app.audit import AuditLog
from app.run.jobend import JobFacts, StopInputs
from app.stop.service import StopService
from tests.helpers.heartbeats import HOST, heartbeat, write_heartbeat
from trainer_bridge.rundir import attempts, launchguard, runfiles, schema
from trainer_bridge.saving import ResumePoint


def start(n: int, launch: str, **extra) -> dict:
    rec = {
        "kind": "start",
        "attempt": n,
        "launch": launch,
        "started_at": 1.7e9 + n,
        "world_size": 2,
        "hosts": ["a"],
        "first_step": 1,
    }
    return rec | extra


def end(n: int, launch: str, **extra) -> dict:
    return {"kind": "end", "attempt": n, "launch": launch, "end": "finished", "last_step": 10} | extra


def write_lines(run_dir, lines: list) -> None:
    path = runfiles.attempts_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for ln in lines:
            f.write((ln if isinstance(ln, bytes) else json.dumps(ln).encode()) + b"\n")


def test_reader_skips_garbage_and_folds_the_rest(tmp_path):
    write_lines(
        tmp_path,
        [
            start(1, "aaa"),
            b"\x00\xff\xfe not json at all",
            b'{"kind": "start", "attempt": 2',  # a torn append
            b"[" * 100_000,  # nesting past the line bound and the parser's depth
            b'"a string"',
            b"{}",
            {"kind": "teapot", "attempt": 1, "launch": "aaa"},
            start(2, "bbb", world_size=-3),  # out of range: not a start line
            start(2, "bbb", attempt=True),  # true is not an int
            end(7, "zzz"),  # no start line for it
            end(1, "other", end="failed"),  # another launch's line for attempt 1
            end(1, "aaa", end="graceful_stop", request_id="r1", requested_by="policy", last_step=40),
            start(2, "bbb", resumed_from={"set": "s40", "global_step": 40}, first_step=41),
            {"kind": "hosts", "attempt": 2, "launch": "bbb", "hosts": ["a", "b"], "host_count": 2},
            b"x" * (attempts.MAX_LINE_BYTES + 10),
        ],
    )
    records, skipped = attempts.read_lines(tmp_path)
    assert skipped == 9  # the two lines for attempts 7 and "other" are valid, and ignored by the fold
    rows = attempts.fold(records)
    assert [r["attempt"] for r in rows] == [1, 2]
    first, second = rows
    assert first["end"] == "graceful_stop" and first["request_id"] == "r1" and first["last_step"] == 40
    assert first["stop_by"] == "policy"
    assert second["end"] is None and second["hosts"] == ["a", "b"]
    assert second["resumed_from"] == {"set": "s40", "global_step": 40} and second["first_step"] == 41


def test_reader_reads_a_bounded_tail(tmp_path):
    """A file far past the bound: only its newest bytes are read; the cut line is dropped."""
    lines = []
    for n in range(1, 20_001):
        lines += [start(n, f"l{n}"), end(n, f"l{n}", last_step=n)]
    write_lines(tmp_path, lines)
    assert runfiles.attempts_path(tmp_path).stat().st_size > 4 * attempts.MAX_TAIL_BYTES
    records, skipped = attempts.read_lines(tmp_path)
    assert skipped == 0
    rows = attempts.fold(records)
    assert rows[-1]["attempt"] == 20_000 and rows[-1]["end"] == "finished"
    assert len(rows) <= attempts.MAX_ATTEMPTS
    assert [r["attempt"] for r in rows] == list(range(rows[0]["attempt"], 20_001))


def test_reader_and_writer_refuse_a_fifo_without_blocking(tmp_path, caplog):
    path = runfiles.attempts_path(tmp_path)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    try:
        attempts.read_lines(tmp_path)
    except OSError:
        pass
    else:
        raise AssertionError("a FIFO read as attempts")
    log = attempts.AttemptLog(tmp_path, "abc", 2, HOST, os.getpid())
    log.begin(started_at=time.time(), resumed=None, first_step=1, beats=[])
    log.end(state="finished", last_step=3, stop=None, error=None, flag_raw=None)
    assert log.number is None  # nothing written, nothing raised
    assert "attempts.jsonl" in caplog.text


@pytest.fixture
def full_state_dir(tmp_path):
    """``RUN/rankwatch`` as a tiny tmpfs filled to ENOSPC (root only), with a valid attempt 1 in it."""
    state = runfiles.state_dir(tmp_path)
    state.mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(state)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        write_lines(tmp_path, [start(1, "one"), end(1, "one")])
        # Up to a page boundary: tmpfs would take a short append into the file's last page.
        path = runfiles.attempts_path(tmp_path)
        with open(path, "ab") as f:
            f.write(b"#" * (4095 - path.stat().st_size) + b"\n")
        fd = os.open(state / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)
        yield tmp_path
    finally:
        subprocess.run(["umount", str(state)], capture_output=True)


def test_writer_on_a_full_disk_logs_once_and_goes_on(full_state_dir, caplog):
    log = attempts.AttemptLog(full_state_dir, "two", 2, HOST, os.getpid())
    log.begin(started_at=time.time(), resumed=None, first_step=1, beats=[])
    log.end(state="finished", last_step=3, stop=None, error=None, flag_raw=None)
    log.end(state="failed", last_step=3, stop=None, error="x", flag_raw=None)
    assert log.number is None
    said = [r.getMessage() for r in caplog.records if "attempts.jsonl" in r.getMessage()]
    assert len(said) == 1 and "No space left" in said[0], said
    assert [r["attempt"] for r in attempts.fold(attempts.read_lines(full_state_dir)[0])] == [1]


def test_roll_call_writes_the_hosts_once_every_rank_reported(tmp_path):
    log = attempts.AttemptLog(tmp_path, "two", 3, HOST, os.getpid())
    log.begin(started_at=time.time(), resumed=None, first_step=1, beats=[])
    write_heartbeat(tmp_path, heartbeat(1, 3, launch="two", host="node-b"))
    write_heartbeat(tmp_path, heartbeat(2, 3, launch="old", host="node-c"))  # not this launch's yet
    log.roll_call()
    assert attempts.fold(attempts.read_lines(tmp_path)[0])[0]["hosts"] == [HOST]
    write_heartbeat(tmp_path, heartbeat(2, 3, launch="two", host="node-c"))
    log.roll_call()
    log.roll_call()
    records, _ = attempts.read_lines(tmp_path)
    assert [r["kind"] for r in records] == ["start", "hosts"]
    row = attempts.fold(records)[0]
    assert row["hosts"] == sorted([HOST, "node-b", "node-c"]) and row["host_count"] == 3


def test_writer_numbers_seals_a_silent_attempt_and_reports_the_replay(tmp_path):
    """Attempt 1 wrote no end line and left heartbeats at step 30: attempt 2 seals it as killed."""
    write_lines(tmp_path, [start(1, "one")])
    beats = [(r, heartbeat(r, 2, global_step=30 + r, launch="one", now=time.time() - 100)) for r in range(2)]
    log = attempts.AttemptLog(tmp_path, "two", 2, HOST, os.getpid())
    point = ResumePoint(20, 1, tmp_path / "x.ckpt", "set-20")
    log.begin(started_at=time.time(), resumed=point, first_step=21, beats=beats)
    assert log.number == 2 and log.replayed == [21, 31]
    log.end(
        state="exited",
        last_step=25,
        stop={"request_id": "req-9", "source": "flag"},
        error=None,
        flag_raw={"requested_by": "alice"},
    )
    rows = attempts.fold(attempts.read_lines(tmp_path)[0])
    assert rows[0]["end"] == "killed" and rows[0]["last_step"] == 31 and rows[0]["sealed_by"] == 2
    assert rows[1]["resumed_from"] == {"set": "set-20", "global_step": 20}
    assert rows[1]["replayed"] == [21, 31] and rows[1]["previous_last_step"] == 31
    assert rows[1]["end"] == "graceful_stop" and rows[1]["stop_by"] == "operator"
    assert rows[1]["request_id"] == "req-9" and rows[1]["last_step"] == 25


def test_a_refused_launch_is_a_line_of_its_own_never_an_attempt(tmp_path, client, run_dir):
    """Refused lines sit between attempts' lines: the writer's numbering and the fold ignore them."""
    write_lines(tmp_path, [start(1, "one"), end(1, "one")])
    assert attempts.note_refusal(tmp_path, "rankwatch: refusing to start: rank 0 (pid 7)", 2, HOST, 4242)
    log = attempts.AttemptLog(tmp_path, "two", 2, HOST, os.getpid())
    log.begin(started_at=time.time(), resumed=None, first_step=1, beats=[])
    assert log.number == 2
    records, skipped = attempts.read_lines(tmp_path)
    assert skipped == 0 and [r["kind"] for r in records] == ["start", "end", "start"]
    everything, _ = attempts.read_lines(tmp_path, with_refused=True)
    (refused,) = attempts.refused(everything)
    assert refused["pid"] == 4242 and refused["reason"].endswith("rank 0 (pid 7)")
    assert [r["attempt"] for r in attempts.fold(everything)] == [1, 2]
    # A refusal longer than the schema allows is cut, not lost; the page's answer carries it.
    assert attempts.note_refusal(run_dir, "x" * 10_000, 2, HOST, 4243)
    body = client.get("/api/attempts").get_json()
    (told,) = body["refused"]
    assert told["pid"] == 4243 and len(told["reason"]) == schema.MAX_ERROR


def test_outcome_of_heartbeats():
    hb = lambda r, state, **kw: heartbeat(r, 2, state=state, **kw)  # noqa: E731
    assert attempts.outcome([])["end"] == "unknown"
    failed = attempts.outcome([hb(0, "training"), hb(1, "failed", error="ValueError: boom")])
    assert failed["end"] == "failed" and failed["error"] == "rank 1: ValueError: boom"
    assert attempts.outcome([hb(0, "training"), hb(1, "exited")])["end"] == "killed"
    stop = {"request_id": "r", "source": "flag", "stage": "exited", "stop_step": 5}
    done = attempts.outcome([hb(0, "exited", stop=stop), hb(1, "exited", stop=stop)])
    assert done["end"] == "graceful_stop" and done["request_id"] == "r"
    assert attempts.outcome([hb(0, "finished"), hb(1, "finished")])["end"] == "finished"


def test_live_ranks_of_another_launch():
    """Alive: not ended, fresh, and on this host a running process (a real one, and a real dead one)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now = time.time()
    beats = [
        (0, heartbeat(0, 6, launch="other")),  # this process: alive
        (1, heartbeat(1, 6, launch="other", pid=dead.pid)),  # its process is gone
        (2, heartbeat(2, 6, launch="other", state="exited")),  # said it ended
        (3, heartbeat(3, 6, launch="other", host="elsewhere", now=now - 5)),  # another host, fresh
        (4, heartbeat(4, 6, launch="other", host="elsewhere", now=now - launchguard.LIVE_AGE_S - 5)),
        (5, heartbeat(5, 6, launch="mine")),  # this launch's own
    ]
    live = launchguard.live_ranks(beats, own_launch="mine", host=HOST, now=now)
    assert [r.rank for r in live] == [0, 3]
    # This very process's earlier run (an interrupted notebook cell) is not another launch.
    mine = launchguard.live_ranks(beats, own_launch="mine", host=HOST, now=now, own_pid=os.getpid())
    assert [r.rank for r in mine] == [3]
    message = launchguard.refusal("/runs/x", live)
    assert f"rank 0 (pid {os.getpid()} on {HOST}" in message and "rank 3 (pid" in message
    assert "on elsewhere, heartbeat 5." in message and "/runs/x" in message


def test_read_heartbeats_skips_bad_files(tmp_path):
    write_heartbeat(tmp_path, heartbeat(0, 2, launch="x"))
    sdir = runfiles.state_dir(tmp_path)
    (sdir / "rank_1.json").write_text("{not json")
    (sdir / "rank_2.json").write_text(json.dumps(heartbeat(5, 6)))  # names another rank
    os.mkfifo(sdir / "rank_3.json")
    (sdir / "rank_4.json").symlink_to(sdir / "rank_0.json")
    beats = launchguard.read_heartbeats(tmp_path)
    assert [r for r, _ in beats] == [0]
    assert schema.Heartbeat.model_fields["launch"].default is None


# ------------------------------------------------------------------ the dashboard


def test_api_attempts_judges_the_newest_from_its_heartbeats(client, run_dir):
    """The newest attempt wrote no end line: live, its last step follows the heartbeats; its ranks
    gone (a real dead process) and no msrun, it is killed. Garbage lines are counted, not fatal."""
    write_lines(run_dir, [start(1, "one"), end(1, "one", end="failed", error="rank 1: OOM"), b"\x00garbage"])
    write_lines_more = runfiles.attempts_path(run_dir).open("ab")
    write_lines_more.write(json.dumps(start(2, "two", first_step=1)).encode() + b"\n")
    write_lines_more.close()
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2, global_step=12 + r, launch="two"))
    body = client.get("/api/attempts").get_json()
    assert body["skipped_lines"] == 1
    first, second = body["attempts"]
    assert first["end"] == "failed" and first["error"] == "rank 1: OOM" and first["stop_by"] is None
    assert second["end"] is None and second["last_step"] == 13 and second["resumed_text"] == "a fresh start"
    rank = client.get("/api/ranks/0").get_json()["rank"]
    assert rank["launch"] == "two" and rank["resumed_from"] is None

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    resumed = {"global_step": 10, "epoch": 1, "path": "checkpoints/rank_0/x.ckpt", "set": "bridge:10"}
    for r in range(2):
        write_heartbeat(
            run_dir,
            heartbeat(
                r,
                2,
                seq=2,
                global_step=14,
                launch="two",
                pid=dead.pid,
                now=time.time() - 60,
                resumed_from=resumed,
            ),
        )
    deadline = time.monotonic() + 60
    while True:
        second = client.get("/api/attempts").get_json()["attempts"][1]
        if second["end"] is not None or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert second["end"] == "killed" and second["last_step"] == 14 and "heartbeats" in second["inferred"]
    rank = client.get("/api/ranks/1").get_json()["rank"]
    assert rank["resumed_from"] == "resumed from global step 10 (set bridge:10)"


def test_an_attempt_says_its_resume_in_words_and_keeps_the_set_id_apart(client, run_dir):
    """The attempts list said "(set checkpoints/rank_{rank}/rankwatch-9_15.ckpt#g495)" to a newcomer."""
    set_id = "checkpoints/rank_{rank}/rankwatch-9_15.ckpt#g495"
    write_lines(run_dir, [start(1, "one"), end(1, "one", end="graceful_stop", last_step=495)])
    with runfiles.attempts_path(run_dir).open("ab") as f:
        resumed = {"set": set_id, "global_step": 495}
        f.write(json.dumps(start(2, "two", first_step=496, resumed_from=resumed)).encode() + b"\n")
    second = client.get("/api/attempts").get_json()["attempts"][1]
    assert second["resumed_text"] == "resumed from global step 495"
    assert second["resumed_from"]["set"] == set_id  # the page's tooltip, the API's detail


def _launch_of(client, rank: int, launch: str) -> None:
    deadline = time.monotonic() + 30
    while client.get(f"/api/ranks/{rank}").get_json()["rank"]["launch"] != launch:
        assert time.monotonic() < deadline, f"rank {rank} never showed launch {launch}"
        time.sleep(0.1)


def test_two_live_launches_are_said_loudly(client, run_dir):
    """Ranks of two launches alive at once (this process stands for both): the run status says so,
    side by side and taking turns at one file; a relaunch (one launch after the other) does not."""
    write_heartbeat(run_dir, heartbeat(0, 2, launch="aaa"))
    write_heartbeat(run_dir, heartbeat(1, 2, launch="aaa"))
    _launch_of(client, 1, "aaa")
    write_heartbeat(run_dir, heartbeat(0, 2, seq=2, launch="bbb"))  # a relaunch reaches rank 0 first
    _launch_of(client, 0, "bbb")
    run = client.get("/api/summary").get_json()["run"]
    assert run["status"] == "conflict" and "launch aaa: rank 1" in run["message"]
    assert "launch bbb: rank 0" in run["message"]
    write_heartbeat(run_dir, heartbeat(1, 2, seq=2, launch="bbb"))  # ...then rank 1: one launch again
    _launch_of(client, 1, "bbb")
    assert (
        client.get("/api/summary").get_json()["run"]["message"].endswith("s ago)")
    )  # still said, for a while

    fresh = client.application.extensions["rankwatch"].state
    fresh._launches = type(fresh._launches)()  # forget what was seen: a relaunch alone is no conflict
    write_heartbeat(run_dir, heartbeat(0, 2, seq=3, launch="ccc"))
    write_heartbeat(run_dir, heartbeat(1, 2, seq=3, launch="ccc"))
    _launch_of(client, 0, "ccc")
    _launch_of(client, 1, "ccc")
    assert client.get("/api/summary").get_json()["run"]["status"] == "running"

    # Two jobs taking turns at rank 0's file: ccc, ddd, ccc.
    write_heartbeat(run_dir, heartbeat(0, 2, seq=4, launch="ddd"))
    _launch_of(client, 0, "ddd")
    write_heartbeat(run_dir, heartbeat(0, 2, seq=5, launch="ccc"))
    _launch_of(client, 0, "ccc")
    run = client.get("/api/summary").get_json()["run"]
    assert run["status"] == "conflict" and "went from launch ddd to ccc and back" in run["message"]


def test_a_late_dashboard_credits_the_stop_to_the_attempt_that_served_it(tmp_path):
    """The dashboard was down while attempt 1 stopped for req-x; attempt 2 (resumed, the flag still
    says stop, which the bridge knows is served) is what it sees: the stop is attempt 1's, completed,
    not "not obeyed" by attempt 2, and the flag is re-armed."""
    service = StopService(
        str(tmp_path), AuditLog(tmp_path / "audit.sqlite3"), deadline_s=900, auto_rearm=True
    )
    rid, *_ = service.request("npu 3 ECC", "alice", None)
    requested_at = json.loads(runfiles.flag_path(tmp_path).read_text())["requested_at"]
    write_lines(
        tmp_path,
        [
            start(1, "one"),
            end(1, "one", end="graceful_stop", request_id=rid, requested_by="alice"),
            start(2, "two", first_step=9),
        ],
    )
    later = {r: heartbeat(r, 2, launch="two", started_at=requested_at + 5) for r in (0, 1)}
    status = service.status(time.time(), StopInputs(later, 2))
    assert status["state"] == "idle" and status["request"] is None
    last = status["last_stop"]
    assert (last["request_id"], last["outcome"], last["attempt"]) == (rid, "completed", 1)
    service.tick(
        inputs=StopInputs(
            later, 2, facts=JobFacts(ended={0: (time.time(), "gone"), 1: (time.time(), "gone")})
        )
    )
    rows = service.audit.rows()
    assert [r["action"] for r in rows] == ["rearm", "complete", "request"]
    assert rows[1]["outcome"].startswith("completed: attempt 1, an earlier launch")
    assert not runfiles.read_flag(tmp_path).exit
