"""The flag file under stress, in a real msrun job.

(A torn flag write and garbage from another tool are in
``tests/bridge/test_bridge_msrun.py::test_corrupt_flag_neither_stops_nor_crashes_training``,
which also checks that the dashboard reports the flag as unreadable.)

Here: the stop flag is written while the ranks save a periodic checkpoint
(``ModelCheckpoint`` every N steps, as MindSpore's disaster-recovery sample
does). The ranks must still agree on one stop step, and every checkpoint set
on disk, periodic and graceful, must be complete and readable.
"""

from __future__ import annotations

import pytest

from tests.helpers.faults import measure
from tests.helpers.jobs import UNTIL_STOPPED, dump, write_flag
from trainer_bridge.rundir import ckptindex, ckptpaths

pytestmark = pytest.mark.msrun

EVERY = 4


def test_flag_written_during_a_periodic_checkpoint_save(tmp_path, start_job):
    run = tmp_path / "run"
    # Keep every periodic save: on a busy host the stop can come more than
    # ModelCheckpoint's default 5 saves later, and rotation would delete the one the flag met.
    job = start_job(
        run, epochs=UNTIL_STOPPED, step_delay=0.02, extra=["--ckpt-every", str(EVERY), "--ckpt-keep", "1000"]
    )
    periodic = [run / "ckpt_of_rank" / str(r) for r in (0, 1)]
    job.wait_for_step(EVERY + 1)
    # The next periodic save: write the flag the moment rank 0's file of
    # that step appears, while the ranks are saving it.
    target = (max(h["global_step"] for h in job.heartbeats()) // EVERY + 1) * EVERY
    job.wait_until(
        lambda hbs: list(periodic[0].glob(f"lenet-*_{target}.ckpt*")),
        f"the periodic save of step {target}",
        poll=0.005,
    )
    write_flag(run, request_id="req-during-save", reason="fault test")
    assert job.wait() == 0, job.logs()

    # One stop step, and each rank ran exactly up to it.
    stop_step, _ = job.stopped_together()
    measure(
        "flag_during_save.stop_step_after_save_step",
        stop_step - target,
        unit="steps",
        save_step=target,
        stop_step=stop_step,
    )
    # ModelCheckpoint saved on both ranks, including the save the flag met.
    names = [sorted(p.name for p in d.glob("*.ckpt")) for d in periodic]
    assert names[0] == names[1] and names[0], names

    index = ckptindex.scan(run, 2)
    assert not index.errors, index.errors
    by_origin = {}
    for s in index.sets:
        by_origin.setdefault(s.origin, []).append(s)
        assert s.complete and all(f.ok for f in s.files), dump(s.to_dict())
    bridge_sets = by_origin.get(ckptpaths.ORIGIN_BRIDGE, [])
    assert [s.global_step for s in bridge_sets] == [stop_step], dump(index.to_dict())
    periodic_sets = [s for s in index.sets if s.layout.startswith("ckpt_of_rank/")]
    assert any(s.global_step == target for s in periodic_sets), dump([s.to_dict() for s in periodic_sets])
    assert index.newest_complete is not None
    assert index.newest_complete.global_step == stop_step
    measure(
        "flag_during_save.sets",
        len(index.sets),
        unit="complete sets",
        layouts=sorted({s.layout for s in index.sets}),
    )
