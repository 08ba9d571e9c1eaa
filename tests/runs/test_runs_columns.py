"""The landing page's loss sparkline and disk used (``GET /api/runs``), on real directories."""

from __future__ import annotations

import functools
import os
import time

import pytest

from app.runs.diskuse import DiskUsage
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job

KB = 1000


def write(path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def test_disk_used_counts_regular_files_follows_no_symlink_and_is_incremental(tmp_path):
    run = tmp_path / "run"
    write(run / "a.bin", 3 * KB)
    write(run / "ckpt" / "step_10" / "rank_0.ckpt", 5 * KB)
    write(run / "ckpt" / "step_10" / "rank_1.ckpt", 5 * KB)
    write(tmp_path / "outside" / "huge.bin", 100 * KB)
    (run / "link-to-outside").symlink_to(tmp_path / "outside")
    (run / "link-to-file").symlink_to(tmp_path / "outside" / "huge.bin")
    (run / "ckpt" / "loop").symlink_to("..")
    os.mkfifo(run / "a-fifo")
    disk = DiskUsage(recheck_s=100.0, min_interval_s=0.0)
    assert disk.measure(run, now=0.0) == 13 * KB and not disk.truncated

    # A new file changes its directory's mtime: seen at once.
    write(run / "ckpt" / "step_20" / "rank_0.ckpt", 7 * KB)
    assert disk.measure(run, now=1.0) == 20 * KB
    # A file growing in place does not touch its directory: the kept listing holds
    # (nothing is listed again) until the recheck, which sees it.
    with open(run / "a.bin", "ab") as f:
        f.write(b"y" * 2 * KB)
    assert disk.measure(run, now=2.0) == 20 * KB
    assert disk.measure(run, now=101.0) == 22 * KB
    # A directory deleted between two walks is gone, not an error.
    for p in (run / "ckpt" / "step_20").iterdir():
        p.unlink()
    (run / "ckpt" / "step_20").rmdir()
    assert disk.measure(run, now=102.0) == 15 * KB
    # A run directory that is gone (or a symlink) has no figure.
    assert DiskUsage().measure(tmp_path / "nope", now=0.0) is None
    (tmp_path / "run-link").symlink_to(run)
    assert DiskUsage().measure(tmp_path / "run-link", now=0.0) is None


def test_disk_used_walk_is_bounded(tmp_path):
    run = tmp_path / "run"
    for i in range(50):
        write(run / f"d{i}" / "f", KB)
    disk = DiskUsage(max_entries=20, min_interval_s=0.0)
    partial = disk.measure(run, now=0.0)
    assert disk.truncated and partial < 50 * KB
    whole = DiskUsage(min_interval_s=0.0)
    assert whole.measure(run, now=0.0) == 50 * KB and not whole.truncated


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads directories whatever their mode")
def test_disk_used_skips_an_unreadable_directory(tmp_path):
    run = tmp_path / "run"
    write(run / "ok" / "f", 2 * KB)
    write(run / "locked" / "f", 9 * KB)
    (run / "locked").chmod(0)
    try:
        assert DiskUsage().measure(run, now=0.0) == 2 * KB
    finally:
        (run / "locked").chmod(0o755)


def beats(run, world: int, losses: list[float]) -> None:
    write_job(run, world)
    # Distinct times, so each is a chart point; recent, so the run reads as training.
    start = time.time() - 100
    for seq, loss in enumerate(losses, 1):
        for r in range(world):
            write_heartbeat(
                run, heartbeat(r, world, seq=seq, global_step=seq, loss=loss + r, now=start + seq * 0.5)
            )


def test_rows_carry_the_loss_sparkline_and_disk_used_and_sort_on_them(tmp_path):
    from app import create_app

    root = tmp_path / "root"
    falling = [2.3 - i * 0.02 for i in range(100)]
    beats(root / "long", 2, falling)
    beats(root / "short", 1, [0.9, 0.8, 0.7])
    beats(root / "empty", 1, [])
    write(root / "long" / "ckpt" / "big.ckpt", 300 * KB)
    # Heartbeats written once: thresholds no loaded machine reaches.
    app = create_app({"RUNS_ROOT": str(root), "TESTING": True, "STALL_MIN_S": 600.0, "DEAD_AFTER_S": 900.0})
    client = app.test_client()
    try:
        rows = {r["id"]: r for r in client.get("/api/runs").get_json()["runs"]}
        long, short, empty = rows["long"], rows["short"], rows["empty"]
        # Rank 0's losses (rank 1 reports loss + 1), at most 32, evenly picked, the first and the newest kept.
        assert len(long["loss_spark"]) == 32
        assert long["loss_spark"][0] == pytest.approx(falling[0])
        assert long["loss_spark"][-1] == pytest.approx(falling[-1]) == long["loss"]
        assert long["loss_spark"] == sorted(long["loss_spark"], reverse=True)
        assert short["loss_spark"] == pytest.approx([0.9, 0.8, 0.7])
        assert empty["loss_spark"] == [] and empty["loss"] is None
        # Bytes of every regular file under the run: the heartbeats, histories, job.json and the checkpoint.
        for rel, row in rows.items():
            files = [p for p in (root / rel).rglob("*") if p.is_file() and not p.is_symlink()]
            assert row["disk_bytes"] == sum(p.stat().st_size for p in files), rel
        assert long["disk_bytes"] > 300 * KB

        def order(sort):
            r = client.get(f"/api/runs?sort={sort}")
            assert r.status_code == 200, r.get_json()
            return [x["id"] for x in r.get_json()["runs"]]

        assert order("-disk_bytes")[0] == "long" and order("disk_bytes")[-1] == "long"
        # The newest loss: None last whichever the direction.
        assert order("loss") == ["long", "short", "empty"]
        assert order("-loss") == ["short", "long", "empty"]
        page = client.get("/").get_data(as_text=True)
        assert 'data-sort="disk_bytes"' in page and 'data-sort="loss"' in page
    finally:
        app.extensions["rankwatch_runs"].stop()


def test_a_page_never_waits_for_every_idle_run_to_be_read(tmp_path):
    """Idle runs not read yet answer as unread rows past the request's budget; the loop reads them."""
    from app.compose import build
    from app.config import from_env
    from app.runs.registry import Registry
    from app.runs.rows import UNREAD_MESSAGE, Rows

    open_run = functools.partial(build, live=False)

    root = tmp_path / "root"
    for name in ("a", "b", "c"):
        write_job(root / name, 2)
        for r in range(2):  # a day old: idle, not live
            write_heartbeat(root / name, heartbeat(r, 2, seq=5, now=time.time() - 86400, state="finished"))
        for path in (root / name).rglob("*"):  # discovery judges activity by the files' times
            os.utime(path, (time.time() - 86400,) * 2)
    config = {**from_env(), "RUNS_ROOT": str(root), "RUN_DIR": ""}
    registry = Registry(config, lambda path, run_id: open_run(path, config))
    rows = Rows(registry, open_run, config)
    body = rows.table(budget_s=0.0)
    assert body["total"] == 3 and body["unread"] == 3, body
    assert all(r["status_message"] == UNREAD_MESSAGE and r["world_size"] is None for r in body["runs"])
    assert rows.warm(budget_s=60.0) == 3
    body = rows.table(budget_s=0.0)
    assert body["unread"] == 0 and [r["world_size"] for r in body["runs"]] == [2, 2, 2], body
    assert {r["state"] for r in body["runs"]} == {"finished"}
    # A script (``rankwatch runs``) waits for every row.
    fresh = Rows(Registry(config, lambda path, run_id: open_run(path, config)), open_run, config)
    assert fresh.table(budget_s=None)["unread"] == 0
