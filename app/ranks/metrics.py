"""What each number on the page is, described once.

The table's headers and tooltips, the chart axes and the summary strip all
read these descriptions (they reach the page as JSON), so a label or a unit
changes in one place. ``name`` is the field in ``/api/ranks`` rows and in
Socket.IO row payloads.
"""

from __future__ import annotations

from typing import NamedTuple


class Metric(NamedTuple):
    name: str
    label: str
    unit: str
    description: str
    # "rank": a table column; "device": a column shown only when some rank
    # reports a device; "detail": a row field with no column of its own;
    # "job": the summary strip.
    group: str = "rank"


METRICS: list[Metric] = [
    Metric("rank", "Rank", "", "Global rank in the job."),
    Metric("host", "Host", "", "Host the rank runs on."),
    Metric("pid", "PID", "", "Process id of the rank on its host."),
    Metric("health", "Verdict", "", "Health verdict; the reason says why."),
    Metric("reason", "Reason", "", "Why the rank has its verdict, in words."),
    Metric("state", "State", "", "Lifecycle state the rank reports (starting, training, ...)."),
    Metric(
        "global_step",
        "Epoch / step (global)",
        "",
        "Steps since the job began (the table shows epoch / step in epoch (global step)).",
    ),
    Metric("loss", "Loss", "", "Last loss the rank reported."),
    Metric(
        "loss_nonfinite",
        "Loss not finite",
        "",
        "`nan`, `inf` or `-inf` when the last loss was one (the loss is then null; the page shows NaN or Inf).",
        "detail",
    ),
    Metric("step_time_ms", "Step", "ms", "Wall time of the rank's last step."),
    Metric(
        "step_time_mean_ms",
        "Step mean",
        "ms",
        "Mean step time over the steps since the rank's previous heartbeat.",
    ),
    Metric(
        "score",
        "Speed vs peers",
        "",
        "Relative performance: the other ranks' median / its own, of the work per step in a "
        "synchronous job, else of the step time (1 = as fast as the others).",
    ),
    Metric("samples_per_s", "Throughput", "samples/s", "Samples per second on this rank."),
    Metric(
        "heartbeat_age_s",
        "Heartbeat",
        "s",
        "Time since the rank last wrote a heartbeat (a `log` row: since its worker log last grew).",
    ),
    Metric("cpu_percent", "CPU", "%", "CPU use of the rank's process (100% = one core)."),
    Metric("rss_bytes", "RSS", "bytes", "Resident memory of the rank's process."),
    Metric("device", "Device", "", "Accelerator kind and index.", "device"),
    Metric("device_util_percent", "Dev util", "%", "Accelerator utilisation.", "device"),
    Metric("device_mem_used_bytes", "Dev mem", "bytes", "Accelerator memory in use.", "device"),
    Metric("device_temp_c", "Dev temp", "°C", "Accelerator temperature.", "device"),
    Metric("device_health", "Dev health", "", "Health the device tool reports.", "device"),
    Metric("epoch", "Epoch", "", "Current epoch, 1-based.", "detail"),
    Metric("step", "Step in epoch", "", "Step within the epoch, 1-based.", "detail"),
    Metric("device_mem_total_bytes", "Dev mem total", "bytes", "Accelerator memory size.", "detail"),
    Metric(
        "stop_stage",
        "Stop stage",
        "",
        "Where the rank is in a graceful stop (seen, agreed, saving, saved, exited).",
        "detail",
    ),
    Metric(
        "resumed_from",
        "Resumed from",
        "",
        "The checkpoint set this rank's launch resumed from: 'resumed from global step S (set ...)'.",
        "detail",
    ),
    Metric(
        "launch",
        "Launch",
        "",
        "The id of the launch (attempt) the rank belongs to, the same on every rank of it.",
        "detail",
    ),
    Metric("warnings", "Warnings", "", "Problems the bridge met and survived.", "detail"),
    Metric("time", "Written at", "s", "When the heartbeat was written (Unix seconds).", "detail"),
    Metric("last_step_at", "Last step at", "s", "When the rank's last step ended (Unix seconds).", "detail"),
    Metric("seq", "Heartbeat no.", "", "Heartbeat counter, +1 per write.", "detail"),
    Metric(
        "source",
        "Source",
        "",
        "Where the row comes from: `bridge` (the rank's heartbeat file) or `log` (msrun's worker log).",
        "detail",
    ),
    Metric(
        "clock_skew_s",
        "Clock ahead",
        "s",
        "How far ahead of the dashboard's clock the rank's heartbeat was dated (null within 2 s).",
        "detail",
    ),
    Metric("world_size", "World size", "ranks", "Ranks in the job (from job.json).", "job"),
    Metric(
        "slowest",
        "Slowest rank",
        "ms",
        "Rank with the highest median step time, and its gap to the median of all ranks; "
        "the page names it only when it is a straggler (past STRAGGLER_RATIO).",
        "job",
    ),
    Metric(
        "throughput",
        "Job throughput",
        "samples/s",
        "Sum of the throughput of the ranks that are alive.",
        "job",
    ),
    Metric("last_step_age_s", "Last step", "s", "Time since any rank last finished a step.", "job"),
]

METRICS_BY_NAME = {m.name: m for m in METRICS}


def as_json() -> list[dict]:
    return [m._asdict() for m in METRICS]
