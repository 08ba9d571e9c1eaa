"""Issue 32, P5 and P6: a neighbour under ``--runs`` can neither hide other runs nor take their watchers.

* P5: 500,001 empty files in one neighbour's directory used up the scan's global
  budget, and every run sorting after it vanished: its stop answered 404.
* P6: 33 runs with a future-dated empty ``rank_0.json`` took all 32 watcher
  slots, so a real run's alerts, completion records, policy and retention stopped.

A real dashboard app on a real root (``create_app`` with ``RUNS_ROOT``), its
registry ticked by the test; the stop goes through HTTP with the token.
"""

from __future__ import annotations

import os
import time

import pytest

from app import create_app
from app.runs.discovery import MAX_ENTRIES, Discovery
from app.runs.registry import OPEN_MAX
from tests.helpers.app import FAST_SETTINGS, TOKEN, operator
from tests.helpers.checkpoints import periodic
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import runfiles


@pytest.fixture
def root_app(tmp_path):
    apps = []

    def make(**settings):
        app = create_app(
            {"RUNS_ROOT": str(tmp_path), "TESTING": True, "TOKEN": TOKEN, **FAST_SETTINGS, **settings}
        )
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["rankwatch_runs"].stop()


def real_run(root, rel: str, world: int = 1) -> None:
    write_job(root / rel, world)
    for r in range(world):
        write_heartbeat(root / rel, heartbeat(r, world, seq=3))


@pytest.mark.slow  # half a million files made, then scanned: a minute or more on a loaded machine
def test_a_neighbours_flood_of_files_hides_no_other_run(tmp_path, root_app):
    flood = tmp_path / "aaa-neighbour"
    flood.mkdir()
    for i in range(MAX_ENTRIES + 1):  # the review's 500,001 empty files
        os.close(os.open(flood / f"f{i}", os.O_CREAT | os.O_WRONLY, 0o600))
    real_run(tmp_path, "victim")
    app = root_app()
    client = app.test_client()
    r = client.post("/api/runs/victim/exit", json={"reason": "security: flood"}, headers=operator())
    assert r.status_code == 202, r.get_json()
    assert runfiles.read_flag(tmp_path / "victim").exit
    health = client.get("/api/health").get_json()
    assert health["runs"]["discovery"]["cut_short"] == ["aaa-neighbour"], health["runs"]


def test_a_known_run_is_not_dropped_when_a_scan_is_cut_short(tmp_path):
    real_run(tmp_path, "zz-victim")
    disc = Discovery(tmp_path, max_entries=100)
    assert list(disc.scan()) == ["zz-victim"]
    for i in range(200):  # now ROOT itself is flooded: its listing is cut before the victim
        (tmp_path / f"a{i:03d}").mkdir()
    assert "zz-victim" in disc.scan() and disc.truncated
    # Kept only while its directory is there.
    (tmp_path / "zz-victim").rename(tmp_path / "gone")
    (tmp_path / "gone").rename(tmp_path.parent / f"{tmp_path.name}-gone")
    assert "zz-victim" not in disc.scan()


def test_future_dated_fake_runs_take_no_watcher_from_a_real_run(tmp_path, root_app):
    ahead = time.time() + 365 * 86400
    for i in range(OPEN_MAX + 1):
        fake = runfiles.heartbeat_path(tmp_path / f"fake{i:02d}", 0)
        fake.parent.mkdir(parents=True)
        fake.touch()
        os.utime(fake, (ahead, ahead))
    real_run(tmp_path, "zz-real")
    app = root_app()
    registry = app.extensions["rankwatch_runs"]
    registry.tick()
    assert registry.peek("zz-real") is not None and registry.peek("zz-real").watcher.running
    runs = registry.discovery.runs
    assert not any(runs[f"fake{i:02d}"].live for i in range(OPEN_MAX + 1))
    assert app.test_client().get("/api/health").get_json()["runs"]["unwatched"] == 0


def test_a_run_with_a_pending_stop_is_watched_past_the_cap_and_health_says_who_is_not(tmp_path, root_app):
    for i in range(OPEN_MAX + 1):  # more real-looking live runs than slots
        real_run(tmp_path, f"live{i:02d}", world=2)
    write_job(tmp_path / "zz-stopping", 1)
    write_heartbeat(tmp_path / "zz-stopping", heartbeat(0, 1, seq=3, now=time.time() - 3600))
    old = time.time() - 3600
    os.utime(runfiles.heartbeat_path(tmp_path / "zz-stopping", 0), (old, old))  # idle: no evidence of life
    runfiles.write_flag(tmp_path / "zz-stopping", True, request_id="req-pending")
    app = root_app()
    registry = app.extensions["rankwatch_runs"]
    registry.tick()
    assert registry.peek("zz-stopping") is not None and registry.peek("zz-stopping").watcher.running
    runs = app.test_client().get("/api/health").get_json()["runs"]
    assert runs["always_watched"] == 1 and runs["unwatched"] == 2, runs
    assert len(runs["unwatched_ids"]) == 2


