"""Pool saved overhead runs: ``python -m tests.bench.pool FILE [FILE ...]``.

Each FILE is the ``--save`` of one run of the same benchmark
(``tests.bench.loop``, or ``tests.bench.bridge --figures 1``), each run
with its own ``--seed`` so that no two jobs ran the same side orders. The
report is the one a single run of all their jobs prints: the interval
resamples the jobs of every file. It lets a decisive number of jobs be
gathered over several quiet windows instead of one long one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tests.bench import ab


def per_job(saved: dict) -> int:
    """Rounds in each job of one saved run (files saved before ``pairs`` was kept: counted)."""
    if "pairs" in saved:
        return saved["pairs"]
    rounds = next(iter(saved["rounds"].values()))
    return len(rounds) // len({r.get("job", 0) for r in rounds})


def pool(saved: list[dict]) -> tuple[dict, dict, argparse.Namespace]:
    """(result, load, args) for ``ab.print_report`` over the saved runs' jobs, renumbered."""
    titles = {s["title"] for s in saved}
    if len(titles) != 1:
        raise SystemExit(f"not runs of one benchmark: {sorted(titles)}")
    seeds = [s["seed"] + j for s in saved if "seed" in s for j in range(s["jobs"])]
    if len(seeds) != len(set(seeds)):
        raise SystemExit(
            "two runs share a seed, so their jobs ran the same orders: pool runs of other --seed"
        )
    sizes: dict[str, list[dict]] = {}
    jobs = 0
    for s in saved:
        top = 0
        for size, rounds in s["rounds"].items():
            for r in rounds:
                sizes.setdefault(size, []).append({**r, "job": jobs + r.get("job", 0)})
                top = max(top, r.get("job", 0) + 1)
        jobs += top
    pairs = sorted({str(per_job(s)) for s in saved})
    args = argparse.Namespace(
        ranks=saved[0]["ranks"],
        threads=saved[0]["threads"],
        no_bind=not saved[0]["bound"],
        jobs=jobs,
        pairs="/".join(pairs),
        seed=1,
        save=None,
    )
    load = {
        "start": saved[0]["load"]["start"],
        "end": saved[-1]["load"]["end"],
        "seconds": sum(s["load"]["seconds"] for s in saved),
    }
    return {"sizes": sizes, "state": saved[0]["state"]}, load, args


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", metavar="FILE", help="--save output of one benchmark's runs")
    paths = p.parse_args(argv).files
    saved = [json.loads(Path(f).read_text()) for f in paths]
    result, load, args = pool(saved)
    ab.print_report(saved[0]["title"] + f" (pooled from {len(paths)} runs)", args, result, load)


if __name__ == "__main__":
    main()
