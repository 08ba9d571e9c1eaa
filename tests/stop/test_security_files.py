"""Issue 19, items 1, 2, 7, 12 and 13: no file in the run directory can block, or redirect, the stop.

Every kind of non-regular file (a FIFO, a UNIX socket, a device node, a
directory, and a symlink to a file outside) is put at every path the
product opens, on both sides:

* the dashboard: its routes (``GET /api/ranks``, ``/api/exit``,
  ``/api/stacks``, ``/api/checkpoints``, and ``POST /api/exit`` with the
  token) answer, and the stop writes the flag;
* the bridge: the real ``Reporter`` keeps writing heartbeats and still sees
  the flag.

A call that never returns is the failure these tests look for. Each route is
called on a thread, and the thread's ``join`` timeout is only a hang
detector: generous, and never a claim about speed. The end-to-end case, a
real 2-rank msrun job stopped gracefully with all the hostile files in
place at once, is ``tests/stop/test_stop_hostile_files.py``.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path

import pytest

from app.incidents import captures as incident_captures
from tests.helpers.app import AUTH, make_app
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import runfiles, stackfiles

# Only a hang detector: a call that needs this long has hung.
HANG_S = 60.0
SECRET = "outside-secret-d41d8cd98f"

KINDS = ("fifo", "socket", "device", "directory", "symlink")
# Every path below RUN that the dashboard opens, reads, writes or lists.
DASHBOARD_PATHS = (
    runfiles.FLAG_NAME,
    "rankwatch/.flag.lock",
    "rankwatch/rank_0.json",
    "rankwatch/rank_5.json",  # a rank the job does not have
    "rankwatch/rank_0.history.jsonl",
    "rankwatch/rank_0.history.jsonl.1",
    "rankwatch/job.json",
    "rankwatch/audit.sqlite3",
    "rankwatch/audit.sqlite3-wal",
    "rankwatch/stacks/all.request.json",
    "rankwatch/stacks/rank_0.request.json",
    "rankwatch/stacks/rank_0/00001700000000000-request.json",
    "msrun_logs/worker_0.log",
    "checkpoints/rank_0/rankwatch-1_5.ckpt",
)
# Every path below RUN that the bridge's reporter thread opens, reads or writes.
BRIDGE_PATHS = (
    runfiles.FLAG_NAME,
    "rankwatch/rank_0.json",
    "rankwatch/rank_0.history.jsonl",
    "rankwatch/job.json",
    "rankwatch/stacks/all.request.json",
    "rankwatch/stacks/rank_0.request.json",
)


def outside_file(tmp: Path) -> Path:
    """A file outside the run directory that reads as a valid heartbeat holding ``SECRET``."""
    target = tmp / "outside" / "secret.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(heartbeat(0, 2, host=SECRET)))
    return target


def make_hostile(path: Path, kind: str, outside: Path) -> None:
    """Put a ``kind`` where ``path`` is expected (replacing what is there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.is_file() or path.is_socket() or path.is_fifo():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        # AF_UNIX paths are short: bind in a short directory, then move it in place.
        short = Path(tempfile.mkdtemp(prefix="rws"))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(short / "s"))
        finally:
            sock.close()
        os.rename(short / "s", path)
        short.rmdir()
    elif kind == "device":
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero: a read never ends
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink":
        os.symlink(outside, path)
    else:
        raise ValueError(kind)


def call(fn, what: str):
    """``fn()`` on a thread; fails if it never returns (a hang), re-raises what it raised."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (handed to the test thread)
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True, name=f"call {what}")
    thread.start()
    thread.join(HANG_S)
    if thread.is_alive():
        pytest.fail(f"{what} never returned: it is blocked on a file in the run directory")
    if "error" in out:
        raise out["error"]
    return out["value"]


def poll(predicate, what: str):
    """Poll ``predicate()`` until truthy; the bound is a hang detector only."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"never happened: {what}")


def healthy_run(run_dir: Path) -> None:
    write_job(run_dir, 2)
    for r in (0, 1):
        write_heartbeat(run_dir, heartbeat(r, 2))


@pytest.fixture
def dashboard(run_dir):
    apps = []

    def make():
        app = make_app(run_dir)
        apps.append(app)
        return app.test_client()

    yield make
    for app in apps:
        app.extensions["rankwatch"].watcher.stop()


