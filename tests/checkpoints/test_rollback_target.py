"""One rollback target for the page and for ``rankwatch launch`` (issue 34): ``app/checkpoints/target.py``.

The page's target (``incidents.spikes.target_before``, written into the
``observed`` / ``requested`` lines) and the supervisor's (``rollback.decide``)
are asked about the same run directory, with real checkpoint files, and
must name the same set. Three cases are ones where they used to differ
(checked against the old ``target_before``): the page read no tensors (a
periodic save with NaN weights, also as the only set left), took no note of the detector's record (a set
saved inside an earlier observed spike), and had no "unverified". A corrupt
file and one step held twice agreed already, and are checked to stay so.
"""

from __future__ import annotations

import os
import time

from app.checkpoints import finite, target
from app.checkpoints.indexbody import IndexView
from app.checkpoints.verify import Verifier
from app.incidents import spikes
from app.supervise import rollback
from tests.helpers import ckptcraft
from tests.helpers.checkpoints import OLD, bridge_id, nan_set, periodic, save_bridge_set, sid
from trainer_bridge.rundir import ckpthealth, ckptindex, rollbacks


def request(first_step: int) -> rollbacks.Request:
    ev = rollbacks.Evidence(rule="nonfinite", rank=1, step=first_step + 3, value="nan", ranks=2)
    return rollbacks.Request(
        rule="nonfinite", evidence=ev, first_step=first_step, skip_batches=20, asked_at=time.time()
    )


def both(
    run_dir, first_step: int, memo: dict | None = None, settings: rollback.Settings | None = None
) -> tuple[str | None, str, str | None, str]:
    """(the page's set, its words, the supervisor's set, its words) for a spike from ``first_step``."""
    index = ckptindex.scan(run_dir, world_size=2)
    page, why = spikes.target_before(index, str(run_dir), first_step, memo)
    said = []
    d = rollback.decide(str(run_dir), 2, request(first_step), settings or rollback.Settings(), said.append)
    return (page.id if page else None), why, (d.resume or {}).get("set"), d.said


def test_a_periodic_save_with_nan_weights_is_passed_over_by_both(run_dir):
    periodic(run_dir, 10)
    periodic(run_dir, 20)
    nan_set(run_dir, 30)  # saved after the weights went NaN: no name, flag or health file says so
    index = ckptindex.scan(run_dir, world_size=2)
    assert sid(30) not in ckpthealth.unhealthy(str(run_dir), index)  # all the page used to look at
    page, why, sup, said = both(run_dir, 45)
    assert page == sup == sid(20)
    assert f"set {sid(30)}: not finite: ckpt/rank_0/net-1_30.ckpt: w holds NaN or infinite values" in why
    assert "not finite" in said


def test_the_detectors_record_a_corrupt_file_and_one_step_held_twice(run_dir):
    periodic(run_dir, 10)
    save_bridge_set(run_dir, 20)
    periodic(run_dir, 20)  # the same global step as the bridge's set: the bridge's is the one loaded
    periodic(run_dir, 30, ranks=(1,))
    ckptcraft.write(run_dir / "ckpt/rank_0/net-1_30.ckpt", b"\x93garbage")  # rank 0's file is corrupt
    page, why, sup, said = both(run_dir, 45)
    assert page == sup == bridge_id(20)
    assert f"set {sid(30)}: corrupt on rank(s) 0" in why
    # An earlier observed spike spanned steps 18-22: no set saved inside it is a target.
    ev = rollbacks.Evidence(rule="spike", rank=0, step=22, value=9.5, level=1.2)
    rollbacks.append(
        run_dir, rollbacks.Line(kind="observed", at=time.time(), rule="spike", evidence=ev, first_step=18)
    )
    page, why, sup, said = both(run_dir, 45)
    assert page == sup == sid(10)
    assert "in a spike the detector recorded (global steps 18-22)" in why


