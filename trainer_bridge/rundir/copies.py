"""Is this run directory the one its job wrote into, or a copy of it?

``cp -a``, rsync or a restored backup makes a new directory and carries
``job.json`` and the heartbeats along: the pids they name are the original
run's processes (still training on this host, or gone, or reused by others),
never the copy's. Probing them judged a copy "failed, 2 dead", or alive while
the original ran (issue 33).

So rank 0 records in ``job.json`` the inode of ``RUN/rankwatch`` it writes
into (``dir_ino``), and a reader compares it with the directory it reads.
Only the inode is compared, not the device: the same directory seen through
another mount (an NFS client, a container's bind mount) has another device
number but the same inode. ``mv`` within a file system keeps the inode: a
moved run is still its own. A relaunch into a copy rewrites ``job.json``
with the copy's inode, and the copy is a live run again. A ``job.json``
without the field (an older bridge) says nothing: the run is read as before.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from trainer_bridge.rundir import runfiles, schema

# A rank of a copied run directory ended, as far as the copy can tell: the state its
# heartbeat had when the copy was made is the last it will have.
COPIED = "copied"
# A copied run's rank, in its row's reason.
COPIED_WORDS = "copied run directory: the process named is not this run's"


def dir_ino(run_dir: str | os.PathLike) -> int | None:
    """The inode of ``RUN/rankwatch`` (not followed if a symlink), or None if it cannot be read."""
    try:
        return os.lstat(runfiles.state_dir(run_dir)).st_ino
    except OSError:
        return None


def copied(run_dir: str | os.PathLike, job: Mapping[str, Any] | None) -> str | None:
    """Why ``run_dir`` is a copy of the run ``job`` (job.json, validated) was written in, or None.

    None also when it cannot be told: no ``job.json``, one without ``dir_ino``,
    or a state directory that cannot be read.
    """
    recorded = job.get("dir_ino") if job else None
    if recorded is None:
        return None
    here = dir_ino(run_dir)
    if here is None or here == recorded:
        return None
    return (
        f"this run directory is a copy: its job.json was written in another directory (inode {recorded}, "
        f"this one is {here}), so the processes its heartbeats name are not this run's"
    )


def copied_dir(run_dir: str | os.PathLike) -> str | None:
    """``copied``, with ``job.json`` read here (a missing or invalid one: None, it cannot be told)."""
    try:
        job = schema.load(schema.Job, runfiles.job_path(run_dir)).to_dict()
    except (OSError, schema.SchemaError):
        return None
    return copied(run_dir, job)
