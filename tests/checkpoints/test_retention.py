"""Issue 18: checkpoint retention -- the keep rules, the invariants, plan then apply, health, disk.

Synthetic checkpoint files in the real formats (tests/helpers/ckptcraft.py), indexed
by the real index, deleted by the real deleter.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from app import create_app
from app.audit import AuditLog
from app.checkpoints import retention as rt
from tests.helpers import ckptcraft
from tests.helpers.app import AUTH, make_app
from tests.helpers.checkpoints import CONFIG, OLD, nan_set, periodic, retention, sid
from tests.helpers.heartbeats import heartbeat, write_job
from trainer_bridge.rundir import ckptindex, runfiles


def stop_set(run_dir: Path, step: int, ranks=(0, 1)) -> None:
    for r in ranks:
        p = ckptcraft.write(
            run_dir / f"checkpoints/rank_{r}/rankwatch-1_{step}.ckpt", ckptcraft.ckpt(global_step=step)
        )
        os.utime(p, (OLD, OLD))


def actions(plan: rt.Plan) -> dict:
    return {e.global_step: e.action for e in plan.entries if e.kind == "set"}


def whys(plan: rt.Plan) -> dict:
    return {e.global_step: e.why for e in plan.entries if e.kind == "set"}


@pytest.fixture
def job(run_dir):
    write_job(run_dir, 2)
    return run_dir


def test_keeps_the_newest_n_complete_and_deletes_older(job):
    for step in (10, 20, 30, 40, 50):
        periodic(job, step)
    p = retention(job).plan(2, {})
    assert actions(p) == {50: "keep", 40: "keep", 30: "keep", 20: "delete", 10: "delete"}
    assert whys(p)[50] == "kept: newest complete healthy"
    assert whys(p)[40] == "kept: newest 3 complete"
    assert p.frees_bytes == sum(e.bytes for e in p.entries if e.global_step in (10, 20)) > 0


def test_milestones_pins_and_stop_sets_are_kept(job):
    for step in (10, 20, 30, 40, 50, 60):
        periodic(job, step)
    stop_set(job, 15)
    runfiles.atomic_write_json(
        job / "rankwatch/retention.json", {"keep": 1, "every": 20, "pinned": [sid(30)]}
    )
    p = retention(job).plan(2, {})
    got = actions(p)
    assert got[60] == "keep" and got[40] == "keep" and got[20] == "keep"  # newest, milestones
    assert got[30] == "keep" and whys(p)[30] == "kept: pinned"
    assert got[15] == "keep" and "bridge resumes" in whys(p)[15]
    assert got[50] == "delete" and got[10] == "delete"
    assert p.policy.source.endswith("retention.json") and p.policy.keep == 1


def test_a_bad_override_file_is_reported_and_the_settings_hold(job):
    for step in (10, 20, 30, 40):
        periodic(job, step)
    (job / "rankwatch/retention.json").write_text('{"keep": "all"}')
    p = retention(job).plan(2, {})
    assert p.policy.keep == 3 and p.policy.errors and "ignored" in p.policy.errors[0]
    assert actions(p)[10] == "delete"


def test_partial_sets_older_than_the_newest_complete_go_newer_ones_stay(job):
    periodic(job, 10)
    periodic(job, 20, ranks=(0,))  # rank 1 lost its file: a partial set
    periodic(job, 30)
    periodic(job, 40, ranks=(1,))  # being written: newer than every complete set
    p = retention(job, RETENTION_KEEP=1).plan(2, {})
    assert actions(p) == {40: "keep", 30: "keep", 20: "delete", 10: "delete"}
    assert "partial" in whys(p)[20] and "not complete yet" in whys(p)[40]


def test_a_partial_set_is_held_while_its_ranks_still_train(job):
    periodic(job, 10, ranks=(0,))
    for step in (20, 30, 40, 50):
        periodic(job, step)
    r = retention(job, RETENTION_KEEP=1)
    training = {0: heartbeat(0, 2), 1: heartbeat(1, 2)}
    p = r.plan(2, training)
    assert actions(p)[10] == "keep" and "still train" in whys(p)[10]
    assert actions(p)[20] == "delete"  # complete sets are not held by training
    exited = {r: heartbeat(r, 2, state="exited") for r in (0, 1)}
    assert actions(r.plan(2, exited))[10] == "delete"


def test_never_deletes_without_a_newer_complete_set(job):
    periodic(job, 10, ranks=(0,))
    periodic(job, 20, ranks=(1,))
    p = retention(job, RETENTION_KEEP=1).plan(2, {})
    assert set(actions(p).values()) == {"keep"}


def test_a_set_being_written_is_never_collected(job):
    for step in (10, 20, 30, 40):
        periodic(job, step)
    r = retention(job, RETENTION_KEEP=1)
    # A slow rank is still writing set 10: its file grows now.
    path = job / "ckpt/rank_1/net-1_10.ckpt"
    with open(path, "ab") as f:
        f.write(b"\0" * 64)
    p = r.plan(2, {})
    assert actions(p)[10] == "keep" and "may still be written" in whys(p)[10]
    assert actions(p)[20] == "delete"
    r.apply(p.hash, 2, {}, who="test")
    assert path.exists() and (job / "ckpt/rank_0/net-1_10.ckpt").exists()
    assert not (job / "ckpt/rank_0/net-1_20.ckpt").exists()


def test_a_rank_in_the_saving_stage_holds_every_deletion(job):
    for step in (10, 20, 30, 40):
        periodic(job, step)
    hb = heartbeat(1, 2, state="stopping")
    hb["stop"] = {"request_id": "r1", "source": "flag", "stage": "saving", "at": {}}
    p = retention(job, RETENTION_KEEP=1).plan(2, {0: heartbeat(0, 2), 1: hb})
    assert not p.deletions
    assert "rank(s) 1 are saving" in whys(p)[10]


def test_unhealthy_sets_are_flagged_skipped_by_resume_and_the_newest_healthy_kept(job):
    for step in (10, 20, 30, 40):
        periodic(job, step)
    stop_set(job, 45)
    stop_set(job, 50)
    # MindFormers' record (rank 0's file name) says 30 is healthy, 40 is not; the bridge's own
    # append_dict flag says stop set 50 was saved after a NaN loss.
    (job / "ckpt/health_ckpts.json").write_text(
        json.dumps(
            [{"is_health": 0, "ckpt_name": "net-1_30.ckpt"}, {"is_health": 1, "ckpt_name": "net-1_40.ckpt"}]
        )
    )
    ckptcraft.write(
        job / "checkpoints/rank_1/rankwatch-1_50.ckpt",
        ckptcraft.ckpt(ckptcraft.scalar_int("rankwatch_loss_finite", 0), global_step=50),
    )
    r = retention(job, RETENTION_KEEP=1)
    p = r.plan(2, {})
    assert "health_ckpts.json" in p.health[sid(40)]
    assert "NaN" in next(v for k, v in p.health.items() if k.endswith("#g50"))
    # The bridge's resume passes over set 50 to 45; the page says why.
    index = r.service.index(2, force=True)
    from app.checkpoints.resume import bridge_default
    from trainer_bridge import saving

    assert bridge_default(index).global_step == 45
    unhealthy = rt.ckpthealth.unhealthy(str(job), index)
    assert saving.find_resume_point(index, 0, None, unhealthy).global_step == 45
    body = r.service.body(2)
    s50 = next(s for s in body["sets"] if s["global_step"] == 50)
    assert s50["unhealthy"] and any("does not resume" in n for n in s50["notes"])
    # 50 is a stop set (kept), 45 the resume set; the unhealthy 40 and healthy 30 are not protected.
    assert actions(p)[50] == "keep" and actions(p)[45] == "keep"
    assert "resumes" in whys(p)[45] and actions(p)[40] == "delete" and "unhealthy" in whys(p)[40]


def test_an_exception_save_is_flagged(job):
    for r in (0, 1):
        ckptcraft.write(job / f"ckpt/rank_{r}/net-1_7_breakpoint.ckpt", ckptcraft.ckpt(global_step=7))
    periodic(job, 10)
    index = ckptindex.scan(job, 2)
    flagged = rt.ckpthealth.unhealthy(str(job), index)
    assert [s.global_step for s in index.sets if s.id in flagged] == [7]
    assert "exception_save" in next(iter(flagged.values()))


def test_apply_deletes_whole_sets_audits_each_and_is_idempotent(job):
    for step in (10, 20, 30, 40, 50):
        periodic(job, step)
    r = retention(job)
    p = r.plan(2, {})
    out = r.apply(p.hash, 2, {}, who="alice")
    assert sorted(out["deleted"]) == sorted([sid(10), sid(20)])
    assert out["frees_bytes"] == p.frees_bytes
    assert not list(job.glob("ckpt/rank_*/net-1_10.ckpt")) and not list(job.glob("ckpt/rank_*/net-1_20.ckpt"))
    assert len(list(job.glob("ckpt/rank_*/*.ckpt"))) == 6
    rows = [row for row in r.service.audit.rows() if row["action"] == "delete"]
    assert len(rows) == 2
    for row in rows:
        detail = json.loads(row["detail"])
        assert row["who"] == "alice" and detail["rule"].startswith("delete: older") and detail["bytes"] > 0
        assert detail["set"] in (sid(10), sid(20))
    assert not Path(rt.journal_path(str(job))).exists()
    # Again: nothing more to do (already gone is done).
    p2 = r.plan(2, {})
    assert not p2.deletions
    assert r.apply(p2.hash, 2, {}, who="alice")["deleted"] == []


def test_apply_refuses_a_plan_that_changed(job):
    for step in (10, 20, 30, 40):
        periodic(job, step)
    r = retention(job)
    p = r.plan(2, {})
    periodic(job, 50)  # a new set: now 20 goes too
    from app.errors import CheckpointRefused

    with pytest.raises(CheckpointRefused) as e:
        r.apply(p.hash, 2, {}, who="alice")
    assert e.value.status == 409
    assert (job / "ckpt/rank_0/net-1_10.ckpt").exists()


def test_leftover_temp_dirs_are_collected_once_old(job):
    for step in (10, 20):
        periodic(job, step)
    old_ttp = job / "ckpt/tft_saved_checkpoints-step_7_tmp/rank_0"
    ckptcraft.write(old_ttp / "ttp_rank_0-1_7.ckpt", b"x" * 100)
    orbax = job / "ckpt/5.orbax-checkpoint-tmp-123"
    ckptcraft.write(orbax / "d/file", b"y" * 10)
    nemo = ckptcraft.write(job / "ckpt/step=3.ckpt-unfinished", b"")
    young = job / "ckpt/tft_saved_checkpoints-step_9_tmp"
    ckptcraft.write(young / "rank_0/a.ckpt", b"z")
    for top in (old_ttp.parent, orbax, nemo):  # judged by the newest mtime inside (issue 32, P9)
        for p in [top, *(top.rglob("*") if top.is_dir() else ())]:
            os.utime(p, (OLD, OLD))
    r = retention(job)
    p = r.plan(2, {})
    temps = {e.id: e.action for e in p.entries if e.kind == "temp"}
    assert temps == {
        "ckpt/tft_saved_checkpoints-step_7_tmp": "delete",
        "ckpt/5.orbax-checkpoint-tmp-123": "delete",
        "ckpt/step=3.ckpt-unfinished": "delete",
        "ckpt/tft_saved_checkpoints-step_9_tmp": "keep",
    }
    r.apply(p.hash, 2, {}, who="cli")
    assert not old_ttp.parent.exists() and not orbax.exists() and not nemo.exists() and young.exists()


def test_interrupted_deletion_leaves_the_set_partial_with_the_reason(job):
    """The state a kill -9 leaves after the first unlink: journal written, rank 0 gone."""
    for step in (10, 20, 30, 40):
        periodic(job, step)
    r = retention(job)
    cset = next(s for s in r.service.index(2, force=True).sets if s.global_step == 10)
    runfiles.atomic_write_json(
        rt.journal_path(str(job)), {"sets": [{"id": cset.id, "kind": "set", "bytes": cset.bytes}]}
    )
    os.unlink(job / cset.files[0].path)  # lowest rank first
    assert cset.files[0].rank == 0
    body = r.service.body(2)
    s10 = next(s for s in body["sets"] if s["global_step"] == 10)
    assert not s10["complete"] and any("being deleted by retention" in n for n in s10["notes"])
    # Without job.json (layout world size) the set still counts rank 1: partial, not a 1-rank set.
    os.unlink(job / "rankwatch/job.json")
    idx = ckptindex.scan(job)
    assert not next(s for s in idx.sets if s.global_step == 10).complete
    r.apply(None, 0, {}, who="policy")
    assert not (job / cset.files[1].path).exists() and not Path(rt.journal_path(str(job))).exists()


def test_a_kill_after_the_last_unlink_leaves_a_journal_the_next_run_clears_with_nothing_to_delete(job):
    """Killed after deleting the last file of its plan, before dropping it from the journal: the
    next run has nothing to delete, audits the set as finished and removes the journal."""
    for step in (10, 20, 30):
        periodic(job, step)
    gone = {
        "id": "ckpt/rank_{rank}/net-{E}_{S}.ckpt#g5",
        "kind": "set",
        "bytes": 96,
        "why": "older",
        "who": "cli",
    }
    runfiles.atomic_write_json(rt.journal_path(str(job)), {"sets": [gone]})
    r = retention(job)
    assert r.plan(2, {}).deletions == []  # the three newest are kept: nothing to do
    r.apply(None, 2, {}, who="cli")
    assert not Path(rt.journal_path(str(job))).exists()
    rows = [x for x in AuditLog(job / "rankwatch/audit.sqlite3").rows() if x["action"] == "delete"]
    assert [x["outcome"] for x in rows] == [
        "deleted (an interrupted retention run finished it before it stopped)"
    ]


def test_disk_warning_when_free_space_is_below_the_next_save(job, monkeypatch):
    periodic(job, 10)
    index = ckptindex.scan(job, 2)
    ok = rt.disk(str(job), index)
    assert ok["low"] is False and ok["free_bytes"] > 0 and ok["run_bytes"] == index.sets[0].bytes

    class Tiny:
        f_bavail, f_frsize, f_blocks = 1, 1, 10

    monkeypatch.setattr(rt.os, "statvfs", lambda p: Tiny)
    low = rt.disk(str(job), index)
    assert low["low"] and "next save would fail" in low["warning"]


# -- the HTTP API ------------------------------------------------------------------------


@pytest.fixture
def client(job):
    app = make_app(job, **CONFIG)
    yield app.test_client()
    app.extensions["rankwatch"].watcher.stop()


def test_plan_then_apply_over_http(client, job):
    for step in (10, 20, 30, 40):
        periodic(job, step)
    r = client.get("/api/checkpoints/retention")
    assert r.status_code == 200
    body = r.get_json()
    assert set(body) >= {"policy", "hash", "sets", "frees_bytes", "disk"}
    assert {s["global_step"]: s["action"] for s in body["sets"]}[10] == "delete"
    assert set(body["sets"][0]) >= {"id", "global_step", "action", "why", "bytes"}
    # No token: refused. A stale hash: 409 in the error shape.
    assert client.post("/api/checkpoints/retention/apply", json={"hash": body["hash"]}).status_code == 401
    bad = client.post("/api/checkpoints/retention/apply", json={"hash": "0" * 32}, headers=AUTH)
    assert bad.status_code == 409 and bad.get_json()["status"] == 409 and "changed" in bad.get_json()["error"]
    assert client.post("/api/checkpoints/retention/apply", json={}, headers=AUTH).status_code == 400
    ok = client.post(
        "/api/checkpoints/retention/apply", json={"hash": body["hash"], "who": "bob"}, headers=AUTH
    )
    assert ok.status_code == 200 and ok.get_json()["deleted"] == [sid(10)]
    assert not (job / "ckpt/rank_0/net-1_10.ckpt").exists()


def test_pin_and_unpin_over_http_are_audited_and_honoured(client, job):
    for step in (10, 20, 30, 40):
        periodic(job, step)
    body = {"set": sid(10), "pinned": True, "who": "carol", "reason": "milestone eval"}
    assert client.post("/api/checkpoints/pin", json=body).status_code == 401
    r = client.post("/api/checkpoints/pin", json=body, headers=AUTH)
    assert r.status_code == 200 and r.get_json()["pins"] == [sid(10)]
    plan = client.get("/api/checkpoints/retention").get_json()
    assert {s["global_step"]: s["why"] for s in plan["sets"]}[10] == "kept: pinned"
    assert plan["policy"]["pinned"] == [sid(10)] and plan["frees_bytes"] == 0
    missing = client.post("/api/checkpoints/pin", json=body | {"set": "nope#g1"}, headers=AUTH)
    assert missing.status_code == 404
    r = client.post("/api/checkpoints/pin", json=body | {"pinned": False}, headers=AUTH)
    assert r.status_code == 200 and r.get_json()["pins"] == []
    plan = client.get("/api/checkpoints/retention").get_json()
    assert {s["global_step"]: s["action"] for s in plan["sets"]}[10] == "delete"
    rows = [r for r in AuditLog(job / "rankwatch/audit.sqlite3").rows() if r["action"] == "pin"]
    assert sorted((r["who"], r["outcome"]) for r in rows) == [("carol", "pinned"), ("carol", "unpinned")]


def test_dry_run_audits_and_alerts_but_deletes_nothing(job):
    for step in (10, 20, 30, 40):
        periodic(job, step)
    r = retention(job, RETENTION_MODE="dry_run")
    alerts = []
    out = r.tick(2, {}, alert=lambda *a: alerts.append(a))
    assert [e["global_step"] for e in out["dry_run"]["sets"] if e["action"] == "delete"] == [10]
    assert (job / "ckpt/rank_0/net-1_10.ckpt").exists()
    assert [a[1] for a in alerts] == ["retention_dry_run"]
    assert any(row["outcome"].startswith("dry run: would delete 1") for row in r.service.audit.rows())


def test_retention_mode_on_applies_after_a_new_complete_set(job):
    for step in (10, 20, 30):
        periodic(job, step)
    app = make_app(job, **{**CONFIG, "RETENTION_MODE": "on", "CHECKPOINT_SCAN_S": 0.001})
    watcher = app.extensions["rankwatch"].watcher
    try:
        watcher.tick()
        assert (job / "ckpt/rank_0/net-1_10.ckpt").exists()  # three sets: nothing to delete
        periodic(job, 40)
        # Past CHECKPOINT_SCAN_S since the last walk, so this tick's walk finds the new set: writing
        # it can take under a millisecond, and the tick then used the index it had (1 run in 8).
        time.sleep(0.01)
        watcher.tick()
        assert not (job / "ckpt/rank_0/net-1_10.ckpt").exists()
        rows = app.extensions["rankwatch"].checkpoints.audit.rows()
        assert any(row["who"] == "policy" and row["action"] == "delete" for row in rows)
    finally:
        watcher.stop()


def test_cli_gc_prints_the_plan_and_applies(job):
    from click.testing import CliRunner

    from app.cli import main

    for step in (10, 20, 30, 40, 50):
        periodic(job, step)
    runner = CliRunner()
    out = runner.invoke(main, ["checkpoints", "gc", "--run-dir", str(job), "--keep", "4"])
    assert out.exit_code == 0, out.output
    assert "delete" in out.output and (job / "ckpt/rank_0/net-1_10.ckpt").exists()
    out = runner.invoke(main, ["checkpoints", "gc", "--run-dir", str(job), "--keep", "4", "--apply"])
    assert out.exit_code == 0, out.output
    assert "Deleted 1 item(s)" in out.output and not (job / "ckpt/rank_0/net-1_10.ckpt").exists()
    assert (job / "ckpt/rank_0/net-1_20.ckpt").exists()
    rows = AuditLog(job / "rankwatch/audit.sqlite3").rows()
    assert any(row["who"] == "cli" for row in rows)
    # The list itself still works as before.
    assert runner.invoke(main, ["checkpoints", "--run-dir", str(job)]).exit_code == 0


def test_a_nearly_full_filesystem_warns_before_the_save_that_would_fail(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=800k", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        run = mnt / "run"
        write_job(run, 2)
        big = ckptcraft.tensor([40_000], "Float32", b"\1" * 160_000)
        periodic(run, 10, extra=ckptcraft.entry("big", big))
        r = retention(run)
        alerts = []
        first = r.tick(2, {}, alert=lambda *a: alerts.append(a))
        assert first["disk"]["low"] is False and not alerts  # 320 KB saved, ~480 KB free
        periodic(run, 20, extra=ckptcraft.entry("big", big))  # ~160 KB free: less than the next save
        second = r.tick(2, {}, alert=lambda *a: alerts.append(a))
        assert second["disk"]["low"] and "next save would fail" in second["disk"]["warning"]
        assert [a[1] for a in alerts] == ["checkpoint_disk_low"]
        body = r.body(2, {})
        assert body["disk"]["low"] and body["disk"]["free_bytes"] < body["disk"]["next_save_bytes"]
        # The warning came first; the save it warned of fails mid-write.
        with pytest.raises(OSError) as e:
            periodic(run, 30, extra=ckptcraft.entry("big", big))
        assert e.value.errno == errno.ENOSPC
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_bad_retention_mode_is_refused_with_a_message(job):
    from click.testing import CliRunner

    from app.cli import main

    out = CliRunner().invoke(
        main, ["checkpoints", "gc", "--run-dir", str(job)], env={"RANKWATCH_RETENTION_MODE": "sometimes"}
    )
    assert out.exit_code == 1 and "RETENTION_MODE must be one of off, dry_run, on" in out.output
    with pytest.raises(ValueError, match="RETENTION_MODE"):
        create_app({"RUN_DIR": str(job), "RETENTION_MODE": "sometimes"})


def test_a_pending_rollback_keeps_its_possible_targets_until_it_is_cleared(job):
    """Issue 34: retention never deletes the rollback target while a rollback is pending."""
    from trainer_bridge.rundir import rollbacks

    for step in (10, 20, 30, 40, 50, 60):
        periodic(job, step)
    runfiles.atomic_write_json(job / "rankwatch/retention.json", {"keep": 1})
    ev = rollbacks.Evidence(rule="nonfinite", rank=0, step=47, value="nan")
    rollbacks.write_request(
        job,
        rollbacks.Request(
            rule="nonfinite", evidence=ev, first_step=45, skip_batches=20, asked_at=time.time()
        ),
    )
    r = retention(job)
    p = r.plan(2, {})
    assert actions(p) == {60: "keep", 50: "delete", 40: "keep", 30: "keep", 20: "keep", 10: "delete"}
    assert whys(p)[40] == "kept: the target of the loss-spike rollback pending from global step 45"
    assert whys(p)[30] == "kept: a loss-spike rollback from global step 45 is pending (a possible target)"
    r.apply(p.hash, 2, {}, who="test")
    assert sorted(s.global_step for s in ckptindex.scan(job, world_size=2).sets) == [20, 30, 40, 60]
    rollbacks.clear_request(job)
    assert actions(r.plan(2, {})) == {60: "keep", 40: "delete", 30: "delete", 20: "delete"}


def test_a_pending_rollbacks_target_is_kept_when_every_newer_candidate_is_passed_over(job):
    """The newest candidates hold NaN weights: the target, older than all of them, is kept too (issue 34)."""
    from app.supervise import rollback
    from trainer_bridge.rundir import rollbacks

    for step in (10, 50, 60):
        periodic(job, step)
    for step in (20, 30, 40):  # periodic saves after the weights went NaN: no name or flag says so
        nan_set(job, step)
        for r in (0, 1):
            os.utime(job / f"ckpt/rank_{r}/net-1_{step}.ckpt", (OLD, OLD))
    runfiles.atomic_write_json(job / "rankwatch/retention.json", {"keep": 1})
    ev = rollbacks.Evidence(rule="nonfinite", rank=0, step=47, value="nan")
    req = rollbacks.Request(
        rule="nonfinite", evidence=ev, first_step=45, skip_batches=20, asked_at=time.time()
    )
    rollbacks.write_request(job, req)
    p = retention(job).plan(2, {})
    assert whys(p)[10] == "kept: the target of the loss-spike rollback pending from global step 45"
    assert actions(p)[10] == "keep"
    # What rankwatch launch then picks.
    d = rollback.decide(str(job), 2, req, rollback.Settings(), lambda said: None)
    assert d.resume["global_step"] == 10