def assert_answers(client, what: str) -> None:
    """The tokenless reads answer, in the error shape if not 200, never 500."""
    for url in ("/api/ranks", "/api/exit", "/api/stacks", "/api/checkpoints", "/api/summary"):
        response = call(lambda url=url: client.get(url), f"GET {url} ({what})")
        assert response.status_code < 500, (url, response.status_code, response.get_data()[:500])
        if response.status_code != 200:
            assert set(response.get_json()) == {"error", "status"}, response.get_json()


# ---------------------------------------------------------------- the dashboard


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rel", DASHBOARD_PATHS)
def test_dashboard_routes_answer_and_the_stop_writes_the_flag(dashboard, run_dir, tmp_path, rel, kind):
    healthy_run(run_dir)
    outside = outside_file(tmp_path)
    make_hostile(run_dir / rel, kind, outside)
    before = outside.read_bytes()
    client = dashboard()

    assert_answers(client, f"{kind} at {rel}")
    response = call(
        lambda: client.post("/api/exit", json={"reason": f"{kind} at {rel}"}, headers=AUTH),
        f"POST /api/exit ({kind} at {rel})",
    )
    assert response.status_code == 202, response.get_json()
    flag = runfiles.read_flag(run_dir)
    assert flag is not None and flag.exit and flag.request_id == response.get_json()["request_id"]
    assert_answers(client, f"{kind} at {rel}, after the stop")
    # Nothing outside was written through a symlink.
    assert outside.read_bytes() == before
    assert sorted(p.name for p in outside.parent.iterdir()) == [outside.name]


def test_a_held_flag_lock_delays_the_stop_boundedly_and_the_audit_says_so(dashboard, run_dir):
    healthy_run(run_dir)
    lock = runfiles.state_dir(run_dir) / ".flag.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a rank, or any stray process, holding it for ever
    try:
        client = dashboard()
        response = call(
            lambda: client.post("/api/exit", json={"reason": "r"}, headers=AUTH), "POST /api/exit"
        )
        assert response.status_code == 202, response.get_json()
        body = response.get_json()
        assert "flag lock" in body["lock_error"] and "atomically" in body["lock_error"]
        flag = runfiles.read_flag(run_dir)
        assert flag.exit and flag.request_id == body["request_id"]
        row = client.get("/api/audit", headers=AUTH).get_json()["rows"][0]
        assert row["outcome"].startswith("accepted (written without the flag lock: ")
        # Cancel and re-arm take the same bounded path.
        response = call(
            lambda: client.post("/api/exit/cancel", json={}, headers=AUTH), "POST /api/exit/cancel"
        )
        assert response.status_code == 200, response.get_json()
        assert not runfiles.read_flag(run_dir).exit
        # The watcher's tick never waits on it either (it tries once).
        assert_answers(client, "flag lock held")
    finally:
        os.close(holder)


def test_a_symlinked_heartbeat_is_never_read_nor_echoed(dashboard, run_dir, tmp_path):
    healthy_run(run_dir)
    client = dashboard()
    assert {r["health"] for r in client.get("/api/ranks").get_json()["ranks"]} == {"healthy"}
    outside = outside_file(tmp_path)
    for target in (outside, tmp_path / "outside" / "does-not-exist.json"):
        path = runfiles.heartbeat_path(run_dir, 1)
        path.unlink()
        os.symlink(target, path)
        rows = poll(
            lambda: (
                body
                if (body := client.get("/api/ranks").get_json())["ranks"][1]["health"] == "corrupt"
                else None
            ),
            "rank 1 shown corrupt",
        )
        text = json.dumps(rows)
        assert SECRET not in text
        assert "rank_1.json: not a regular file" in rows["ranks"][1]["reason"]
        # The same words whether the target exists or not: nothing is learned about it.
        assert "does-not-exist" not in text and "No such file" not in text
        runfiles.heartbeat_path(run_dir, 1).unlink()
        write_heartbeat(run_dir, heartbeat(1, 2, seq=5))
        poll(lambda: client.get("/api/ranks").get_json()["ranks"][1]["health"] == "healthy", "healthy")


def test_a_bad_heartbeat_field_is_named_without_its_content(dashboard, run_dir):
    healthy_run(run_dir)
    client = dashboard()
    hb = heartbeat(1, 2, seq=7)
    hb["host"] = SECRET * 20  # longer than the schema allows
    runfiles.atomic_write_json(runfiles.heartbeat_path(run_dir, 1), hb)
    row = poll(
        lambda: (r := client.get("/api/ranks").get_json()["ranks"][1])["health"] == "corrupt" and r,
        "rank 1 corrupt",
    )
    assert "rank_1.json: host" in row["reason"] and SECRET not in json.dumps(row)


