"""app.checkpoints.indexbody: the deltas applied to the whole index make the whole index.

Seeded random changes to a hub's merged files (sets saved on some hosts, files
gone or corrupt, whole sets dropped, the world size changing), regrouped by
``ckptgroup`` as the dashboard does; after each change ``IndexPushes`` makes
the push, and the index a page holds (the first whole body, each delta applied
with ``apply_delta``) must equal the whole body made afresh, but its times.
"""

from __future__ import annotations

import random

import pytest

from app.checkpoints.indexbody import IndexPushes, IndexView, apply_delta
from app.checkpoints.verify import Verifier
from tests.bench.hostsim import listing_entry
from trainer_bridge.rundir import ckptindex
from trainer_bridge.rundir.ckptgroup import Grouping

HOSTS = ("node-a", "node-b", "node-c")


def listed(rank: int, g: int, status: str = "ok") -> ckptindex.CheckpointFile:
    return ckptindex.from_listing(listing_entry(rank, g, status), HOSTS[rank % len(HOSTS)])


def timeless(body: dict) -> dict:
    out = {k: v for k, v in body.items() if k not in ("now", "scanned_at", "version")}
    out["sets"] = [{k: v for k, v in s.items() if k != "age_s"} for s in body["sets"]]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_page_applying_every_delta_holds_the_whole_index(seed):
    rng = random.Random(seed)
    files: dict[str, ckptindex.CheckpointFile] = {}
    grouping, pushes, verifier = Grouping(), IndexPushes(), Verifier(None, None)
    world, page, whole_pushes = 6, None, 0
    for step in range(60):
        changed: set[str] = set()
        for _ in range(rng.randint(1, 4)):
            what = rng.random()
            steps = sorted({f.meta.global_step for f in files.values()})
            if what < 0.45 or not steps:  # some ranks save a set, new or one others saved
                g = rng.choice([*steps, (steps[-1] if steps else 0) + 10])
                made = [listed(r, g) for r in rng.sample(range(world), rng.randint(1, world))]
            elif what < 0.6:  # a file goes corrupt
                f = files[rng.choice(sorted(files))]
                made = [listed(f.rank, f.meta.global_step, "corrupt")]
            elif what < 0.8:  # a file goes
                path = rng.choice(sorted(files))
                del files[path]
                changed.add(path)
                made = []
            else:  # the oldest set goes whole
                made = []
                for path in [p for p, f in files.items() if f.meta.global_step == steps[0]]:
                    del files[path]
                    changed.add(path)
            for f in made:
                files[f.path] = f
                changed.add(f.path)
        if rng.random() < 0.1:
            world = rng.randint(4, 8)
        index = grouping.index("", files, changed, world, [], 0.0)
        view = IndexView(index, world, None, verifier)
        pushed = pushes.take(view)
        if pushed is not None:
            event, payload = pushed
            if event == "checkpoints":
                page, whole_pushes = payload, whole_pushes + 1
            else:
                page = apply_delta(page, payload)
                # A delta carries the files that changed, never every file of the index.
                sent = sum(
                    len(s.get("files", ())) + len(s.get("files_changed", ())) for s in payload.get("sets", ())
                )
                assert sent <= len(changed) or any("files" in s for s in payload.get("sets", ())), step
        assert page is not None and timeless(page) == timeless(
            IndexView(index, world, None, verifier).body()
        ), step
    assert whole_pushes == 1
