"""Finding runs under a root (app/runs/discovery.py), on real directories."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from app.runs.discovery import Discovery

ODD = ["with space", "ünïcødé-日本", "a%2Fb", "..dots", "a..b", "...", "-leading-dash", "tilde~name"]


def make_run(root, rel, kind="state"):
    run = root / rel
    if kind == "state":
        (run / "rankwatch").mkdir(parents=True)
        (run / "rankwatch" / "rank_0.json").write_text("{}")
    elif kind == "logs":
        (run / "msrun_logs").mkdir(parents=True)
        (run / "msrun_logs" / "worker_0.log").write_text("hello\n")
    else:
        run.mkdir(parents=True)
        (run / "graceful_exit.json").write_text('{"GracefulExit": 0}')
    return run


def test_odd_names_kinds_depth_and_symlinks(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    for name in ODD:
        make_run(root, name)
    make_run(root, "team/a/logs-run", "logs")
    make_run(root, "team/flag-run", "flag")
    make_run(root, "d1/d2/d3/too-deep")
    # An msrun_logs with no worker log is not (yet) a run.
    (root / "empty-logs" / "msrun_logs").mkdir(parents=True)
    outside = make_run(tmp_path, "outside")
    (root / "escape").symlink_to(outside)
    (root / "loop").symlink_to(root)
    (root / "team" / "loop2").symlink_to("..")
    disc = Discovery(root)
    runs = disc.scan()
    assert sorted(runs) == sorted([*ODD, "team/a/logs-run", "team/flag-run"])
    assert runs["team/a/logs-run"].markers == ("logs",)
    assert runs["team/flag-run"].markers == ("flag",)
    assert runs["with space"].path == os.path.join(root, "with space")
    reasons = {s.path: s.reason for s in disc.skipped}
    assert reasons["escape"] == reasons["loop"] == reasons["team/loop2"] == "a symlink: not followed"
    assert not any("outside" in r for r in runs)

    # A run appears when its first file does, one goes when deleted; the rest is reused.
    (root / "empty-logs" / "msrun_logs" / "worker_3.log").write_text("x\n")
    shutil.rmtree(root / "with space")
    runs = disc.scan()
    assert "empty-logs" in runs and "with space" not in runs
    assert len(runs) == len(ODD) + 2


def test_live_and_idle(tmp_path):
    now = [time.time()]
    disc = Discovery(tmp_path, idle_s=300, clock=lambda: now[0])
    make_run(tmp_path, "r")
    assert disc.scan()["r"].live
    now[0] += 301
    assert not disc.scan()["r"].live
    # A log that grows (its directory unchanged) makes the run live again at the next recheck.
    logs = make_run(tmp_path, "l", "logs")
    old = now[0] - 1000
    os.utime(logs / "msrun_logs" / "worker_0.log", (old, old))
    assert not disc.scan()["l"].live
    with open(logs / "msrun_logs" / "worker_0.log", "a") as f:
        f.write("more\n")
    now[0] += 31
    # The append, as the test's clock tells time.
    os.utime(logs / "msrun_logs" / "worker_0.log", (now[0] - 10, now[0] - 10))
    runs = disc.scan()
    assert runs["l"].live and not runs["r"].live


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads directories whatever their mode")
def test_unreadable_directory_is_skipped_with_a_reason(tmp_path):
    make_run(tmp_path, "ok")
    locked = tmp_path / "locked"
    make_run(tmp_path, "locked/inner")
    locked.chmod(0)
    try:
        disc = Discovery(tmp_path)
        assert list(disc.scan()) == ["ok"]
        assert {s.path: s.reason for s in disc.skipped}["locked"] == "unreadable (permission denied)"
    finally:
        locked.chmod(0o755)


def test_run_deleted_mid_scan(tmp_path):
    for name in ("a", "b", "c"):
        make_run(tmp_path, f"g/{name}")

    def delete_b(rel):
        if rel == "g/b":
            shutil.rmtree(tmp_path / "g" / "b")

    disc = Discovery(tmp_path, on_enter=delete_b)
    assert sorted(disc.scan()) == ["g/a", "g/c"]
    assert {s.path: s.reason for s in disc.skipped}["g/b"] == "deleted during the scan"
    # And the next scan, with the directory gone from its parent's listing, says nothing of it.
    disc.on_enter = None
    assert sorted(disc.scan()) == ["g/a", "g/c"]
    assert disc.skipped == []


def test_a_hundred_thousand_empty_directories(tmp_path):
    base = tmp_path / "many"
    base.mkdir()
    for i in range(100_000):
        os.mkdir(base / f"d{i:06d}")
    make_run(tmp_path, "many/d099999/run")
    make_run(tmp_path, "first")
    disc = Discovery(tmp_path)
    assert sorted(disc.scan()) == ["first", "many/d099999/run"]
    assert not disc.truncated
    # Unchanged: the same answer from the kept listings.
    assert sorted(disc.scan()) == ["first", "many/d099999/run"]
    # A cap on the entries read of one directory cuts that directory short and says which.
    small = Discovery(tmp_path, max_entries=1000)
    small.scan()
    assert small.truncated and small.cut == ["many"] and small.status()["cut_short"] == ["many"]
