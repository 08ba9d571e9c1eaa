"""One run's engines as the console uses them: the ``Rankwatch`` container, built one way.

``create_app`` builds the one container of ``--run-dir RUN`` with it, and
the registry (``app/runs/registry.py``) one per run under ``--runs ROOT``.
Both go through ``app.services.open_run``, the factory the CLI uses too.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from app import push
from app.extensions import Rankwatch, socketio


def build(
    config: Mapping[str, Any], run_dir: str | None, *, room: str | None = None, cluster=None
) -> Rankwatch:
    """The engines of ``run_dir`` with the app's settings; ``room``: the run its pushes are for.

    ``room`` is None for the one run of ``--run-dir`` (today's rooms), else
    the run id: its pages join that run's rooms, so pushes never mix runs.
    """
    from app.incidents.monitor import Incidents
    from app.incidents.stacks import StackService
    from app.run.logmode import resolve_dir
    from app.services import open_run
    from app.watcher import Watcher
    from trainer_bridge.rundir.pyspy import find_pyspy

    config = {**config, "RUN_DIR": run_dir or ""}
    run = open_run(
        run_dir,
        config,
        start_task=socketio.start_background_task,
        emit=functools.partial(push.emit, socketio, run=room),
    )
    state, stop, checkpoints = run.state, run.stop, run.checkpoints
    incidents = Incidents.from_config(config, state, stop, run.audit, socketio.start_background_task)
    return Rankwatch(
        state=state,
        watcher=Watcher(
            socketio,
            state,
            config["TICK_S"],
            stop=stop,
            checkpoints=checkpoints,
            incidents=incidents,
            cluster=cluster,
            room=room,
            window_ranks=config["PAGE_WINDOW_RANKS"],
        ),
        stop=stop,
        checkpoints=checkpoints,
        stacks=StackService(
            run_dir,
            state,
            start_task=socketio.start_background_task,
            pyspy=functools.partial(find_pyspy, config["PYSPY_PATH"]),
            log_dir=resolve_dir(run_dir, config["LOG_DIR"]),
        ),
        incidents=incidents,
        room=room,
    )
