"""The watcher's incident step: verdict changes and stops become alerts, and the policy runs.

``Incidents.tick`` is called once per watcher tick with what the tick just
pushed (a ``ranks_delta`` or ``ranks_snapshot``) and the stop lifecycle. It
reads verdicts from those pushes, which already carry only the rows that
changed, so a quiet 1024-rank job costs it nothing per rank; it keeps the
few fields it needs (health, reason, host, device health) per rank. It
returns an ``incidents`` event when the policy's or the deliveries' status
changed, for the page.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from app.audit import AuditLog
from app.incidents.alerts import AlertDesk
from app.incidents.killwait import KillWaitAlerts
from app.incidents.policy import Policy, parse_mode, parse_rules
from app.incidents.restarts import RestartAlerts
from app.incidents.spikes import SpikeWatch
from app.incidents.webhooks import WebhookSender, parse_urls
from app.push import DELTA_EVENT, SNAPSHOT_EVENT, Changed
from app.push import INCIDENTS_EVENT as EVENT
from app.run.state import RunState
from app.stop.service import StopService

# The row fields alerts and the policy read.
KEEP = ("health", "reason", "host", "device", "device_health")


class Incidents:
    def __init__(
        self,
        state: RunState,
        alerts: AlertDesk,
        policy: Policy,
        clock: Callable[[], float] = time.time,
        spikes: SpikeWatch | None = None,
        stop_estimate: Callable[[], float | None] | None = None,
    ):
        self.state = state
        self.alerts = alerts
        self.policy = policy
        self.spikes = spikes
        self.clock = clock
        self.rows: dict[int, dict] = {}
        self.restarts = RestartAlerts(alerts, state.run_dir)  # rankwatch launch's relaunches
        self.killwait = KillWaitAlerts(alerts, state, stop_estimate)  # a stop longer than Slurm's KillWait
        self._pushed = Changed()  # (policy version, deliveries version) last pushed

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        state: RunState,
        stop: StopService,
        audit: AuditLog,
        start_task: Callable,
        index: Callable | None = None,
    ) -> Incidents:
        """Build from the settings; ValueError (naming the setting) for a bad URL, mode or rule."""
        sender = WebhookSender(
            parse_urls(config["WEBHOOK_URL"]),
            audit.path,
            db_root=audit.root,
            timeout_s=config["WEBHOOK_TIMEOUT_S"],
            give_up_s=config["WEBHOOK_GIVE_UP_S"],
            retry_max_s=config["WEBHOOK_RETRY_MAX_S"],
            start_task=start_task,
            run=audit.run,
            shared=audit.shared,
        )
        alerts = AlertDesk(
            sender,
            # The run's id (its path under --runs, else its directory's name), not its absolute
            # path: a webhook's channel is often read by more people than the dashboard (P11).
            audit.run or os.path.basename(os.path.normpath(str(config["RUN_DIR"] or "run"))),
            group_s=config["ALERT_GROUP_S"],
            summary_over=config["ALERT_SUMMARY_OVER"],
            rate_per_min=config["ALERT_RATE_PER_MIN"],
        )
        policy = Policy(
            parse_rules(config["POLICY_RULES"]),
            parse_mode(config["POLICY_MODE"]),
            stop,
            audit,
            alerts,
            deadline_s=config["STOP_DEADLINE_S"],
        )
        # The loss-spike policy (issue 34); index: the checkpoint index, for the rollback target.
        spikes = SpikeWatch(state, config, stop, audit, alerts, index=index)
        return cls(state, alerts, policy, spikes=spikes, stop_estimate=stop.estimated_s)

    # ------------------------------------------------------------------ the tick
    def tick(self, now: float, pushed: tuple[str, dict] | None, stop_status: Mapping | None) -> tuple | None:
        """Take this tick's changes; returns ``(EVENT, status)`` when the page's view changed."""
        if pushed is not None:
            self._take(now, *pushed)
        job = self.state.job()
        self.policy.new_job(None if job is None else job.get("started_at"))
        if stop_status is not None and self.alerts.enabled:
            self._stop_alerts(stop_status)
        self.restarts.tick()
        self.killwait.tick(now)
        self.alerts.flush(now)
        self.policy.tick(now, self.rows, stop_status)
        if self.spikes is not None:
            self.spikes.tick(now)
        mark = (self.policy.version, self.alerts.sender.version, self.spikes.version if self.spikes else 0)
        if self._pushed.take(mark):
            return EVENT, self.status(now)
        return None

    def _take(self, now: float, event: str, body: dict) -> None:
        if event == SNAPSHOT_EVENT:
            changes = body["ranks"]
            for r in set(self.rows) - {row["rank"] for row in changes}:
                del self.rows[r]
                self.policy.observe(r, None, now)
        elif event == DELTA_EVENT:
            changes = body.get("rows", ())
        else:
            return
        for change in changes:
            r = change["rank"]
            row = self.rows.get(r)
            new = row is None
            if new:
                row = self.rows[r] = dict.fromkeys(KEEP)
            before = row["health"]
            touched = False
            for key in KEEP:
                if key in change and (new or change[key] != row[key]):
                    row[key] = change[key]
                    touched = True
            if not touched:
                continue
            if row["health"] != before and row["health"] is not None:
                self.alerts.verdict(r, row["health"], row["reason"] or "", now)
            self.policy.observe(r, row, now)

    def _stop_alerts(self, status: Mapping) -> None:
        """A stop's request, cancel and completion, each announced once."""
        request = status.get("request") or {}
        rid = request.get("request_id")
        if not rid:
            return
        who, reason = request.get("requested_by") or "?", request.get("reason") or ""
        self.alerts.once(
            f"stop-request:{rid}",
            "stop_requested",
            f"graceful stop requested by {who}: {reason} ({rid})",
            request_id=rid,
            who=who,
            reason=reason,
        )
        if status.get("summary"):
            self.alerts.once(
                f"stop-complete:{rid}",
                "stop_completed",
                # A stop the job ended without obeying has a summary too ("not obeyed: ...").
                f"graceful stop {rid} was {status['summary']}"
                if status.get("state") == "not_obeyed"
                else f"graceful stop {rid} completed: {status['summary']}",
                request_id=rid,
                stop_step=status.get("stop_step"),
                summary=status["summary"],
            )
        elif status.get("state") == "cancelled":
            self.alerts.once(
                f"stop-cancel:{rid}", "stop_cancelled", f"graceful stop {rid} was cancelled", request_id=rid
            )

    # ------------------------------------------------------------------ the page
    def alerts_status(self) -> dict:
        sender = self.alerts.sender
        return {
            "enabled": sender.enabled,
            "targets": sender.targets,
            "queued": sender.queued(),
            "recent": sender.recent(20),
        }

    def status(self, now: float | None = None) -> dict:
        """The ``incidents`` event: ``{"policy": GET /api/policy, "alerts": GET /api/alerts}``."""
        now = self.clock() if now is None else now
        return {"now": now, "policy": self.policy.status(now), "alerts": self.alerts_status()}
