"""The stack API on real files: read, ask (bridge or py-spy), refuse with a reason, group across ranks.

A "rank with the bridge" here is the test process itself: it writes a
heartbeat in the bridge's format and runs a real ``StackWatcher``, as a
rank's reporter does. A rank the bridge cannot answer for is a real child
process, stopped with SIGSTOP, that py-spy reads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from app.incidents.stacks import describe, route
from app.run.heartbeats import Stopped
from tests.helpers.app import operator, wait_for
from tests.helpers.heartbeats import HOST, heartbeat, write_heartbeat, write_job
from tests.helpers.incidents import COLLECTIVE, HANGER, HUNG, WAITING, fake_capture
from trainer_bridge import stacks
from trainer_bridge.rundir import runfiles, stackfiles


def row(**fields) -> dict:
    return {"rank": 0, "health": "healthy", "host": "a", "pid": 42, "source": "bridge", **fields}


# ------------------------------------------------------------------ who captures


def test_route_says_who_can_capture_and_why_not():
    kw = {"hostname": "a", "pyspy": True}
    assert route(0, row(), None, **kw)[0] == "bridge"
    assert route(0, row(host="b"), None, **kw)[0] == "bridge"  # files reach any node
    stopped = Stopped("process 42 is stopped (SIGSTOP or a debugger; kill -CONT 42 resumes it)")
    via, why = route(0, row(health="stalled"), stopped, **kw)
    assert via == "py-spy" and "stopped" in why
    assert route(0, row(source="log"), None, **kw)[0] == "py-spy"
    via, why = route(0, row(source="log", host="b"), None, **kw)
    assert via is None and "runs on b" in why and "py-spy dump --pid 42" in why
    via, why = route(0, row(health="dead", host="b"), None, **kw)
    assert via is None and "dead" in why and "run `py-spy dump --pid 42` on b" in why
    via, why = route(0, row(health="dead"), "process 42 is gone", **kw)
    assert via is None and "process 42 is gone" in why
    via, why = route(0, row(source="log"), None, hostname="a", pyspy=False)
    assert via is None and "pip install py-spy" in why
    assert route(0, row(health="exited"), None, **kw)[0] is None
    assert route(0, None, None, **kw)[0] is None


# ------------------------------------------------------------------ reading and asking


def test_get_is_404_in_the_error_shape_until_a_capture_exists(client, run_dir):
    write_job(run_dir, 1)
    write_heartbeat(run_dir, heartbeat(0, 1))
    r = client.get("/api/ranks/0/stack")
    assert r.status_code == 404
    body = r.get_json()
    assert body["status"] == 404 and "no stack capture of rank 0" in body["error"]


def test_post_needs_the_token_and_a_json_body(client, run_dir):
    write_job(run_dir, 1)
    write_heartbeat(run_dir, heartbeat(0, 1))
    r = client.post("/api/ranks/0/stack", json={})
    assert r.status_code == 401 and r.get_json()["status"] == 401
    assert not runfiles.stack_request_path(run_dir, 0).exists()
    assert client.post("/api/ranks/0/stack", data="x", headers=operator()).status_code == 415
    assert client.post("/api/ranks/0/stack", json={"native": "yes"}, headers=operator()).status_code == 400
    assert client.post("/api/ranks/7/stack", json={}, headers=operator()).status_code == 404
    assert client.post("/api/stacks", json={}).status_code == 401


def test_a_bridge_rank_answers_a_post_through_the_run_directory(client, run_dir):
    write_job(run_dir, 1)
    write_heartbeat(run_dir, heartbeat(0, 1))  # this process, on this host
    watcher = stacks.StackWatcher(run_dir, 0, HOST)
    r = client.post("/api/ranks/0/stack", json={"who": "alice"}, headers=operator())
    assert r.status_code == 202
    ask = r.get_json()
    assert ask["via"] == "bridge" and ask["requested_by"] == "alice"
    pending = client.get("/api/ranks/0/stack")
    assert pending.status_code == 404 and "requested" in pending.get_json()["error"]

    watcher.poll(steps=3, since_step_s=0.1, step_s=0.05, global_step=3, stepping=True)

    def answered():
        got = client.get("/api/ranks/0/stack")
        return got.status_code == 200 and got.get_json()

    body = wait_for(answered, "the capture")
    assert body["request_id"] == ask["request_id"] and body["pending"] is None
    assert {"rank", "captured_at", "source", "trigger", "text", "threads"} <= set(body)
    assert body["source"] == "bridge" and body["trigger"] == "request" and not body["stale"]
    assert body["threads"][0]["training"]
    assert client.get("/api/ranks/0/stack?trigger=stall").status_code == 404
    assert client.get("/api/ranks/0/stack?trigger=nope").status_code == 400


@pytest.fixture
def stopped_rank(run_dir):
    """A real process on this host, stuck in hang_here and SIGSTOPped, with a bridge heartbeat."""
    # Named as a rank of this run on its command line, as a job's script is (app.incidents.proof).
    proc = subprocess.Popen(
        [sys.executable, "-c", HANGER, "--run-dir", str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    write_job(run_dir, 2)
    started = psutil.Process(proc.pid).create_time()
    write_heartbeat(run_dir, heartbeat(0, 2))
    write_heartbeat(run_dir, heartbeat(1, 2, pid=proc.pid, started_at=started))
    os.kill(proc.pid, signal.SIGSTOP)
    yield proc
    os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.wait()


def test_a_stopped_rank_is_captured_by_pyspy(client, run_dir, stopped_rank):
    # The dashboard's process probe has to see the process stopped first.
    wait_for(
        lambda: client.get("/api/ranks").get_json()["ranks"][1]["health"] == "stalled",
        "rank 1 to be found stopped",
    )
    r = client.post("/api/ranks/1/stack", json={"native": True}, headers=operator())
    assert r.status_code == 202, r.get_json()
    assert r.get_json()["via"] == "py-spy" and "stopped" in r.get_json()["why"]

    def answered():
        got = client.get("/api/ranks/1/stack")
        return got.status_code == 200 and got.get_json()

    body = wait_for(answered, "the py-spy capture")
    assert body["source"] == "py-spy" and body["pid"] == stopped_rank.pid
    assert body["threads"][0]["training"] and body["threads"][0]["frames"][0]["function"] == "hang_here"
    # A stopped process cannot be paused to unwind native frames; the capture says it has none.
    assert body["native"] == "off"
    assert "hang_here" in body["text"]


def test_a_rank_nobody_can_capture_gets_409_with_the_reason(client, run_dir):
    write_job(run_dir, 1)
    now = time.time()
    write_heartbeat(run_dir, heartbeat(0, 1, host="node-b", pid=4242, now=now - 60))  # dead, elsewhere
    r = client.post("/api/ranks/0/stack", json={}, headers=operator())
    assert r.status_code == 409
    error = r.get_json()["error"]
    assert "node-b" in error and "py-spy dump --pid 4242" in error


def test_post_all_writes_one_request_and_says_who_cannot_answer(client, run_dir):
    write_job(run_dir, 3)
    write_heartbeat(run_dir, heartbeat(0, 3))
    write_heartbeat(run_dir, heartbeat(1, 3))
    r = client.post("/api/stacks", json={}, headers=operator())
    assert r.status_code == 202
    body = r.get_json()
    assert body["bridge"] == [0, 1] and list(body["cannot"]) == ["2"]
    assert stackfiles.read_request(run_dir, None).request_id == body["request_id"]


# ------------------------------------------------------------------ grouping


def test_grouping_reads_like_a_diagnosis(client, run_dir):
    write_job(run_dir, 10)
    for r in range(10):
        write_heartbeat(run_dir, heartbeat(r, 10))
    for r in range(8):
        if r == 1:
            fake_capture(run_dir, r, HUNG)
        else:
            fake_capture(run_dir, r, WAITING, COLLECTIVE)
    body = client.get("/api/stacks").get_json()
    assert body["captured"] == 8 and body["missing"] == [8, 9]
    assert body["text"] == (
        "rank 1 in `hang_here` (train.py:42); "
        "ranks 0, 2-7 waiting in `AllReduce` under `_CellGraphExecutor._exec_pip` "
        "(mindspore/graph/api.py:2432), called from `main` (train.py:230); "
        "ranks 8-9: no capture yet"
    )
    first, second = body["groups"]
    assert first["ranks"] == [1] and second["ranks"] == [0, 2, 3, 4, 5, 6, 7]
    assert second["thread"]["native"][1]["function"].endswith("AllReduce<float>")


def test_a_capture_from_before_the_rank_started_is_stale(client, run_dir):
    write_job(run_dir, 1)
    write_heartbeat(run_dir, heartbeat(0, 1))
    fake_capture(run_dir, 0, HUNG, at=1_000_000.0)
    body = client.get("/api/ranks/0/stack").get_json()
    assert body["stale"] is True
    assert client.get("/api/stacks").get_json()["missing"] == [0]


def test_describe_without_native_frames_names_the_user_frame():
    thread = {"frames": [{"function": f, "file": p, "line": n} for f, p, n in WAITING], "native": []}
    assert describe(thread) == (
        "in `_CellGraphExecutor._exec_pip` (mindspore/graph/api.py:2432), called from `main` (train.py:230)"
    )
