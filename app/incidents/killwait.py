"""The ``slurm_kill_wait`` alert: a run under Slurm whose graceful stop would not fit in ``KillWait``.

Said before a preemption happens, from the stop measured at the run's last
stop or, before any, the stop dialog's estimate (``app/run/slurmstop.py``,
the same words as the run page and ``rankwatch slurm check``). Once per
Slurm job and ``KillWait`` (``AlertDesk.once``): a job that keeps not
fitting is one alert, not one a tick. Looked at when the attempts change
and at most every ``CHECK_S`` seconds otherwise, since the estimate moves
with the step time.
"""

from __future__ import annotations

from collections.abc import Callable

from app import attempts
from app.incidents.alerts import AlertDesk
from app.run import slurmstop
from app.run.state import RunState

EVENT = "slurm_kill_wait"
CHECK_S = 30.0


class KillWaitAlerts:
    def __init__(
        self, alerts: AlertDesk, state: RunState, estimate: Callable[[], float | None] | None = None
    ):
        self.alerts = alerts
        self.state = state
        self.estimate = estimate
        self._seen: list[dict] | None = None
        self._checked_at = -1e18

    def tick(self, now: float) -> None:
        run_dir = self.state.run_dir
        if run_dir is None or not self.alerts.enabled:
            return
        rows = attempts.rows(run_dir)
        if rows is self._seen and now - self._checked_at < CHECK_S:
            return
        self._seen, self._checked_at = rows, now
        if slurmstop.kill_wait_of(rows) is None:
            return  # not under Slurm (or KillWait unknown): no need to gather every rank's heartbeat
        beats, _ = self.state.heartbeats()
        said = slurmstop.verdict(str(run_dir), rows, beats.values(), self.estimate)
        if said is None or said["fits"] is not False:
            return
        self.alerts.once(
            f"killwait:{run_dir}:{said['job_id']}:{said['kill_wait_s']}",
            EVENT,
            f"Slurm job {said['job_id']}: {said['text']}",
            job_id=said["job_id"],
            needs_s=said["needs_s"],
            kill_wait_s=said["kill_wait_s"],
        )
