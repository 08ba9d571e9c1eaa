"""Alerts from ``rankwatch launch``'s attempts: each relaunch, and a run it gave up on.

``attempts.jsonl`` (``trainer_bridge.rundir.attempts``) gains a supervised
line when the supervisor ends an attempt. Each attempt it relaunched after is
one ``restart`` alert; an attempt after which it ended the run for good (the
restart budget used up, the startup or the no-progress rule:
``supervised.GAVE_UP``) is one ``launch_gave_up`` alert, since the run then
needs a person. Each goes out once (``AlertDesk.once``: the delivery log
keeps the key, so a restarted dashboard does not announce an old restart
again). The file's folded rows are cached by its stat (``app.attempts``):
a tick with no new line costs one ``stat`` and no parsing.
"""

from __future__ import annotations

from pathlib import Path

from app import attempts
from app.incidents.alerts import AlertDesk
from trainer_bridge.rundir import supervised

RESTART_EVENT = "restart"
GAVE_UP_EVENT = "launch_gave_up"


class RestartAlerts:
    def __init__(self, alerts: AlertDesk, run_dir: Path | None):
        self.alerts = alerts
        self.run_dir = run_dir
        self._seen: list[dict] | None = None  # the rows last looked at (the cache's object)

    def tick(self) -> None:
        if self.run_dir is None or not self.alerts.enabled:
            return
        rows = attempts.rows(self.run_dir)
        if rows is self._seen:
            return
        self._seen = rows
        for row in rows:
            sup = row.get("supervisor") or {}
            # The key names the attempt and when the supervisor started it: a run directory used again
            # for a new job (attempts.jsonl removed) numbers its attempts from 1 again.
            key = f"{self.run_dir}:{row['attempt']}:{sup.get('spawned_at') or row.get('started_at')}"
            if row.get("restarted_by") == "launch":
                self._restart(key, row, sup)
            said = supervised.gave_up(row)
            if said is not None:
                self.alerts.once(
                    f"launch-gave-up:{key}",
                    GAVE_UP_EVENT,
                    f"attempt {row['attempt']} failed and {said}; the run needs attention",
                    attempt=row["attempt"],
                    exit_code=sup.get("exit_code"),
                    cause=row.get("cause"),
                )

    def _restart(self, key: str, row: dict, sup: dict) -> None:
        cause = row.get("cause") or {}
        why = row.get("error") or cause.get("error") or cause.get("kind") or "a failure"
        resume = sup.get("resume")
        where = f"global step {resume['global_step']}" if resume else "the start (no healthy set)"
        down = (row.get("downtime") or {}).get("total_s")
        text = f"attempt {row['attempt']} failed ({why}); rankwatch launch relaunched it from {where}"
        if down is not None:
            text += f", {down:.1f} s after the fault"
        self.alerts.once(
            f"restart:{key}",
            RESTART_EVENT,
            text,
            attempt=row["attempt"],
            cause=cause or None,
            resume=resume,
            downtime=row.get("downtime"),
        )
