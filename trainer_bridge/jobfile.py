"""``job.json``, what rank 0 writes once per launch, and ``clip``, which keeps a text within the schema.

The record names the job (world size, host, pid, the script's and msrun's
command lines, the launch environment) for the dashboard's status line and
``rankwatch launch``; the reporter writes it at start.
"""

from __future__ import annotations

import os
import sys

from trainer_bridge.rundir import launch, runfiles, schema


def clip(text: str | None, limit: int) -> str | None:
    """Keep a message within the schema's bound (a MindSpore error can run to pages)."""
    return text if text is None or len(text) <= limit else text[: limit - 3] + "..."


def job_record(
    world: int,
    started_at: float,
    host: str,
    front_end: str | None,
    sync_interval_s: float,
    dir_ino: int | None = None,
) -> schema.Job:
    """This launch's ``job.json`` (SchemaError if a field is out of bounds)."""
    return schema.build(
        schema.Job,
        world_size=world,
        started_at=started_at,
        host=host,
        pid=os.getpid(),
        argv=[clip(a, schema.MAX_PATH) for a in sys.argv[:256]],
        launcher_argv=launch.launcher_argv(),
        env=launch.job_env(),
        front_end=front_end,
        checkpoint_dir=runfiles.CHECKPOINT_DIR,
        sync_interval_s=sync_interval_s,
        dir_ino=dir_ino,
    )
