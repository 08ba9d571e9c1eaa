"""``GET /metrics``: the dashboard's current view in Prometheus's text format.

A custom ``prometheus_client`` collector reads what the page shows, at
scrape time: ``RunState``'s rows and summary, ``StopService.status`` and
the checkpoint index. Nothing is counted twice or judged differently: a
rank's verdict here is the one on the page.

Labels: every per-rank series carries only ``rank`` (device series add
``device``, ``npu:3``). The rank's host is in ``rankwatch_rank_info{rank,
host, source}``, joined on ``rank`` (``* on (instance, rank)
group_left (host) rankwatch_rank_info``), so a rank that moves host after a
relaunch changes one series, not all of them.

Names follow Prometheus's conventions: a ``rankwatch_`` prefix, base units
(seconds, bytes, ratios where the page shows percent) named in a suffix,
``_total`` for counters (a rank's heartbeats and CPU seconds, which restart
with its process), ``_timestamp_seconds`` for moments, never a scrape-time
age. Enums (a rank's verdict and stop stage, the run status, the stop
state) carry only their current value, 1, as the state's label, as
kube-state-metrics and node_exporter do: one series per rank instead of
one per possible value (an OpenMetrics stateset would still expose every
value, 0 or 1). The per-verdict and per-stage counts are separate gauges
that list every value, so ``== 0`` queries work there.

A rank that has ended (``ENDED_VERDICTS``: exited, finished, failed, dead,
node lost) keeps its facts (step, loss, timestamps, verdict) but no rates:
its last throughput, step time, CPU and memory describe a process that no
longer runs.

Above ``METRICS_PER_RANK_MAX`` ranks only summaries are served (ranks per
verdict, per host and verdict, per stop stage), as Ray does with its
cardinality levels; ``?per_rank=1`` asks for every rank anyway.

The descriptions come from ``app/ranks/metrics.py`` (the page's column help),
with the unit conversion said once below.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from functools import cache
from importlib import metadata
from typing import NamedTuple

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from app import attempts
from app.ranks.metrics import METRICS_BY_NAME
from app.run.verdicts import ENDED_VERDICTS, VERDICTS
from app.stop.status import STAGES

PREFIX = "rankwatch_"


class Series(NamedTuple):
    """A per-rank gauge: the row field, the metric name, the divisor to its base unit, and
    whether it is a rate or a process figure, dropped once the rank has ended."""

    field: str
    name: str
    divisor: int
    live_only: bool


RANK_GAUGES = (
    Series("global_step", "rank_global_step", 1, False),
    Series("epoch", "rank_epoch", 1, False),
    Series("loss", "rank_loss", 1, False),
    Series("time", "rank_last_heartbeat_timestamp_seconds", 1, False),
    Series("last_step_at", "rank_last_step_timestamp_seconds", 1, False),
    Series("step_time_ms", "rank_step_time_seconds", 1000, True),
    Series("step_time_mean_ms", "rank_step_time_mean_seconds", 1000, True),
    Series("score", "rank_score_ratio", 1, True),
    Series("samples_per_s", "rank_samples_per_second", 1, True),
    Series("rss_bytes", "rank_resident_memory_bytes", 1, True),
)
DEVICE_GAUGES = (
    Series("device_util_percent", "rank_device_utilization_ratio", 100, True),
    Series("device_mem_used_bytes", "rank_device_memory_used_bytes", 1, True),
    Series("device_mem_total_bytes", "rank_device_memory_total_bytes", 1, True),
    Series("device_temp_c", "rank_device_temperature_celsius", 1, True),
)


def _num(value: float, divisor: int = 1) -> float:
    """``value`` in its base unit without binary noise: 86.2 % is 0.862, not 0.8620000000000001.

    Fifteen significant digits hold every figure a heartbeat has (a
    millisecond timestamp has 13) and drop the last bits a division leaves.
    """
    return float(f"{value / divisor:.15g}")


def _help(series: Series) -> str:
    text = METRICS_BY_NAME[series.field].description
    if series.divisor == 1000:
        text += " In seconds."
    elif series.divisor == 100:
        text += " As a ratio (1.0 = 100%)."
    if series.live_only:
        text += " Not exported once the rank has ended."
    return text


@cache
def version() -> str:
    try:
        return metadata.version("rankwatch")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


class RankwatchCollector:
    """Collects from one app's engines (``app.Rankwatch``) at each scrape."""

    def __init__(self, rw, per_rank: bool):
        """``per_rank``: whether to serve each rank's series or only the summaries."""
        self.rw = rw
        self.per_rank = per_rank

    def collect(self) -> Iterator[Metric]:
        rw = self.rw
        now = time.time()
        rw.state.refresh(now, rw.watcher.tick_s)
        head = rw.state.summary(now)
        rows = rw.state.rows()
        ranks, world = rw.state.heartbeats()
        stop = rw.stop.status(now)
        per_rank = self.per_rank

        yield InfoMetricFamily(PREFIX + "build", "This dashboard's version.", value={"version": version()})
        yield GaugeMetricFamily(
            PREFIX + "per_rank_series",
            "1 when this answer has per-rank series; 0 when the job has more ranks than "
            "METRICS_PER_RANK_MAX and only summaries are served (ask with ?per_rank=1).",
            1 if per_rank else 0,
        )
        yield from self._job(head, rows)
        yield from self._goodput(rw.state, ranks, now)
        yield from self._stop(stop)
        if per_rank:
            yield from self._ranks(rows, ranks)
            yield from self._rank_stages(stop)
        yield from self._checkpoints(rw.checkpoints.body(world))

    @staticmethod
    def _ranks(rows: list[dict], heartbeats: dict[int, dict | None]) -> Iterator[Metric]:
        labels = {row["rank"]: str(row["rank"]) for row in rows}
        live = [row for row in rows if row["health"] not in ENDED_VERDICTS]

        info = InfoMetricFamily(
            PREFIX + "rank",
            "The rank's host and where its row comes from (bridge: its heartbeat file; log: msrun's "
            "worker log); join on rank for the host.",
            labels=("rank",),
        )
        verdict = GaugeMetricFamily(
            PREFIX + "rank_verdict",
            "The rank's health verdict, as its label; 1 (one series per rank).",
            labels=("rank", "verdict"),
        )
        for row in rows:
            info.add_metric([labels[row["rank"]]], {"host": row["host"] or "", "source": row["source"]})
            verdict.add_metric([labels[row["rank"]], row["health"]], 1)
        yield info
        yield verdict

        for series in RANK_GAUGES:
            family = GaugeMetricFamily(PREFIX + series.name, _help(series), labels=("rank",))
            for row in live if series.live_only else rows:
                value = row[series.field]
                if isinstance(value, (int, float)):
                    family.add_metric([labels[row["rank"]]], _num(value, series.divisor))
            yield family
        for series in DEVICE_GAUGES:
            family = GaugeMetricFamily(PREFIX + series.name, _help(series), labels=("rank", "device"))
            for row in live:
                value = row[series.field]
                if row["device"] and isinstance(value, (int, float)):
                    family.add_metric([labels[row["rank"]], row["device"]], _num(value, series.divisor))
            yield family

        beats = CounterMetricFamily(
            PREFIX + "rank_heartbeats",
            "Heartbeats the rank has written (its seq); restarts with the rank's process.",
            labels=("rank",),
        )
        for row in rows:
            if isinstance(row["seq"], int):
                beats.add_metric([labels[row["rank"]]], row["seq"])
        yield beats
        cpu = CounterMetricFamily(
            PREFIX + "rank_cpu_seconds",
            "CPU time the rank's process has used (user + system, all threads, from psutil); restarts "
            "with the process; rate() is the cores it uses (1.0 = one core). Not exported once the "
            "rank has ended.",
            labels=("rank",),
        )
        for row in live:
            seconds = (heartbeats.get(row["rank"]) or {}).get("cpu_seconds")
            if isinstance(seconds, (int, float)):
                cpu.add_metric([labels[row["rank"]]], _num(seconds))
        yield cpu

    @staticmethod
    def _job(head: dict, rows: list[dict]) -> Iterator[Metric]:
        summary = head["summary"]
        yield GaugeMetricFamily(
            PREFIX + "world_size", "Ranks in the job (job.json, else the heartbeats).", head["world_size"]
        )
        yield GaugeMetricFamily(
            PREFIX + "ranks_reported", "Ranks that have written a heartbeat.", summary["reported"]
        )
        counts = GaugeMetricFamily(
            PREFIX + "ranks", "Ranks per health verdict (every verdict, 0 included).", labels=("verdict",)
        )
        for v in VERDICTS:
            counts.add_metric([v], summary["counts"].get(v, 0))
        yield counts
        hosts = GaugeMetricFamily(
            PREFIX + "host_ranks",
            "Ranks per host and health verdict (only the verdicts a host has).",
            labels=("host", "verdict"),
        )
        for (host, health), n in sorted(Counter((row["host"] or "", row["health"]) for row in rows).items()):
            hosts.add_metric([host, health], n)
        yield hosts
        if summary["throughput"] is not None:  # None: no rank reports a rate
            yield GaugeMetricFamily(
                PREFIX + "job_throughput_samples_per_second",
                METRICS_BY_NAME["throughput"].description,
                _num(summary["throughput"]),
            )
        if summary.get("global_step") is not None:
            yield GaugeMetricFamily(
                PREFIX + "job_global_step",
                "The highest global step any rank reports.",
                summary["global_step"],
            )
        if summary.get("last_step_at") is not None:
            yield GaugeMetricFamily(
                PREFIX + "job_last_step_timestamp_seconds",
                "When any rank last finished a step (Unix seconds).",
                _num(summary["last_step_at"]),
            )
        run = GaugeMetricFamily(
            PREFIX + "run_status",
            "The run directory's status (missing, waiting, starting, running, ended, unreadable), "
            "as its label; 1.",
            labels=("status",),
        )
        run.add_metric([head["run"]["status"]], 1)
        yield run

    @staticmethod
    def _goodput(state, heartbeats: dict[int, dict | None], now: float) -> Iterator[Metric]:
        """The run's goodput, restarts and steps lost, as the run page shows them (app/run/goodput.py)."""
        tried = attempts.answer(state.run_dir, heartbeats, state.job_ended(), state.log_attempts())
        g = state.goodput(tried["attempts"], now)
        if g["goodput"] is not None:
            yield GaugeMetricFamily(
                PREFIX + "goodput_ratio",
                "The wall time spent on training steps that were kept, over the wall time since the "
                "first attempt started (1.0 = 100%).",
                _num(g["goodput"]),
            )
        yield GaugeMetricFamily(
            PREFIX + "restarts", "Launches of the job in this run directory after the first.", g["restarts"]
        )
        yield GaugeMetricFamily(
            PREFIX + "steps_lost",
            "Global steps an attempt trained that a later attempt trained again (it resumed from an older set).",
            g["steps_lost"],
        )

    @staticmethod
    def _stop(status: dict) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            PREFIX + "stop_state",
            "The graceful stop's state (idle, requested, stopping, completed, cancelled, rearmed, "
            "not_obeyed), as its label; 1.",
            labels=("state",),
        )
        state.add_metric([status["state"]], 1)
        yield state
        stages = GaugeMetricFamily(
            PREFIX + "stop_ranks",
            "Ranks per stage of the current graceful stop (every stage, 0 included); no series while "
            "no stop was requested.",
            labels=("stage",),
        )
        if status["ranks"]:
            counts = Counter(row["stage"] for row in status["ranks"])
            for s in STAGES:
                stages.add_metric([s], counts.get(s, 0))
        yield stages
        yield GaugeMetricFamily(
            PREFIX + "stop_late_ranks",
            "Ranks that stayed in one stop stage longer than STOP_DEADLINE_S.",
            len(status["late"]),
        )

    @staticmethod
    def _rank_stages(status: dict) -> Iterator[Metric]:
        stage = GaugeMetricFamily(
            PREFIX + "rank_stop_stage",
            "Where the rank is in the current graceful stop (requested, seen, agreed, saving, saved, "
            "exited), as its label; 1. No series while no stop was requested.",
            labels=("rank", "stage"),
        )
        for row in status["ranks"]:
            if row["stage"] in STAGES:
                stage.add_metric([str(row["rank"]), row["stage"]], 1)
        yield stage

    @staticmethod
    def _checkpoints(body: dict) -> Iterator[Metric]:
        sets = body["sets"]
        yield GaugeMetricFamily(
            PREFIX + "checkpoint_sets", "Checkpoint sets in the run directory.", len(sets)
        )
        yield GaugeMetricFamily(
            PREFIX + "checkpoint_sets_complete",
            "Checkpoint sets every rank can resume from.",
            sum(1 for s in sets if s["complete"]),
        )
        yield GaugeMetricFamily(
            PREFIX + "checkpoint_bytes", "Bytes of all checkpoint sets.", body["total_bytes"]
        )
        newest = next((s for s in sets if s["id"] == body["newest_complete"]), None)
        if newest is not None:
            if newest["global_step"] is not None:
                yield GaugeMetricFamily(
                    PREFIX + "checkpoint_newest_complete_global_step",
                    "Global step of the newest complete checkpoint set.",
                    newest["global_step"],
                )
            yield GaugeMetricFamily(
                PREFIX + "checkpoint_newest_complete_timestamp_seconds",
                "When the newest complete checkpoint set was written (its newest file's mtime, Unix seconds).",
                _num(newest["mtime"]),
            )


def exposition(rw, accept: str | None, per_rank: bool) -> tuple[bytes, str]:
    """(body, content type) for a scrape; OpenMetrics when the scraper asks for it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankwatchCollector(rw, per_rank))
    # The dashboard process itself (CPU, memory, open files), under the standard names.
    ProcessCollector(registry=registry)
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
