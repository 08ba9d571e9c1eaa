"""Issue 32, P11: what a viewer without the token is not given: the login token cached, the run
directory's absolute path, the job's command line; ``--redis-key`` is no flag (``ps`` shows argv)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.app import TOKEN, operator
from tests.helpers.checkpoints import bridge_id, save_bridge_set
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.helpers.liveserver import REPO


def test_the_login_answers_are_not_cached(app, client):
    code = app.extensions["rankwatch_login"].mint()[0]
    r = client.post("/api/login", json={"code": code})
    assert r.get_json() == {"token": TOKEN} and r.headers["Cache-Control"] == "no-store"
    r = client.post("/api/login-code", json={}, headers=operator())
    assert r.status_code == 201 and r.headers["Cache-Control"] == "no-store"


def test_no_absolute_path_nor_command_line_for_a_viewer_without_the_token(client, run_dir):
    write_job(
        run_dir,
        2,
        launcher_argv=[
            "msrun",
            "--worker_num=2",
            "--local_worker_num=2",
            "train.py",
            "--secret-arg",
            "hunter2",
        ],
        argv=["train.py", "--secret-arg", "hunter2"],
    )
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2, seq=3))
    save_bridge_set(run_dir, 16)
    where = str(run_dir)
    viewer = client.get("/api/checkpoints")
    assert viewer.status_code == 200 and where not in viewer.get_data(as_text=True)
    assert viewer.get_json()["run_dir"] == run_dir.name
    assert client.get("/api/checkpoints", headers=operator()).get_json()["run_dir"] == where

    seen = client.get("/api/checkpoints/resume", query_string={"set": bridge_id(16)})
    text = seen.get_data(as_text=True)
    assert seen.status_code == 200 and "hunter2" not in text and where not in text
    assert seen.get_json()["command"] is None and "operator token" in seen.get_json()["command_notes"][0]
    op = client.get(
        "/api/checkpoints/resume", query_string={"set": bridge_id(16)}, headers=operator()
    ).get_json()
    assert "hunter2" in op["command"]

    # The run status (GET /api/ranks, /api/summary) names the run, not where it lives (P11).
    for url in ("/api/ranks", "/api/summary"):
        text = client.get(url).get_data(as_text=True)
        assert where not in text, (url, text[:2000])
    assert client.get("/api/ranks").get_json()["run"]["run_dir"] == run_dir.name
    assert client.get("/api/ranks", headers=operator()).get_json()["run"]["run_dir"] == where


def test_the_redis_key_and_the_token_are_no_command_line_flags_and_can_come_from_a_file(tmp_path):
    help_text = subprocess.run(
        [sys.executable, "-m", "app", "--help"], capture_output=True, text=True, cwd=REPO, timeout=60
    ).stdout
    assert "--redis-url" in help_text and "--redis-key" not in help_text
    assert "--host" in help_text and "--token" not in help_text  # P11: argv shows in ps
    from app.config import from_env

    key = tmp_path / "redis.key"
    key.write_text("from-a-file-0123456789\n")
    assert from_env({"RANKWATCH_REDIS_KEY_FILE": str(key)})["REDIS_KEY"] == "from-a-file-0123456789"
    assert (
        from_env({"RANKWATCH_REDIS_KEY": "env-wins", "RANKWATCH_REDIS_KEY_FILE": str(key)})["REDIS_KEY"]
        == "env-wins"
    )
    token = tmp_path / "token"
    token.write_text("a-token-from-a-file-0123456789\n")
    assert from_env({"RANKWATCH_TOKEN_FILE": str(token)})["TOKEN"] == "a-token-from-a-file-0123456789"


def test_health_names_no_host_nor_pid_to_a_viewer_without_the_token(tmp_path, run_dir, redis_server):
    """P11: ``/api/health`` showed this process's pid and the ``host:pid:tag`` of it and of the leader."""
    import os
    import socket

    from tests.helpers.app import make_app

    app = make_app(run_dir, REDIS_URL=redis_server.url)
    client = app.test_client()
    client.get("/api/ranks", headers=operator())  # the watcher's first tick elects this process
    app.extensions["rankwatch"].watcher.tick()
    full = client.get("/api/health", headers=operator()).get_json()
    assert full["pid"] == os.getpid() and full["id"].startswith(socket.gethostname()), full
    shown = client.get("/api/health").get_json()
    text = str(shown)
    assert "pid" not in shown and f"{socket.gethostname()}:{os.getpid()}" not in text, shown
    assert shown["role"] == full["role"] and shown["id"].startswith("p-"), shown
    if full["leader"]:
        assert (
            shown["leader"] == shown["id"] if full["leader"] == full["id"] else shown["leader"] != shown["id"]
        )


