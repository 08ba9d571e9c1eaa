"""How the job was launched: msrun's command line and the environment that shapes MindSpore.

``job.json``'s ``argv`` is the training script's own ``sys.argv``: msrun's
options (``--log_dir``, ``--master_port``, ...) are not in it, so a relaunch
command built from it alone drops them. Rank 0 therefore also records its
parent's command line when the parent is msrun (one read of
``/proc/PPID/cmdline`` through psutil, bounded), and the variables that
change how MindSpore runs (``MS_*``, ``GLOG_*``, ``HCCL_*``, ``ASCEND_*``),
without those msrun sets per worker.

Nothing here may fail training: any error gives an empty answer.
"""

from __future__ import annotations

import os
import re

MAX_ARGS = 256
MAX_ENV = 64
MAX_VALUE = 4096
ENV_PREFIXES = ("MS_", "GLOG_", "HCCL_", "ASCEND_")
# Set by msrun for each worker (mindspore/parallel/cluster/process_entity/_api.py): not the job's choice.
MSRUN_SETS = frozenset(
    {
        "MS_ROLE",
        "MS_SCHED_HOST",
        "MS_SCHED_PORT",
        "MS_WORKER_NUM",
        "MS_NODE_ID",
        "MS_TOPO_TIMEOUT",
        "MS_SIMULATION_LEVEL",
        "MS_ENABLE_RECOVERY",
    }
)
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def is_msrun(cmdline: list[str]) -> bool:
    """``msrun ...`` or ``python -m mindspore.parallel.cluster.run ...``."""
    head = cmdline[:4]
    return any(os.path.basename(a) == "msrun" or a == "mindspore.parallel.cluster.run" for a in head)


def launcher_argv() -> list[str]:
    """The parent's command line if it is msrun, else []."""
    try:
        import psutil

        cmdline = psutil.Process(os.getppid()).cmdline()
    except Exception:  # noqa: BLE001 - psutil missing, the parent gone or unreadable: nothing to record
        return []
    if not is_msrun(cmdline):
        return []
    return [a[:MAX_VALUE] for a in cmdline[:MAX_ARGS]]


def job_env(environ=None) -> dict[str, str]:
    """The variables that shape MindSpore's run, as this process got them."""
    environ = os.environ if environ is None else environ
    out = {}
    for name in sorted(environ):
        if name.startswith(ENV_PREFIXES) and name not in MSRUN_SETS and ENV_NAME.match(name):
            out[name] = environ[name][:MAX_VALUE]
            if len(out) >= MAX_ENV:
                break
    return out