def test_a_run_directory_swapped_for_a_symlink_is_neither_written_nor_pruned(tmp_path, root_app):
    """P2: between scans a neighbour renames their run directory and puts a symlink to OUT in its place.

    The operator's stop of that run must not write OUT's flag or audit trail, and retention
    (on) must not delete OUT's checkpoint sets.
    """
    root = tmp_path / "root"
    out = tmp_path / "OUT"
    for d in (root / "neighbour", out):
        real_run(d.parent, d.name, world=2)
        for step in (10, 20, 30, 40, 50):
            periodic(d, step)
    app = root_app(RUNS_ROOT=str(root), RETENTION_MODE="on", RETENTION_KEEP=1)
    registry = app.extensions["rankwatch_runs"]
    registry.tick()
    assert "neighbour" in registry.discovery.runs
    # Its loop is stopped, so that its ticks are this test's: a tick already under way when the
    # directory is swapped is the residual race docs/security.md names.
    rw = registry.peek("neighbour")
    rw.watcher.stop()
    (root / "neighbour").rename(root / "neighbour.old")
    (root / "neighbour").symlink_to(out, target_is_directory=True)

    r = app.test_client().post("/api/runs/neighbour/exit", json={"reason": "swap"}, headers=operator())
    assert r.status_code == 404 and "replaced" in r.get_json()["error"], r.get_json()
    assert rw.watcher.tick() is None  # its watcher's next tick: the pin no longer holds, nothing done
    assert app.test_client().get("/api/runs").status_code == 200  # the table still answers
    assert not runfiles.flag_path(out).exists()
    assert not (runfiles.state_dir(out) / "audit.sqlite3").exists()
    assert sorted(p.name for p in (out / "ckpt/rank_0").iterdir()) == [
        f"net-1_{s}.ckpt" for s in (10, 20, 30, 40, 50)
    ]
    # The next scan: a symlink is no run; the old directory is a run of its own.
    registry.tick()
    assert "neighbour" not in registry.discovery.runs and "neighbour.old" in registry.discovery.runs


def test_a_swap_after_the_pin_check_still_writes_and_deletes_only_in_the_pinned_directory(tmp_path, root_app):
    """P2's residual: the swap lands between the pin check and the engine's write or delete.

    The run's container is built and its checkpoint index read (the check and the plan); then
    the neighbour renames the directory and puts a symlink to OUT at its name; then the engines
    act, as a request or a tick already past its check does: the stop flag and its audit row, a
    set's delete. Each must land in the directory that was pinned (now ``neighbour.old``, still in
    ROOT), never in OUT, because the engines hold it by its descriptor (app/runs/pinned.py).
    """
    root = tmp_path / "root"
    out = tmp_path / "OUT"
    for d in (root / "neighbour", out):
        real_run(d.parent, d.name, world=2)
        for step in (10, 20, 30):
            periodic(d, step)
    app = root_app(RUNS_ROOT=str(root))
    registry = app.extensions["rankwatch_runs"]
    registry.refresh(max_age=0)
    rw = registry.get("neighbour", touch=False)  # the pin check, and the container's build
    oldest = min(rw.checkpoints.index(2).sets, key=lambda s: s.step)  # the plan, before the swap
    (root / "neighbour").rename(root / "neighbour.old")
    (root / "neighbour").symlink_to(out, target_is_directory=True)

    request_id, created, _, _ = rw.stop.request("after the check", "tester", None)
    deleted, failed, _ = rw.checkpoints.remove_set(oldest)

    assert created and not failed and deleted, (created, failed, deleted)
    assert not runfiles.flag_path(out).exists(), "the stop flag was written in OUT"
    assert not [p.name for p in runfiles.state_dir(out).iterdir() if p.name.startswith("audit")], (
        "the audit trail was created in OUT"
    )
    assert sorted(p.name for p in (out / "ckpt/rank_0").iterdir()) == [
        f"net-1_{s}.ckpt" for s in (10, 20, 30)
    ], "OUT's checkpoint set was deleted"
    old = root / "neighbour.old"
    assert runfiles.read_flag(old).request_id == request_id
    assert (runfiles.state_dir(old) / "audit.sqlite3").is_file()
    assert sorted(p.name for p in (old / "ckpt/rank_0").iterdir()) == ["net-1_20.ckpt", "net-1_30.ckpt"]


def test_run_names_that_look_alike_in_nfc_and_nfd_are_told_apart(tmp_path, root_app):
    """P11: ``café`` written in NFC and in NFD are two directories; the table says so and shows both
    escaped, each run's stop lands in its own directory, and ``?q=`` in either form finds both."""
    import unicodedata

    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    assert nfc != nfd
    real_run(tmp_path, nfc)
    real_run(tmp_path, nfd)
    real_run(tmp_path, "other")
    client = root_app().test_client()
    body = client.get("/api/runs?per_page=10").get_json()
    rows = {r["id"]: r for r in body["runs"]}
    assert set(rows) == {nfc, nfd, "other"}, rows.keys()
    assert rows[nfc]["lookalike"] == {"others": [nfd], "escaped": "caf\\xe9"}
    assert rows[nfd]["lookalike"] == {"others": [nfc], "escaped": "cafe\\u0301"}
    assert rows["other"]["lookalike"] is None
    for q in (nfc, nfd, "CAFÉ"):
        found = client.get("/api/runs", query_string={"q": q}).get_json()["runs"]
        assert {r["id"] for r in found} == {nfc, nfd}, q
    from app.runs import ids

    r = client.post(f"/api/runs/{ids.encode(nfd)}/exit", json={"reason": "P11: nfd"}, headers=operator())
    assert r.status_code == 202, r.get_json()
    assert runfiles.read_flag(tmp_path / nfd).exit
    assert runfiles.read_flag(tmp_path / nfc) is None