# ---------------------------------------------------------------- writes stay inside (item 7)


def test_writes_and_unlinks_never_follow_a_symlinked_directory(dashboard, run_dir, tmp_path):
    healthy_run(run_dir)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    victims = []
    for i in range(10):
        victim = outside / f"{i:014d}-request.json"
        victim.write_text("{}")
        victims.append(victim)
    # stacks/ is a symlink out: a stack request must not be written there.
    stacks_dir = runfiles.stacks_dir(run_dir)
    stacks_dir.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, stacks_dir)
    client = dashboard()
    response = call(lambda: client.post("/api/stacks", json={}, headers=AUTH), "POST /api/stacks")
    assert response.status_code == 507, response.get_json()
    assert "symlink" in response.get_json()["error"]
    assert sorted(p.name for p in outside.iterdir()) == sorted(v.name for v in victims)
    # A capture's clean-up (the dashboard writes py-spy's captures) unlinks nothing outside.
    os.unlink(stacks_dir)
    stacks_dir.mkdir()
    os.symlink(outside, stackfiles.runfiles.stack_captures_dir(run_dir, 0))
    capture = stackfiles.build_capture(
        rank=0, captured_at=time.time(), source="py-spy", trigger="request", threads=[]
    )
    with pytest.raises(OSError):
        stackfiles.write_capture(run_dir, capture)
    assert all(v.exists() for v in victims)


def test_a_symlinked_audit_db_is_refused_and_the_stop_still_works(dashboard, run_dir, tmp_path):
    healthy_run(run_dir)
    elsewhere = tmp_path / "elsewhere.sqlite3"
    os.symlink(elsewhere, runfiles.state_dir(run_dir) / "audit.sqlite3")
    client = dashboard()
    response = call(lambda: client.post("/api/exit", json={"reason": "r"}, headers=AUTH), "POST /api/exit")
    assert response.status_code == 202
    assert "not a regular file" in response.get_json()["audit_error"]
    assert runfiles.read_flag(run_dir).exit
    assert not elsewhere.exists()
    answer = client.get("/api/audit", headers=AUTH)
    assert answer.status_code < 500


# ---------------------------------------------------------------- junk captures (item 13)


def test_junk_capture_files_cost_a_bounded_cached_listing(dashboard, run_dir, monkeypatch):
    healthy_run(run_dir)
    folder = runfiles.stack_captures_dir(run_dir, 0)
    folder.mkdir(parents=True)
    for i in range(20_000):
        (folder / f"{i:014d}-request.json").write_bytes(b"junk")
    os.mkfifo(folder / "99999999999999-request.json")
    client = dashboard()
    seen = {"entries": 0}
    real_scandir, real_listdir = os.scandir, os.listdir

    class Counting:
        def __init__(self, it):
            self.it = it

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.it.close()

        def __iter__(self):
            for entry in self.it:
                seen["entries"] += 1
                yield entry

    def scandir(path="."):
        it = real_scandir(path)
        return Counting(it) if str(path).endswith("rank_0") else it

    def listdir(path="."):
        names = real_listdir(path)
        if str(path).endswith("rank_0"):
            seen["entries"] += len(names)
        return names

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "listdir", listdir)
    # The listing is kept while the directory's mtime is unchanged; the TTL (a
    # second) only covers the mtime's granularity and is no part of this test.
    monkeypatch.setattr(incident_captures, "LIST_TTL_S", 1e9)
    for _ in range(5):
        response = call(lambda: client.get("/api/stacks"), "GET /api/stacks")
        assert response.status_code == 200
        assert 0 in response.get_json()["missing"]
    # One bounded listing in all: later requests reuse it while the directory is unchanged.
    assert 0 < seen["entries"] <= stackfiles.MAX_LISTED + 1


# ---------------------------------------------------------------- the bridge


@pytest.fixture
def reporter_factory(run_dir):
    from tests.helpers.reporters import reporter as new_reporter

    made = []

    def make():
        reporter = new_reporter(run_dir, heartbeat_interval_s=0.05, poll_interval_s=0.02)
        made.append(reporter)
        return reporter

    yield make
    for reporter in made:
        reporter._closed.set()
        reporter._wake.set()


