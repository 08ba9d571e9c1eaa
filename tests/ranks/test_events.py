"""Socket.IO events through Flask-SocketIO's test client, and the watcher's contract."""

from __future__ import annotations

import json
import threading
import time

from app.extensions import socketio
from app.run.state import RunState
from app.watcher import Watcher
from tests.helpers.app import TOKEN, wait_for_event, wait_for_index
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job


def test_connect_sends_a_snapshot_to_that_client_only(app, client, run_dir):
    write_job(run_dir, 2)
    write_heartbeat(run_dir, heartbeat(0, 2, seq=3))
    first = socketio.test_client(app, flask_test_client=client)
    snap = wait_for_event(first, "ranks_snapshot")
    assert snap["world_size"] == 2
    assert [(r["rank"], r["health"]) for r in snap["ranks"]] == [(0, "healthy"), (1, "pending")]
    assert snap["run"]["status"] == "starting"
    first.get_received()

    second = socketio.test_client(app, flask_test_client=client)
    wait_for_event(second, "ranks_snapshot")
    assert not [
        e
        for e in first.get_received()
        if e["name"] == "ranks_snapshot" and e["args"][0]["ranks"] == snap["ranks"]
    ]
    first.disconnect()
    second.disconnect()


def test_each_page_gets_only_its_own_events(app, client, run_dir):
    """The checkpoint browser is not sent rank deltas, nor the ranks page the checkpoint index."""
    write_job(run_dir, 2)
    write_heartbeat(run_dir, heartbeat(0, 2, seq=1))
    ranks = socketio.test_client(app, flask_test_client=client, auth={"page": "ranks"})
    ckpts = socketio.test_client(app, flask_test_client=client, auth={"page": "checkpoints"})
    anyone = socketio.test_client(app, flask_test_client=client)  # names no page: everything
    wait_for_index(ckpts)
    wait_for_index(anyone)
    names = {e["name"] for e in ranks.get_received()}
    assert {"ranks_snapshot", "stop_status"} <= names and "checkpoints" not in names

    write_heartbeat(run_dir, heartbeat(1, 2, seq=1, global_step=7))
    wait_for_event(ranks, "ranks_delta", shows(1, global_step=7))
    wait_for_event(anyone, ("ranks_snapshot", "ranks_delta"), shows(1, global_step=7))
    ckpt_file = run_dir / "checkpoints" / "rank_0" / "rankwatch-1_7.ckpt"
    ckpt_file.parent.mkdir(parents=True)
    ckpt_file.write_bytes(b"not a checkpoint")
    wait_for_index(ckpts, lambda body: body["sets"])
    wait_for_index(anyone, lambda body: body["sets"])
    assert not [e["name"] for e in ckpts.get_received() if e["name"].startswith("ranks_")]
    assert not [e["name"] for e in ranks.get_received() if e["name"] == "checkpoints"]
    for c in (ranks, ckpts, anyone):
        c.disconnect()


def shows(rank: int, **fields):
    """A predicate: the payload (snapshot or delta) has ``rank`` with these field values."""

    def check(payload):
        rows = payload.get("rows", payload.get("ranks", []))
        return any(r["rank"] == rank and all(r.get(k) == v for k, v in fields.items()) for r in rows)

    return check


def test_new_heartbeat_arrives_as_a_delta_of_changed_fields(sio, run_dir):
    wait_for_event(sio, "ranks_snapshot")
    write_heartbeat(run_dir, heartbeat(0, 2, seq=1, global_step=10))
    write_heartbeat(run_dir, heartbeat(1, 2, seq=1, global_step=10))
    # Only the watcher pushes after connect: once it showed rank 1, rank 1 was sent.
    wait_for_event(sio, ("ranks_snapshot", "ranks_delta"), shows(1, global_step=10))
    write_heartbeat(run_dir, heartbeat(1, 2, seq=2, global_step=20))
    delta = wait_for_event(sio, "ranks_delta", shows(1, global_step=20))
    row = next(r for r in delta["rows"] if r["rank"] == 1)
    assert "host" not in row and "pid" not in row
    assert "summary" in delta and "now" in delta