@pytest.mark.parametrize("live_env", [{"TOKEN": TOKEN, "CHECKPOINT_SCAN_S": 0.3}], indirect=True)
def test_pushes_name_the_run_directory_only_to_sockets_that_carry_the_token(live_server, run_dir):
    """P11: every Socket.IO push (the run status, the checkpoint index, the stop lifecycle...) named
    the absolute run directory to every page; a viewer's socket now gets it as the HTTP answers do.
    A real dashboard and real Socket.IO clients (Engine.IO long-polling, ``tests/helpers/queuepage.py``)."""
    import json

    from tests.helpers.app import wait_for
    from tests.helpers.queuepage import PollingPage

    where = str(run_dir)
    write_job(run_dir, 2)
    write_heartbeat(run_dir, heartbeat(0, 2, seq=1))
    # Naming no page: every room's events, every page's snapshots.
    pages = {"viewer": PollingPage(live_server.url), "op": PollingPage(live_server.url, {"token": TOKEN})}
    wrong = PollingPage(live_server.url, {"page": "ranks", "token": "not-" + TOKEN})
    try:

        def got(who, name, predicate=bool):
            def check():
                return [args[0] for n, args in pages[who].events if n == name and predicate(args[0])]

            return wait_for(check, f"{who}: {name}")[-1]

        refused = wait_for(lambda: dict(wrong.events).get("connect_error"), "the wrong token refused")[0]
        assert refused["data"] == {"status": 401} and "wrong operator token" in refused["message"]
        assert got("viewer", "ranks_snapshot")["run"]["run_dir"] == run_dir.name
        assert got("op", "ranks_snapshot")["run"]["run_dir"] == where
        # The rooms' pushes: a run status that changes (a second rank), a checkpoint index that does.
        write_heartbeat(run_dir, heartbeat(1, 2, seq=1, global_step=7))
        save_bridge_set(run_dir, 16)
        for who, shown in (("op", where), ("viewer", run_dir.name)):
            # The whole index at the connect, then the new set as a delta (app/checkpoints/indexbody.py).
            assert got(who, "checkpoints")["run_dir"] == shown
            assert got(who, "checkpoints_delta", lambda d: d.get("sets"))
            assert got(who, "ranks_delta", lambda d: "run" in d)["run"]["run_dir"] == shown
        names = set(pages["viewer"].names())
        assert {"ranks_snapshot", "ranks_delta", "stop_status", "checkpoints", "checkpoints_delta"} <= names
        assert where not in json.dumps(pages["viewer"].events)
        assert where in json.dumps(pages["op"].events)
        assert not [n for n, _ in wrong.events if n != "connect_error"]
    finally:
        for page in (*pages.values(), wrong):
            page.close()


def test_a_windowed_pages_own_pushes_follow_its_token(run_dir):
    """Above PAGE_WINDOW_RANKS each ranks-page client is pushed its own window (app/ranks/window.py):
    redacted for a viewer too."""
    from app.extensions import socketio
    from tests.helpers.app import make_app, wait_for_event

    write_job(run_dir, 6)
    for r in range(6):
        write_heartbeat(run_dir, heartbeat(r, 6, seq=1))
    app = make_app(run_dir, PAGE_WINDOW_RANKS=4)
    try:
        for auth, shown in (({}, run_dir.name), ({"token": TOKEN}, str(run_dir))):
            sio = socketio.test_client(
                app, flask_test_client=app.test_client(), auth={"page": "ranks", **auth}
            )
            assert wait_for_event(sio, "ranks_snapshot")["run"]["run_dir"] == shown
            # The window's rows come at the next tick, from the watcher, to this client alone.
            assert sio.emit("ranks_view", {"page": 2, "per_page": 3}, callback=True) == {"ok": True}
            snap = wait_for_event(sio, "ranks_snapshot", lambda p: p["window"]["page"] == 2)
            assert snap["run"]["run_dir"] == shown, snap["run"]
            sio.disconnect()
    finally:
        app.extensions["rankwatch"].watcher.stop()
