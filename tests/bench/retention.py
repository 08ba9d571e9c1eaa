"""Retention planning speed: ``python -m tests.bench.retention [--sets 10000] [--ranks 64] [--repeats 3]``.

Builds an index of ``--sets`` periodic checkpoint sets of ``--ranks`` files
each in memory (``ckptindex``'s own grouping over synthetic file metadata:
planning is what is timed, not the disk), with one in fifty sets partial,
and times ``retention.plan`` over it (best of ``--repeats``), the health
evidence pass (``ckpthealth.unhealthy`` without a health file) and the hash
over every file's identity. The target: under a second for 10,000 sets x
64 ranks.
"""

from __future__ import annotations

import argparse
import time

from app.checkpoints import retention as rt
from trainer_bridge.rundir import ckpthealth, ckptindex
from trainer_bridge.rundir.ckptmeta import CheckpointMeta


def synthetic_index(sets: int, ranks: int) -> ckptindex.Index:
    now = time.time() - 10 * sets  # every file settled long ago
    files = []
    for i in range(sets):
        step = (i + 1) * 100
        for r in range(ranks):
            if i % 50 == 7 and r == ranks - 1:
                continue  # a partial set now and then
            path = f"ckpt/rank_{r}/net-1_{step}.ckpt"
            meta = CheckpointMeta(path, "ckpt", 1 << 20, now + i, "ok", global_step=step, epoch=1, step=step)
            files.append(
                ckptindex.CheckpointFile(
                    path, "/x/" + path, r, "periodic", "ckpt/rank_{rank}/net-{E}_{S}.ckpt", meta
                )
            )
    groups = ckptindex._group(files, ranks)
    return ckptindex.Index("/x", time.time(), ranks, tuple(groups), (), ())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", type=int, default=10_000)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    t = time.perf_counter()
    index = synthetic_index(args.sets, args.ranks)
    built = time.perf_counter() - t
    policy = rt.Policy(keep=3, every=1000)
    best = best_health = float("inf")
    for _ in range(args.repeats):
        t = time.perf_counter()
        unhealthy = ckpthealth.unhealthy("/x", index, records={})
        best_health = min(best_health, time.perf_counter() - t)
        t = time.perf_counter()
        plan = rt.plan(index, policy, rt.Activity(), now=time.time(), unhealthy=unhealthy)
        best = min(best, time.perf_counter() - t)
    files = sum(len(s.files) for s in index.sets)
    print(
        f"{len(index.sets)} sets x {args.ranks} ranks ({files} files; index built in {built:.1f} s): "
        f"plan {best * 1000:.0f} ms, health pass {best_health * 1000:.0f} ms "
        f"(best of {args.repeats}); {len(plan.deletions)} to delete, frees {plan.frees_bytes / 2**30:.1f} GiB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