def test_a_silent_rank_turns_stalled_then_dead_over_the_socket(sio, run_dir):
    write_heartbeat(run_dir, heartbeat(0, 1, seq=1))
    stalled = wait_for_event(sio, "ranks_delta", shows(0, health="stalled"))
    assert stalled["summary"]["counts"]["stalled"] == 1
    dead = wait_for_event(sio, "ranks_delta", shows(0, health="dead"))
    assert "no heartbeat for over 4 s" in dead["rows"][0]["reason"]


def test_the_watcher_starts_once_for_many_clients(app, client):
    watcher = app.extensions["rankwatch"].watcher
    clients = [socketio.test_client(app, flask_test_client=client) for _ in range(3)]
    task = watcher._task
    assert task is not None and watcher.running
    clients.append(socketio.test_client(app, flask_test_client=client))
    assert watcher._task is task
    for c in clients:
        c.disconnect()


class FakeSocketIO:
    """Records what a Watcher does with Flask-SocketIO."""

    def __init__(self):
        self.started = 0
        self.emits = []
        self.rooms = []
        self.lock = threading.Lock()

    def start_background_task(self, target):
        with self.lock:
            self.started += 1
        return threading.Thread(target=target)  # never started: ticks are driven by hand

    def emit(self, event, payload, to=None, **kwargs):
        self.emits.append((event, payload))
        self.rooms.append(to)


def test_concurrent_starts_start_one_task(run_dir, app):
    fake = FakeSocketIO()
    watcher = Watcher(fake, RunState(run_dir, app.config), 0.5)
    threads = [threading.Thread(target=watcher.ensure_started) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake.started == 1


def test_each_tick_emits_at_most_one_event(run_dir, app):
    fake = FakeSocketIO()
    now = [time.time()]
    watcher = Watcher(fake, RunState(run_dir, app.config), 0.5, clock=lambda: now[0])
    for r in range(50):
        write_heartbeat(run_dir, heartbeat(r, 50, seq=1, now=now[0]))
    watcher.tick()
    # Clients took a snapshot when they connected: the first tick is a delta too.
    assert [e for e, _ in fake.emits] == ["ranks_delta"]
    assert len(fake.emits[0][1]["rows"]) == 50
    watcher.tick()
    assert len(fake.emits) == 1, "nothing changed, nothing sent"
    for r in range(0, 50, 10):
        write_heartbeat(run_dir, heartbeat(r, 50, seq=2, now=now[0] + 0.2))
    now[0] += 0.25
    watcher.tick()
    event, payload = fake.emits[-1]
    assert event == "ranks_delta" and len(fake.emits) == 2
    assert [row["rank"] for row in payload["rows"]] == [0, 10, 20, 30, 40]


def test_a_checkpoint_page_that_missed_a_push_gets_the_whole_index_as_the_ack(app, client, run_dir):
    ckpt_file = run_dir / "checkpoints" / "rank_0" / "rankwatch-1_7.ckpt"
    ckpt_file.parent.mkdir(parents=True)
    ckpt_file.write_bytes(b"not a checkpoint")
    ckpts = socketio.test_client(app, flask_test_client=client, auth={"page": "checkpoints"})
    held = wait_for_index(ckpts, lambda body: body["sets"])
    ack = ckpts.emit("checkpoints_index", callback=True)
    assert [s["id"] for s in ack["sets"]] == [s["id"] for s in held["sets"]]
    assert isinstance(ack["version"], int) and ack["version"] >= held["version"]
    # A viewer's ack names no absolute path, as its pushes do not (issue 32, P11); an operator's does.
    assert str(run_dir) not in json.dumps(ack)
    ckpts.disconnect()
    auth = {"page": "checkpoints", "token": TOKEN}
    operator = socketio.test_client(app, flask_test_client=client, auth=auth)
    wait_for_index(operator, lambda body: body["sets"])
    assert str(run_dir) in json.dumps(operator.emit("checkpoints_index", callback=True))
    operator.disconnect()