def beat_seq(run_dir) -> int:
    try:
        return runfiles.read_json(runfiles.heartbeat_path(run_dir, 0))["seq"]
    except (OSError, ValueError):
        return 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rel", BRIDGE_PATHS)
def test_bridge_heartbeats_go_on_and_the_flag_is_still_seen(reporter_factory, run_dir, tmp_path, rel, kind):
    outside = outside_file(tmp_path)
    before = outside.read_bytes()
    (run_dir / "rankwatch" / "stacks").mkdir(parents=True)
    make_hostile(run_dir / rel, kind, outside)
    reporter = reporter_factory()
    # The request files existed before the bridge started: make them new, as an attacker would.
    call(reporter.start, "Reporter.start")
    if "request" in rel:
        path = run_dir / rel
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()
        make_hostile(path, kind, outside)
    seq = beat_seq(run_dir)
    poll(lambda: beat_seq(run_dir) > seq + 3, f"heartbeats going on with a {kind} at {rel}")
    assert reporter.handover.thread.is_alive()
    runfiles.write_flag(run_dir, True, request_id="req-hostile")  # replaces whatever is at the flag's name
    poll(lambda: reporter.request is not None, f"the flag seen with a {kind} at {rel}")
    assert reporter.request.request_id == "req-hostile"
    seq = beat_seq(run_dir)
    poll(lambda: beat_seq(run_dir) > seq + 2, "heartbeats still going on after the flag")
    assert call(reporter.read_flag_now, "read_flag_now").request_id == "req-hostile"
    assert outside.read_bytes() == before
    hb = runfiles.read_json(runfiles.heartbeat_path(run_dir, 0))
    assert hb["stop"]["stage"] == "seen" and SECRET not in json.dumps(hb)


def test_safeio_refuses_every_kind_without_blocking(tmp_path):
    from trainer_bridge.rundir import safeio  # the one helper both sides use (new with this test)

    outside = outside_file(tmp_path)
    for kind in KINDS:
        path = tmp_path / "run" / f"{kind}.json"
        make_hostile(path, kind, outside)
        with pytest.raises(safeio.NotRegular) as e:
            call(lambda path=path: safeio.read_regular(path, 1024), f"read a {kind}")
        assert str(e.value.strerror) == "not a regular file"
        with pytest.raises(OSError):
            call(lambda path=path: safeio.append(tmp_path / "run", path.name, b"x"), f"append to a {kind}")


def test_a_held_state_directory_swapped_or_removed_is_walked_again(tmp_path):
    """The reporter holds rankwatch/ open (safeio.HeldDir): a swap for a symlink is refused at the
    next walk and never followed, and a removed directory is made again, both without blocking."""
    from trainer_bridge.rundir import safeio

    outside = tmp_path / "outside"
    outside.mkdir()
    run = tmp_path / "run"
    run.mkdir()  # the root is the operator's (the bridge makes it once, in begin)
    now = [0.0]
    held = safeio.HeldDir(run, "rankwatch", refresh_s=10.0, clock=lambda: now[0])
    held.write_atomic("rank_0.json", b"1")
    assert held.append("rank_0.history.jsonl", b"a\n") == 2
    assert (run / "rankwatch" / "rank_0.json").read_bytes() == b"1"
    with pytest.raises(safeio.UnsafePath):
        held.write_atomic("../escape.json", b"x")
    with pytest.raises(safeio.UnsafePath):
        held.replace("rank_0.json", "../escape.json")

    # Removed under the hold: the write into the deleted directory fails,
    # and the next one walks again and makes it.
    for p in (run / "rankwatch").iterdir():
        p.unlink()
    (run / "rankwatch").rmdir()
    with pytest.raises(FileNotFoundError):
        held.write_atomic("rank_0.json", b"2")
    held.write_atomic("rank_0.json", b"3")
    assert (run / "rankwatch" / "rank_0.json").read_bytes() == b"3"

    # Swapped for a symlink to a directory outside: refused at the next walk (due by the clock).
    (run / "rankwatch").rename(run / "old")
    (run / "rankwatch").symlink_to(outside)
    now[0] += 11
    with pytest.raises(OSError):
        call(lambda: held.write_atomic("rank_0.json", b"4"), "write through a swapped directory")
    with pytest.raises(OSError):
        call(lambda: held.append("rank_0.history.jsonl", b"b\n"), "append through a swapped directory")
    assert list(outside.iterdir()) == []
    held.close()
