"""One run's engines, composed in one place: ``build``.

Every engine of a run directory is made here, in dependency order, and
nowhere else: the audit trail, the run model (``RunState``, its rows read
from the run directory or from the agents' ``HubSource``), the checkpoint
index with its retention, the stop service, and, for a dashboard
(``live``), the incidents, the stack service and the watcher that ticks
them all. ``create_app`` builds its run (``--run-dir``)
with it, the registry one per run under ``--runs ROOT``, the runs table an
idle run's row, and the ``rankwatch`` commands (``status``, ``stop``,
``checkpoints``) theirs with ``live=False``: a stop from the shell goes
through the same ``StopService`` and the same audit database as the button,
and ``rankwatch status`` judges ranks with the same ``RunState``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from typing import Any

from app import push
from app.agent.hubsource import hub_source
from app.audit import AuditLog, audit_path
from app.checkpoints.service import CheckpointService
from app.checkpoints.verify import Verifier
from app.cluster import redis_subscriber
from app.edge.auth import redact_run_dir
from app.extensions import Rankwatch, socketio
from app.run.logmode import resolve_dir
from app.run.logmode.kept import KeptAttempts
from app.run.state import RunState
from app.runs import ids
from app.stop.service import StopService
from trainer_bridge.rundir import safedirs


def _thread(fn, *args) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    return thread


def build(
    run_dir: str | None,
    config: Mapping[str, Any],
    *,
    live: bool = True,
    run_id: str | None = None,
    room: str | None = None,
    cluster=None,
) -> Rankwatch:
    """The engines of ``run_dir`` with ``config``'s settings.

    ``live``: a dashboard's run, with its watcher, incidents and stack
    service, whose deep verifies run and report through Socket.IO; else
    (the CLI, an idle run's row) the engines that read and act, a verify on
    a plain thread with nobody to tell. ``run_id`` is what the audit rows say
    the run is (by default its path below ``RUNS_ROOT``, else its directory's
    name: ``app.runs.ids.of_dir``). ``room``: the run its pushes are for (None
    for the one run of ``--run-dir``, today's rooms; else the run id, so
    pushes never mix runs). ``cluster``: several dashboards behind one Redis.
    """
    # What alerts name; a run under --runs is held by its descriptor (app/runs/pinned.py).
    config = {**config, "RUN_DIR": safedirs.shown(run_dir) if run_dir else ""}
    start_task = socketio.start_background_task if live else _thread
    # What the viewers without the token are pushed (app/push.py): as the HTTP answers show them.
    redact = functools.partial(redact_run_dir, run_dir=run_dir, run_id=room)
    emit = (
        functools.partial(push.emit, socketio, run=room, redact=redact)
        if live
        else (lambda event, payload: None)
    )
    # The default trail lives in the run directory: walked from it, following no symlink.
    # A shared one (AUDIT_DB) holds every run's rows: each run reads back its own.
    audit = AuditLog(
        audit_path(run_dir, config),
        root=None if config["AUDIT_DB"] else (run_dir or "."),
        run=run_id or ids.of_dir(run_dir or ".", config["RUNS_ROOT"]),
        shared=bool(config["AUDIT_DB"]),
    )
    # With agents (app/agent/), every node's ranks come from their digests in Redis, and the
    # checkpoint browser lists every node's files through the agents.
    hub = hub_source(run_dir, config)
    if hub is not None:
        state = RunState(run_dir, config, source=hub)
    else:
        state = RunState(run_dir, config, redis=redis_subscriber(config, run_dir))
    # The attempts msrun's relaunches erase from the logs, kept beside the audit trail.
    state.keep_log_attempts(KeptAttempts(audit))
    checkpoints = CheckpointService(
        run_dir,
        audit,
        scan_s=config["CHECKPOINT_SCAN_S"],
        verifier=Verifier(start_task, emit),
        config=config,
        remote=hub.checkpoint_files if hub is not None else None,
    )
    stop = StopService(
        run_dir or ".",
        audit,
        view=state,
        deadline_s=config["STOP_DEADLINE_S"],
        auto_rearm=config["AUTO_REARM"],
        holding_after_s=config["STOP_HOLDING_AFTER_S"],
    )
    rw = Rankwatch(state=state, audit=audit, stop=stop, checkpoints=checkpoints, room=room, redact=redact)
    if not live:
        return rw
    # A dashboard's engines only: a CLI command does not pay for importing them.
    from app.incidents.monitor import Incidents
    from app.incidents.stacks import StackService
    from app.watcher import Watcher
    from trainer_bridge.rundir.pyspy import find_pyspy

    rw.incidents = Incidents.from_config(
        config,
        state,
        stop,
        audit,
        socketio.start_background_task,
        index=lambda: checkpoints.index(state.world_size(), wait=False),
    )
    rw.stacks = StackService(
        run_dir,
        state,
        start_task=socketio.start_background_task,
        pyspy=functools.partial(find_pyspy, config["PYSPY_PATH"]),
        log_dir=resolve_dir(run_dir, config["LOG_DIR"]),
    )
    rw.watcher = Watcher(
        socketio,
        state,
        config["TICK_S"],
        stop=stop,
        checkpoints=checkpoints,
        incidents=rw.incidents,
        cluster=cluster,
        room=room,
        window_ranks=config["PAGE_WINDOW_RANKS"],
        redact=redact,
    )
    return rw