def test_the_supervisors_published_margin_is_the_pages_and_a_bad_file_is_said(run_dir):
    for step in (10, 20, 30):
        periodic(run_dir, step)
    wide = rollback.Settings(margin=10)
    # No supervisor has published: the page assumes the default margin of 1.
    page, why, sup, _ = both(run_dir, 38, settings=wide)
    assert (page, sup) == (sid(30), sid(20))
    # rankwatch launch --rollback-margin 10 publishes it when it starts: the page names its set.
    said = []
    rollback.publish(str(run_dir), wide, said.append)
    assert said == []
    page, why, sup, _ = both(run_dir, 38, settings=wide)
    assert page == sup == sid(20) and "before step 28" in why
    # A bad file is the default margin, and the reason reaches GET /api/spikes.
    (run_dir / "rankwatch" / rollbacks.SETTINGS_NAME).write_text('{"margin": -4}')
    published, error = rollbacks.read_settings(run_dir)
    assert published is None and error.startswith(f"{rollbacks.SETTINGS_NAME}: ")
    page, _, _, _ = both(run_dir, 38)
    assert page == sid(30)


def test_no_target_for_either_and_the_nan_breakpoint_is_refused(run_dir):
    nan_set(run_dir, 10)
    nan_set(run_dir, 20, name="net-1_{s}_breakpoint.ckpt")
    page, why, sup, said = both(run_dir, 25)
    assert page is None and sup is None
    assert "no complete healthy set before step 24" in why and "breakpoint" in why and "not finite" in why


def test_past_the_pages_read_budget_the_target_is_unverified_and_verdicts_are_remembered(
    run_dir, monkeypatch
):
    periodic(run_dir, 10)
    nan_set(run_dir, 20)
    index = ckptindex.scan(run_dir, world_size=2)
    small = sum(s.bytes for s in index.sets if s.global_step == 20)
    # Too small to read set 20: the page names it, unverified, where the supervisor reads it.
    monkeypatch.setattr(target, "DASHBOARD_SCAN_BYTES", small - 1)
    memo: dict = {}
    page, why, sup, _ = both(run_dir, 30, memo)
    assert page == sid(20) and sup == sid(10)
    assert "unverified: its" in why and "bytes of tensors are past the" in why
    assert memo == {}
    # With room to read it, the page agrees, and keeps the verdict of the file it found NaN in.
    monkeypatch.setattr(target, "DASHBOARD_SCAN_BYTES", small)
    page, why, sup, _ = both(run_dir, 30, memo)
    assert page == sup == sid(10) and list(memo.values()) == ["w holds NaN or infinite values"]
    reader = finite.Reader(0, memo)  # no budget at all: the remembered verdict decides
    choice = target.rollback_target(index, str(run_dir), 30, 1, [], tensors=reader)
    assert choice.set_id == sid(10) and f"set {sid(20)}: not finite" in choice.note
    assert choice.unverified.endswith("bytes of tensors are past the 0 MiB this choice reads")


def test_the_branch_a_rollback_left_is_passed_over_by_both_and_named_on_the_page(run_dir):
    for step in (10, 20):
        periodic(run_dir, step)
    save_bridge_set(run_dir, 27)  # the stop's own set, after the spike began at 25
    for p in run_dir.rglob("*.ckpt"):
        os.utime(p, (OLD, OLD))
    d = rollback.decide(str(run_dir), 2, request(25), rollback.Settings(), [].append)
    rollback.committed(str(run_dir), d, 2, [].append)
    assert d.resume["set"] == sid(20)
    # A second spike, in the relaunched branch before it saved a set: never the stop's set.
    page, _, supervisor, _ = both(run_dir, 40)
    assert page == supervisor == sid(20)
    view = IndexView(ckptindex.scan(run_dir, world_size=2), 2, str(run_dir), Verifier(None, None))
    body = view.body()
    stop = next(s for s in body["sets"] if s["id"] == bridge_id(27))
    left = "left behind by the rollback from the spike at global step 25 to global step 20"
    # The bridge alone does not know the branch: an unchanged relaunch by hand would take the set.
    assert body["bridge_resume"] == bridge_id(27) and body["newest_healthy"] == sid(20)
    assert (
        f"{left}: its weights are the spike's; rankwatch launch never resumes from it; pin an older set"
        in (" | ".join(stop["notes"]))
    )
