"""``/metrics`` under ``--runs ROOT``: every open run's series, each with a ``run`` label.

The series are ``app.prometheus.exporter.RankwatchCollector``'s, the single run's,
collected per run and given a ``run`` label (not ``job``: Prometheus sets
that label itself), families of the same name merged. Only runs with open
engines (live, or being viewed: ``app/runs/registry.py``) are collected, so
a scrape costs the runs that matter, not every run ever seen.
``/runs/<id>/metrics`` is the same for that one run.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.samples import Sample

from app.prometheus.exporter import PREFIX, RankwatchCollector

RUN_LABEL = "run"
# Families that describe the dashboard, not a run: served once, without a run label.
DASHBOARD_WIDE = (PREFIX + "build",)


class RunsCollector:
    def __init__(self, runs: list[tuple[str, object]], per_rank_max: int, per_rank: bool | None):
        self.runs = runs
        self.per_rank_max = per_rank_max
        self.per_rank = per_rank

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for run_id, rw in self.runs:
            per_rank = self.per_rank
            if per_rank is None:
                per_rank = rw.state.world_size() <= self.per_rank_max
            for family in RankwatchCollector(rw, per_rank).collect():
                wide = family.name in DASHBOARD_WIDE
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                elif wide:
                    continue
                into.samples.extend(
                    s
                    if wide
                    else Sample(s.name, {RUN_LABEL: run_id, **s.labels}, s.value, s.timestamp, s.exemplar)
                    for s in family.samples
                )
        yield from merged.values()


def exposition(runs: list[tuple[str, object]], accept: str | None, per_rank_max: int, per_rank: bool | None):
    """(body, content type) of a scrape of ``runs`` (run id, container) pairs."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunsCollector(runs, per_rank_max, per_rank))
    ProcessCollector(registry=registry)
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
