"""``GET /metrics``: the dashboard's current view in Prometheus's text format.

A custom ``prometheus_client`` collector reads what the page shows, at
scrape time: ``RunState``'s rows and summary, ``StopService.status`` and
the checkpoint index. Nothing is counted twice or judged differently: a
rank's verdict here is the one on the page. Every per-rank series carries
the labels ``rank`` and ``host``; device series add ``device`` (``npu:3``).

Names follow Prometheus's conventions: a ``rankwatch_`` prefix, base units
(seconds, bytes, ratios where the page shows percent: 1.0 = one core, or a
device fully busy) named in a suffix, ``_total`` for the one counter (a
rank's heartbeats, which restarts with its process). Verdicts, stop stages
and statuses are one-hot gauges: for verdicts and stages every possible
value is present (0 or 1) for every rank, so ``== 0`` queries work; the
job's run status and stop state carry only their current value (1).

The descriptions come from ``app/metrics.py`` (the page's column help),
with the unit conversion said once below.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from app.health import VERDICTS
from app.metrics import METRICS_BY_NAME
from app.stop_service import STAGES

PREFIX = "rankwatch_"
RANK_LABELS = ("rank", "host")
DEVICE_LABELS = ("rank", "host", "device")

# (row field, metric name, factor to the base unit): the per-rank gauges.
RANK_GAUGES = (
    ("global_step", "rank_global_step", 1.0),
    ("epoch", "rank_epoch", 1.0),
    ("loss", "rank_loss", 1.0),
    ("step_time_ms", "rank_step_time_seconds", 1e-3),
    ("step_time_mean_ms", "rank_step_time_mean_seconds", 1e-3),
    ("score", "rank_score_ratio", 1.0),
    ("samples_per_s", "rank_samples_per_second", 1.0),
    ("heartbeat_age_s", "rank_heartbeat_age_seconds", 1.0),
    ("cpu_percent", "rank_cpu_usage_ratio", 1e-2),
    ("rss_bytes", "rank_resident_memory_bytes", 1.0),
    ("time", "rank_heartbeat_timestamp_seconds", 1.0),
    ("last_step_at", "rank_last_step_timestamp_seconds", 1.0),
)
DEVICE_GAUGES = (
    ("device_util_percent", "rank_device_utilization_ratio", 1e-2),
    ("device_mem_used_bytes", "rank_device_memory_used_bytes", 1.0),
    ("device_mem_total_bytes", "rank_device_memory_total_bytes", 1.0),
    ("device_temp_c", "rank_device_temperature_celsius", 1.0),
)


def _help(field: str, factor: float) -> str:
    text = METRICS_BY_NAME[field].description
    if factor == 1e-3:
        text += " In seconds."
    elif factor == 1e-2:
        text += " As a ratio (1.0 = 100%)."
    return text


class RankwatchCollector:
    """Collects from one app's engines (``app.Rankwatch``) at each scrape."""

    def __init__(self, rw):
        self.rw = rw

    def collect(self) -> Iterator[Metric]:
        rw = self.rw
        now = time.time()
        rw.state.refresh(now, rw.watcher.tick_s)
        snapshot = rw.state.snapshot(now)
        ranks, world = rw.state.heartbeats()
        rows = snapshot["ranks"]
        labels = {row["rank"]: (str(row["rank"]), row["host"] or "") for row in rows}

        for field, name, factor in RANK_GAUGES:
            family = GaugeMetricFamily(PREFIX + name, _help(field, factor), labels=RANK_LABELS)
            for row in rows:
                if isinstance(row[field], (int, float)):
                    family.add_metric(labels[row["rank"]], row[field] * factor)
            yield family
        for field, name, factor in DEVICE_GAUGES:
            family = GaugeMetricFamily(PREFIX + name, _help(field, factor), labels=DEVICE_LABELS)
            for row in rows:
                if row["device"] and isinstance(row[field], (int, float)):
                    family.add_metric([*labels[row["rank"]], row["device"]], row[field] * factor)
            yield family

        heartbeats = CounterMetricFamily(
            PREFIX + "rank_heartbeats",
            "Heartbeats the rank has written (its seq); restarts with the rank's process.",
            labels=RANK_LABELS,
        )
        verdict = GaugeMetricFamily(
            PREFIX + "rank_verdict",
            "The rank's health verdict, one-hot: 1 for its verdict, 0 for the others.",
            labels=(*RANK_LABELS, "verdict"),
        )
        for row in rows:
            if isinstance(row["seq"], int):
                heartbeats.add_metric(labels[row["rank"]], row["seq"])
            for v in VERDICTS:
                verdict.add_metric([*labels[row["rank"]], v], 1.0 if row["health"] == v else 0.0)
        yield heartbeats
        yield verdict

        yield from self._job(snapshot)
        yield from self._stop(rw.stop.status(ranks, world, now), labels)
        yield from self._checkpoints(rw.checkpoints.body(world), now)

    @staticmethod
    def _job(snapshot: dict) -> Iterator[Metric]:
        summary = snapshot["summary"]
        yield GaugeMetricFamily(
            PREFIX + "world_size", "Ranks in the job (job.json, else the heartbeats).", snapshot["world_size"]
        )
        yield GaugeMetricFamily(
            PREFIX + "ranks_reported", "Ranks that have written a heartbeat.", summary["reported"]
        )
        counts = GaugeMetricFamily(PREFIX + "ranks", "Ranks per health verdict.", labels=("verdict",))
        for v in VERDICTS:
            counts.add_metric([v], summary["counts"].get(v, 0))
        yield counts
        if summary["throughput"] is not None:  # None: no rank reports a rate
            yield GaugeMetricFamily(
                PREFIX + "job_throughput_samples_per_second",
                METRICS_BY_NAME["throughput"].description,
                summary["throughput"],
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
                summary["last_step_at"],
            )
        run = GaugeMetricFamily(
            PREFIX + "run_status",
            "The run directory's status (missing, waiting, starting, running, ended, unreadable): "
            "1 for the current one.",
            labels=("status",),
        )
        run.add_metric([snapshot["run"]["status"]], 1.0)
        yield run

    @staticmethod
    def _stop(status: dict, labels: dict[int, tuple[str, str]]) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            PREFIX + "stop_state",
            "The graceful stop's state (idle, requested, stopping, completed, cancelled, rearmed, "
            "not_obeyed): "
            "1 for the current one.",
            labels=("state",),
        )
        state.add_metric([status["state"]], 1.0)
        yield state
        stage = GaugeMetricFamily(
            PREFIX + "rank_stop_stage",
            "Where the rank is in the current graceful stop, one-hot over requested, seen, agreed, "
            "saving, saved, exited; no series while no stop was requested.",
            labels=(*RANK_LABELS, "stage"),
        )
        for row in status["ranks"]:
            rank_labels = labels.get(row["rank"], (str(row["rank"]), ""))
            for s in STAGES:
                stage.add_metric([*rank_labels, s], 1.0 if row["stage"] == s else 0.0)
        yield stage
        late = GaugeMetricFamily(
            PREFIX + "stop_late_ranks",
            "Ranks that stayed in one stop stage longer than STOP_DEADLINE_S.",
            len(status["late"]),
        )
        yield late

    @staticmethod
    def _checkpoints(body: dict, now: float) -> Iterator[Metric]:
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
                newest["mtime"],
            )


def exposition(rw, accept: str | None) -> tuple[bytes, str]:
    """(body, content type) for a scrape; OpenMetrics when the scraper asks for it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankwatchCollector(rw))
    # The dashboard process itself (CPU, memory, open files), under the standard names.
    ProcessCollector(registry=registry)
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
