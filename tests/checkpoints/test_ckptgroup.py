"""trainer_bridge.rundir.ckptgroup: the index regrouped where paths changed equals ``build_index``'s.

Seeded random changes to a set of files (a hub's merged listings): sets
saved, dropped, files gone corrupt, files whose global step only their name
tells (their layout is grouped whole), files of no set, and the world size
changing. After each change, the kept index is compared with the one
``build_index`` groups afresh from the same files.
"""

from __future__ import annotations

import random

import pytest

from trainer_bridge.rundir import ckptindex
from trainer_bridge.rundir.ckptgroup import Grouping

LAYOUTS = (
    "checkpoints/rank_{r}/rankwatch-1_{g}.ckpt",  # the bridge's: the global step is read
    "ckpt_of_rank/{r}/lenet-1_{g}.ckpt",  # periodic: some files tell it by their name alone
    "export/rank_{r}/net-1_{g}.mindir",  # no set
)


def entry(layout: str, rank: int, g: int, rng: random.Random) -> dict:
    status = "corrupt" if rng.random() < 0.1 else "ok"
    told = layout.startswith("checkpoints") or rng.random() < 0.7
    return {
        "path": layout.format(r=rank, g=g),
        "format": "mindir" if layout.endswith(".mindir") else "ckpt",
        "bytes": rng.randrange(1, 1 << 20),
        "mtime": 1.7e9 + g,
        "status": status,
        "reason": None if status == "ok" else "truncated",
        "epoch": 1 if told else None,
        "step": g if told else None,
        "global_step": g if told and status == "ok" else None,
        "step_source": "contents" if told else None,
    }


def shape(index: ckptindex.Index) -> tuple:
    sets = sorted((s.to_dict(now=0) for s in index.sets), key=lambda s: s["id"])
    order = [ckptindex._order(s) for s in index.sets]
    assert order == sorted(order, reverse=True)  # newest first, as build_index orders them
    return sets, [f.to_dict() for f in index.other_files], index.world_size, index.errors


@pytest.mark.parametrize("seed", range(6))
def test_the_kept_index_equals_a_full_grouping_after_every_change(seed):
    rng = random.Random(seed)
    files: dict[str, ckptindex.CheckpointFile] = {}
    grouping = Grouping()
    world = 8
    hosts = ["node-a", "node-b", None]
    for step in range(80):
        changed: set[str] = set()
        for _ in range(rng.randint(1, 5)):
            what = rng.random()
            layout = rng.choice(LAYOUTS)
            if what < 0.5 or not files:  # a few ranks save a step
                g = rng.randrange(1, 12) * 10
                for r in rng.sample(range(world), rng.randint(1, world)):
                    f = ckptindex.from_listing(entry(layout, r, g, rng), rng.choice(hosts))
                    files[f.path] = f
                    changed.add(f.path)
            elif what < 0.8:  # a file goes
                path = rng.choice(sorted(files))
                del files[path]
                changed.add(path)
            else:  # a file is rewritten (corrupt now, or whole again)
                old = files[rng.choice(sorted(files))]
                f = ckptindex.from_listing(entry(layout, old.rank, old.meta.step or 10, rng), old.host)
                files[f.path] = f
                changed.add(f.path)
        if rng.random() < 0.05:
            world = rng.choice((8, 16))
        full = rng.random() < 0.1  # a caller that cannot say what changed
        errors = [f"error {step}"]
        kept = grouping.index("/run", files, None if full else changed, world, errors, 1.0)
        fresh = ckptindex.build_index("/run", list(files.values()), world, errors, 1.0)
        assert shape(kept) == shape(fresh), step
    assert any(s.layout.startswith("ckpt_of_rank") for s in kept.sets)
