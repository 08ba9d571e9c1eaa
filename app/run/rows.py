"""A rank's row: the fields of ``/api/ranks`` and the Socket.IO row payloads.

``app/ranks/metrics.py`` describes every field; ``make_row`` builds them from a
validated heartbeat (``schema.Heartbeat.to_dict()``) and a verdict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from app.run.health import Verdict
from trainer_bridge.rundir.attempts import resumed_text


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# An absent heartbeat, device or stop record: every lookup answers None.
_EMPTY: Mapping[str, Any] = {"device": None, "stop": None}


def _round(value: Any, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def _loss(value: Any) -> float | None:
    """Five significant digits; a NaN or infinite loss (a diverged run) has no JSON number: null."""
    if value is None or not math.isfinite(value):
        return None
    if value == 0:
        return 0.0
    return round(value, 4 - math.floor(math.log10(abs(value))))


def make_row(
    rank: int,
    hb: Mapping[str, Any] | None,
    verdict: Verdict,
    *,
    source: str = "bridge",
    skew_s: float | None = None,
) -> dict:
    """A table row: the fields of ``/api/ranks`` (without the time-dependent heartbeat age).

    ``hb`` is a validated heartbeat (``schema.Heartbeat.to_dict()``) or None;
    ``source`` says where it came from: ``bridge`` (the rank's heartbeat
    file) or ``log`` (read from msrun's worker log).
    """
    # Validated: every field is present with its schema type, so no checks here.
    hb = hb or _EMPTY
    device = hb["device"] or _EMPTY
    stop = hb["stop"] or _EMPTY
    kind = device.get("kind")
    resumed = hb.get("resumed_from")
    return {
        "rank": rank,
        "health": verdict.health,
        "reason": verdict.reason,
        "score": verdict.score,
        "state": hb.get("state"),
        "epoch": hb.get("epoch"),
        "step": hb.get("step"),
        "global_step": hb.get("global_step"),
        "loss": _loss(hb.get("loss")),
        "loss_nonfinite": hb.get("loss_nonfinite"),
        "step_time_ms": _round(hb.get("step_time_ms")),
        "step_time_mean_ms": _round(hb.get("step_time_mean_ms")),
        "samples_per_s": _round(hb.get("samples_per_s"), 1),
        "host": hb.get("host"),
        "pid": hb.get("pid"),
        "cpu_percent": _round(hb.get("cpu_percent"), 1),
        "rss_bytes": hb.get("rss_bytes"),
        "device": f"{kind}:{device['index']}" if kind else None,
        "device_util_percent": _round(device.get("util_percent"), 1),
        "device_mem_used_bytes": device.get("mem_used_bytes"),
        "device_mem_total_bytes": device.get("mem_total_bytes"),
        "device_temp_c": _round(device.get("temp_c"), 1),
        "device_health": device.get("health"),
        "stop_stage": stop.get("stage"),
        "launch": hb.get("launch"),
        "resumed_from": resumed_text(resumed["global_step"], resumed.get("set")) if resumed else None,
        "warnings": list(hb.get("warnings") or ()),
        # Millisecond precision is all a clock comparison needs, and saves bytes.
        "time": _round(hb.get("time"), 3),
        "last_step_at": _round(hb.get("last_step_at"), 3),
        "seq": hb.get("seq"),
        "source": source,
        "clock_skew_s": skew_s,
    }


def with_age(row: dict, now: float) -> dict:
    written = row["time"]
    age = None if written is None else round(max(0.0, now - written), 1)
    return {**row, "heartbeat_age_s": age}
