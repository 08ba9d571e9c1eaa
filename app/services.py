"""The engines over one run directory, built one way for the dashboard and the CLI.

``create_app`` and the ``rankwatch`` commands (``status``, ``stop``,
``checkpoints``) all call ``open_run``, so a stop from the shell goes
through the same ``StopService`` and the same audit database as the button,
and ``rankwatch status`` judges ranks with the same ``RunState``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from app.audit import AuditLog
from app.run.state import RunState
from app.runs import ids
from app.stop.service import StopService
from trainer_bridge.rundir import runfiles


@dataclass
class Run:
    state: RunState
    audit: AuditLog
    stop: StopService
    checkpoints: Any  # app.checkpoints.service.CheckpointService (imported lazily: it imports app)


def audit_path(run_dir: str | None, config: Mapping[str, Any]):
    """``AUDIT_DB``, else ``RUN/rankwatch/audit.sqlite3``: the trail stays with its run."""
    return config["AUDIT_DB"] or runfiles.state_dir(run_dir or ".") / "audit.sqlite3"


def redis_subscriber(config: Mapping[str, Any], run_dir: str | None):
    """The Redis heartbeat reader when ``REDIS_URL`` is set (trainer_bridge/rundir/redisbus.py), else None."""
    if not config["REDIS_URL"] or not run_dir:
        return None
    from trainer_bridge.rundir import redisbus

    job = config["REDIS_JOB"] or redisbus.job_key(run_dir)
    return redisbus.Subscriber(config["REDIS_URL"], job, key=redis_key(config))


def redis_key(config: Mapping[str, Any]) -> bytes | None:
    """``REDIS_KEY`` as bytes, or None: what signs the heartbeats and the message queue."""
    return config["REDIS_KEY"].encode() if config["REDIS_KEY"] else None


def _thread(fn, *args) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    return thread


def open_run(
    run_dir: str | None,
    config: Mapping[str, Any],
    *,
    start_task: Callable = _thread,
    emit: Callable[[str, dict], None] = lambda event, payload: None,
    run_id: str | None = None,
) -> Run:
    """The view, the audit trail, the stop service and the checkpoint index of ``run_dir``.

    ``start_task`` and ``emit`` are how a deep verify runs and reports
    (Socket.IO's in the dashboard; a thread and nobody to tell in the CLI).
    ``run_id`` is what the audit rows say the run is (by default its path
    below ``RUNS_ROOT``, else its directory's name: ``app.runs.ids.of_dir``).
    """
    from app.checkpoints.retention import Retention
    from app.checkpoints.service import CheckpointService
    from app.checkpoints.verify import Verifier

    # The default trail lives in the run directory: walked from it, following no symlink.
    # A shared one (AUDIT_DB) holds every run's rows: each run reads back its own.
    audit = AuditLog(
        audit_path(run_dir, config),
        root=None if config["AUDIT_DB"] else (run_dir or "."),
        run=run_id or ids.of_dir(run_dir or ".", config["RUNS_ROOT"]),
        shared=bool(config["AUDIT_DB"]),
    )
    checkpoints = CheckpointService(
        run_dir, audit, scan_s=config["CHECKPOINT_SCAN_S"], verifier=Verifier(start_task, emit)
    )
    # The retention plan and its automatic mode (app/checkpoints/retention.py).
    checkpoints.retention = Retention(checkpoints, config)
    from app.agent.hubstate import hub_state
    from app.run.logmode.kept import KeptAttempts

    # With agents (app/agent/), every node's ranks come from their digests in Redis, and the
    # checkpoint browser lists every node's files through the agents.
    hub = hub_state(run_dir, config)
    if hub is not None:
        checkpoints.remote = hub.checkpoint_files
    state = hub or RunState(run_dir, config, redis=redis_subscriber(config, run_dir))
    # The attempts msrun's relaunches erase from the logs, kept beside the audit trail.
    state.keep_log_attempts(KeptAttempts(audit))
    return Run(
        state=state,
        audit=audit,
        stop=StopService(
            run_dir or ".",
            audit,
            deadline_s=config["STOP_DEADLINE_S"],
            auto_rearm=config["AUTO_REARM"],
            holding_after_s=config["STOP_HOLDING_AFTER_S"],
        ),
        checkpoints=checkpoints,
    )
