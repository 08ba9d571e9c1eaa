"""The windowed ranks page (app/ranks/window.py) through Flask-SocketIO's test client, and ``?sort=worst``."""

from __future__ import annotations

import pytest

from app.extensions import socketio
from tests.helpers.app import make_app, wait_for_event
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job

RANKS = 10


@pytest.fixture
def windowed(run_dir):
    """A dashboard that windows any job above 4 ranks, on a job of 10 that reported."""
    write_job(run_dir, RANKS)
    for r in range(RANKS):
        write_heartbeat(run_dir, heartbeat(r, RANKS, seq=1))
    app = make_app(run_dir, PAGE_WINDOW_RANKS=4)
    yield app
    app.extensions["rankwatch"].watcher.stop()


def connect(app):
    return socketio.test_client(app, flask_test_client=app.test_client(), auth={"page": "ranks"})


def test_a_windowed_client_gets_its_window_only_and_its_changes(windowed, run_dir):
    sio = connect(windowed)
    snap = wait_for_event(sio, "ranks_snapshot")
    assert snap["window"] == {
        "page": 1,
        "per_page": 100,
        "total": RANKS,
        "pages": 1,
        "health": [],
        "sort": "rank",
    }
    assert snap["summary"]["world_size"] == RANKS

    assert sio.emit("ranks_view", {"page": 2, "per_page": 3}, callback=True) == {"ok": True}
    snap = wait_for_event(sio, "ranks_snapshot", lambda p: p["window"]["page"] == 2)
    assert [r["rank"] for r in snap["ranks"]] == [3, 4, 5]
    assert snap["window"]["pages"] == 4

    # Rank 8 (outside the window) changes first, then rank 4 (inside): the
    # delta that brings rank 4's change carries nothing of rank 8, nor did any before it.
    write_heartbeat(run_dir, heartbeat(8, RANKS, seq=2, state="failed"))
    write_heartbeat(run_dir, heartbeat(4, RANKS, seq=2, state="failed"))
    seen = []

    def both_seen(payload):
        # The summary counts the job, not the window: both failed ranks.
        seen.append(payload)
        rows = [r for p in seen for r in p.get("rows", ())]
        counts = [p["summary"]["counts"].get("failed") for p in seen if "summary" in p]
        return any(r["rank"] == 4 and r.get("health") == "failed" for r in rows) and 2 in counts

    wait_for_event(sio, "ranks_delta", both_seen)
    assert {r["rank"] for p in seen for r in p.get("rows", ())} <= {3, 4, 5}
    windows = windowed.extensions["rankwatch"].watcher.windows
    assert len(windows.sids()) == 1
    sio.disconnect()
    assert windows.sids() == []


def test_the_window_filters_and_sorts_on_the_server(windowed, run_dir):
    write_heartbeat(run_dir, heartbeat(7, RANKS, seq=2, state="failed"))
    sio = connect(windowed)
    wait_for_event(sio, "ranks_snapshot")
    assert sio.emit("ranks_view", {"per_page": 2, "sort": "worst"}, callback=True) == {"ok": True}
    snap = wait_for_event(sio, "ranks_snapshot", lambda p: p["window"]["sort"] == "worst")
    assert [(r["rank"], r["health"]) for r in snap["ranks"]] == [(7, "failed"), (0, "healthy")]

    assert sio.emit("ranks_view", {"health": ["failed"], "page": 9}, callback=True) == {"ok": True}
    snap = wait_for_event(sio, "ranks_snapshot", lambda p: p["window"]["health"] == ["failed"])
    # A page past the last is the last.
    assert [r["rank"] for r in snap["ranks"]] == [7]
    assert (snap["window"]["page"], snap["window"]["total"]) == (1, 1)

    # A rank that turns failed joins the filtered window: its row comes with the new order.
    write_heartbeat(run_dir, heartbeat(2, RANKS, seq=2, state="failed"))
    delta = wait_for_event(sio, "ranks_delta", lambda p: "window" in p)
    assert delta["window"]["order"] == [2, 7]
    assert delta["window"]["total"] == 2
    assert [r["rank"] for r in delta["rows"]] == [2]
    assert delta["rows"][0]["health"] == "failed"
    sio.disconnect()


@pytest.mark.parametrize(
    "payload, says",
    [
        ({"per_page": 5000}, "'per_page' may be at most 200"),
        ({"sort": "loss"}, "'sort' must be rank or worst"),
        ({"health": ["sad"]}, "unknown verdict sad"),
        ({"page": 0}, "'page' must be a positive integer"),
        ({"page": {str(i): i for i in range(100)}}, "'page' must be a positive integer"),
        ({"health": [1]}, "'health'"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_a_bad_window_is_refused_with_the_error_shape(windowed, payload, says):
    sio = connect(windowed)
    wait_for_event(sio, "ranks_snapshot")
    ack = sio.emit("ranks_view", payload, callback=True)
    assert ack["status"] == 400 and says in ack["error"], ack
    sio.disconnect()


def test_below_the_threshold_every_client_gets_every_row(run_dir):
    write_job(run_dir, RANKS)
    for r in range(RANKS):
        write_heartbeat(run_dir, heartbeat(r, RANKS, seq=1))
    app = make_app(run_dir, PAGE_WINDOW_RANKS=RANKS)
    try:
        sio = connect(app)
        snap = wait_for_event(sio, "ranks_snapshot")
        assert "window" not in snap
        assert [r["rank"] for r in snap["ranks"]] == list(range(RANKS))
        sio.disconnect()
    finally:
        app.extensions["rankwatch"].watcher.stop()


def test_api_ranks_sorts_worst_first(client, run_dir):
    write_job(run_dir, 4)
    for r in range(4):
        write_heartbeat(run_dir, heartbeat(r, 4, seq=1, state="failed" if r == 3 else "training"))
    body = client.get("/api/ranks?sort=worst&per_page=2").get_json()
    assert [(r["rank"], r["health"]) for r in body["ranks"]] == [(3, "failed"), (0, "healthy")]
    assert client.get("/api/ranks?sort=loss").get_json()["status"] == 400
