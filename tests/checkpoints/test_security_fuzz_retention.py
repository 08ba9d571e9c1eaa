"""Issue 32, "what must be shown": a fuzzer for retention (``RETENTION_MODE=on``).

Each round makes a run directory of real checkpoint files (crafted
ModelCheckpoint-like sets, and now and then a real bridge set saved by
MindSpore), then, at random: newer incomplete or truncated sets, leftovers
named like unfinished saves in odd places (data, notes, the run's top,
beside the checkpoints), ``ckpt/rank_1`` swapped for a symlink to OUT (a
run-shaped directory outside the run), and during the apply a writer
saving newer sets and a neighbour swapping ``ckpt/rank_0`` for a symlink
to OUT and back. Then the real retention engine applies its plan.

After every apply: the newest complete set as written (every rank's file
intact) and the set the bridge resumes from (``resume_set`` before the
apply) are still there byte for byte, wherever the swap left them; the
sets the writer saved during the apply are there; no leftover outside
the checkpoint folders was touched. At the end OUT's tree is unchanged.

Forged agent listings are not fuzzed here: they need an agent and Redis
per round (``test_security_retention.py`` runs that attack once).

``RANKWATCH_FUZZ_ITERS`` rounds (40 by default: well under a minute),
``RANKWATCH_FUZZ_SEED`` replays one seed; the count is printed.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time

import pytest

from tests.helpers.checkpoints import OLD, periodic, retention, save_bridge_set
from tests.helpers.faults import tree_snapshot
from tests.helpers.heartbeats import write_job
from trainer_bridge.rundir.ckptindex import resume_set

pytestmark = pytest.mark.security

ITERS = int(os.environ.get("RANKWATCH_FUZZ_ITERS", "40"))
SEED = int(os.environ.get("RANKWATCH_FUZZ_SEED", "32"))
WORLD = 2


def digest(path) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def set_files(run, step: int) -> list:
    return [run / f"ckpt/rank_{r}/net-1_{step}.ckpt" for r in range(WORLD)]


class Swapper(threading.Thread):
    """A neighbour who swaps ``ckpt/rank_0`` for a symlink to OUT and back, until told to stop."""

    def __init__(self, run_dir, out, rng_seed: int):
        super().__init__(daemon=True)
        self.run_dir, self.out, self.rng = run_dir, out, random.Random(rng_seed)
        self.done = threading.Event()
        self.swaps = 0

    def run(self):
        real, aside = self.run_dir / "ckpt/rank_0", self.run_dir / "ckpt/.rank_0.aside"
        while not self.done.is_set():
            os.rename(real, aside)
            os.symlink(self.out / "ckpt/rank_0", real, target_is_directory=True)
            self.done.wait(self.rng.random() * 0.004)
            os.unlink(real)
            os.rename(aside, real)
            self.swaps += 1
            self.done.wait(self.rng.random() * 0.004)


def one_round(base, out, rng: random.Random, i: int, stats: dict) -> None:
    run = base / f"round{i}"
    write_job(run, WORLD)
    steps = sorted(rng.sample(range(10, 400, 10), rng.randint(2, 7)))
    for step in steps:
        periodic(run, step)
    intact = list(steps)
    top = steps[-1]
    if rng.random() < 0.5:  # a newer set only rank 0 wrote
        top += 10
        periodic(run, top, ranks=(0,))
    if rng.random() < 0.5:  # a newer set whose rank 1 file was cut short
        top += 10
        periodic(run, top)
        cut = set_files(run, top)[1]
        cut.write_bytes(cut.read_bytes()[:20])
        os.utime(cut, (OLD, OLD))
    bridge_step = 0
    if rng.random() < 0.3:  # a real bridge set (MindSpore's own save): the resume set
        bridge_step = rng.choice(steps) + 5
        save_bridge_set(run, bridge_step)
        for p in (run / "ckpt").rglob("*"):
            os.utime(p, (OLD, OLD))
        stats["bridge"] += 1
    # The newest complete set as written, unless a bridge set is newer (then it is also the resume set).
    survivors = [] if bridge_step > max(intact) else set_files(run, max(intact))
    index = retention(run).service.index(WORLD, True)
    resume = resume_set(index)
    if resume is not None:
        survivors += [run / f.path for f in resume.files]
    keep_bytes = {p: digest(p) for p in survivors}
    assert all(keep_bytes.values()), keep_bytes

    odd = []
    for where in rng.sample(
        ["data/x-unfinished", "notes/y-unfinished", "z-unfinished", "logs/a.orbax-checkpoint-tmp-1"], 2
    ):
        path = run / where
        path.mkdir(parents=True)
        (path / "content").write_bytes(b"precious")
        for p in (path / "content", path):
            os.utime(p, (OLD, OLD))
        odd.append(path / "content")
    if rng.random() < 0.5:  # beside the checkpoints: a real leftover, old (it may go)
        left = run / "ckpt/rank_0/net-1_999.ckpt.orbax-checkpoint-tmp-1"
        left.mkdir()
        (left / "part").write_bytes(b"p")
        for p in (left / "part", left):
            os.utime(p, (OLD, OLD))

    aside = None
    if rng.random() < 0.3:  # rank 1's folder swapped for a symlink out, before the plan
        aside = run / "ckpt/.rank_1.moved"
        os.rename(run / "ckpt/rank_1", aside)
        os.symlink(out / "ckpt/rank_1", run / "ckpt/rank_1", target_is_directory=True)
        # The run's disk now shows no complete periodic set (rank 1's folder is a symlink, not
        # followed), so rank 0's halves may go by the policy; nothing moved aside may, nor the
        # resume set.
        keep_bytes = {p: d for p, d in keep_bytes.items() if p.parent != run / "ckpt/rank_0"}
        keep_bytes = {p: d for p, d in keep_bytes.items() if p.parent != run / "ckpt/rank_1"}
        keep_bytes |= {p: digest(p) for p in aside.iterdir()}
        stats["symlinked"] += 1

    written = []

    def writer():
        for k in range(rng.randint(1, 3)):
            step = 1000 + 10 * k
            periodic(run, step, mtime=time.time())
            written.extend(set_files(run, step))

    # The writer and the swapper take turns: a writer into a folder swapped for a symlink
    # would write OUT itself, which is the neighbour's doing, not retention's.
    threads, swapper = [], None
    if aside is not None:
        pass
    elif rng.random() < 0.5:
        threads.append(threading.Thread(target=writer, daemon=True))
        stats["writing"] += 1
    else:
        swapper = Swapper(run, out, rng.randrange(10**9))
        threads.append(swapper)
        stats["swapping"] += 1
    engine = retention(run, RETENTION_MODE="on", RETENTION_KEEP=rng.choice([1, 2]))
    for t in threads:
        t.start()
    try:
        answer = engine.apply(None, WORLD, {}, who="fuzz")
        seen = [(e.id, e.why) for e in engine.plan(WORLD, {}, force=True).entries]
    finally:
        if swapper is not None:
            swapper.done.set()
        for t in threads:
            t.join(30)
    stats["deleted"] += len(answer["deleted"])
    lost = [str(p) for p, d in keep_bytes.items() if digest(p) != d]
    assert not lost, (
        f"seed {SEED} round {i}: the newest complete or the resume set lost {lost}; {answer}; threads {[type(t).__name__ for t in threads]}; plan after: {seen}"
    )
    assert all(p.exists() for p in written), f"seed {SEED} round {i}: a set saved during the apply went"
    assert all(p.read_bytes() == b"precious" for p in odd), f"seed {SEED} round {i}: a non-leftover went"


def test_retention_fuzz_never_deletes_the_newest_complete_or_the_resume_set(tmp_path):
    out = tmp_path / "OUT"
    write_job(out, WORLD)
    for step in (10, 20, 30, 40, 50):
        periodic(out, step)
    before = tree_snapshot(out)
    rng = random.Random(SEED)
    stats = {"bridge": 0, "symlinked": 0, "swapping": 0, "writing": 0, "deleted": 0}
    for i in range(ITERS):
        one_round(tmp_path, out, rng, i, stats)
    print(f"retention fuzz: seed {SEED}, {ITERS} rounds, {stats}")
    assert stats["deleted"] > 0, "nothing was ever deleted: the fuzzer tested nothing"
    after = tree_snapshot(out)
    changed = {
        "removed": sorted(set(before) - set(after)),
        "added": sorted(set(after) - set(before)),
        "changed": sorted(k for k in set(before) & set(after) if before[k] != after[k]),
    }
    assert after == before, f"seed {SEED}: OUT was written: {changed}"
