"""How much cheaper ``read_meta`` is than ``load_checkpoint``, and how fast a scan is.

    python -m tests.bench.ckpt_meta [--gb 1.0] [--files 10000] [--repeats 3]

1. Saves one checkpoint of ``--gb`` GB with MindSpore (four big float32
   Parameters plus the bridge's ``append_dict``), reads the whole file once
   so that both readers start from a warm page cache, then times
   ``read_meta`` and ``mindspore.load_checkpoint`` (best of ``--repeats``).
   The target is a ratio of at most 0.01.
2. Copies one small real checkpoint to ``--files`` paths in a per-rank
   ModelCheckpoint layout and times a scan with an empty ``MetaCache``
   (every file opened) and a second scan with the same cache (stat only).

Everything lives in a temporary directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from trainer_bridge.rundir.ckptindex import scan
from trainer_bridge.rundir.ckptmeta import MetaCache, read_meta

RANKS = 8
APPEND = {"epoch_num": 1, "step_num": 48, "batch_num": 64, "global_step": 48, "rankwatch_request_id": "bench"}


def best_of(repeats: int, fn) -> tuple[float, object]:
    """The shortest wall time of ``repeats`` calls, and the last result."""
    best = float("inf")
    result = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def write_big(path: Path, gb: float) -> None:
    import mindspore as ms
    import numpy as np

    n_params = 4
    per_param = int(gb * 1e9 / 4 / n_params)  # float32 elements
    params = [
        {
            "name": f"layer{i}.weight",
            "data": ms.Parameter(
                ms.Tensor.from_numpy(np.full(per_param, i, dtype=np.float32)), name=f"layer{i}.weight"
            ),
        }
        for i in range(n_params)
    ]
    ms.save_checkpoint(params, str(path), append_dict=dict(APPEND))


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def write_small_tree(run: Path, n_files: int) -> None:
    import mindspore as ms
    from mindspore import nn

    # No step inside, so each copy's name decides its set, as with ModelCheckpoint
    # files of a network saved without append_info.
    proto = run / "proto.ckpt"
    ms.save_checkpoint(nn.Dense(16, 8), str(proto))
    data = proto.read_bytes()
    proto.unlink()
    per_rank = -(-n_files // RANKS)
    written = 0
    for rank in range(RANKS):
        d = run / "ckpt_of_rank" / str(rank)
        d.mkdir(parents=True)
        for step in range(1, per_rank + 1):
            if written == n_files:
                return
            (d / f"train-1_{step}.ckpt").write_bytes(data)
            written += 1


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="size of the big checkpoint in GB")
    parser.add_argument("--files", type=int, default=10_000, help="small checkpoints to scan")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per reader (best is kept)")
    args = parser.parse_args(argv)

    import mindspore as ms

    tmp = Path(tempfile.mkdtemp(prefix="rankwatch-bench-"))
    rows = []
    try:
        big = tmp / "big.ckpt"
        t0 = time.perf_counter()
        write_big(big, args.gb)
        size = big.stat().st_size
        print(f"wrote {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")
        warm(big)
        t_meta, meta = best_of(args.repeats, lambda: read_meta(big))
        assert meta.ok and meta.global_step == APPEND["global_step"], meta
        t_load, loaded = best_of(args.repeats, lambda: ms.load_checkpoint(str(big)))
        assert len(loaded) == meta.param_count + 1  # + the str value
        del loaded
        big.unlink()
        rows += [
            (f"read_meta, {size / 1e9:.2f} GB ckpt", t_meta, ""),
            (f"load_checkpoint, {size / 1e9:.2f} GB ckpt", t_load, ""),
            ("ratio read_meta / load_checkpoint", None, f"{t_meta / t_load:.6f} (target <= 0.01)"),
        ]

        run = tmp / "run"
        run.mkdir()
        write_small_tree(run, args.files)
        cache = MetaCache()
        t0 = time.perf_counter()
        cold = scan(run, cache=cache)
        t_cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        warm_index = scan(run, cache=cache)
        t_warm = time.perf_counter() - t0
        assert cold.file_count == warm_index.file_count == args.files
        assert cache.hits == args.files and cache.misses == args.files
        rows += [
            (
                f"scan, {args.files} files, cold cache",
                t_cold,
                f"{len(cold.sets)} sets, {t_cold / args.files * 1e6:.0f} us/file",
            ),
            (f"scan, {args.files} files, warm cache", t_warm, f"{t_warm / args.files * 1e6:.0f} us/file"),
        ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    width = max(len(r[0]) for r in rows)
    print(f"\n{'what':<{width}}  {'seconds':>10}  note")
    for what, seconds, note in rows:
        shown = f"{seconds:10.4f}" if seconds is not None else " " * 10
        print(f"{what:<{width}}  {shown}  {note}")


if __name__ == "__main__":
    main()
