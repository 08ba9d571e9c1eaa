"""The batch script ``rankwatch slurm template`` prints, and what its last line decides.

The script is documented in docs/slurm.md; the choices it makes, in short:

* one ``rankwatch launch`` per node, through ``srun --ntasks-per-node=1``,
  around msrun with ``--worker_num`` = workers per node x
  ``SLURM_JOB_NUM_NODES``, ``--node_rank`` = ``SLURM_NODEID`` and the master
  address the first host of ``SLURM_JOB_NODELIST``;
* the run directory named by the job (``$SLURM_SUBMIT_DIR/runs/$SLURM_JOB_NAME``)
  or given: a requeued job keeps its job id, name and submit directory, so it
  finds its attempts and checkpoints and ``rankwatch launch`` resumes from
  the newest healthy set. ``SLURM_RESTART_COUNT`` steers nothing: it is
  recorded in each attempt's ``scheduler``;
* the batch shell traps SIGTERM (``--signal=B:TERM@N``, ``scancel
  --signal=TERM --batch``, Slurm's own kill) and turns it into the graceful
  stop through the flag (``rankwatch slurm signalled``), which every node's
  ranks read from the shared run directory;
* after srun, ``rankwatch slurm ended`` (``after_launch`` below) requeues
  the job only if the attempt was preempted, and never a run that cannot
  progress.
"""

from __future__ import annotations

import os
import shlex
import subprocess

from app.slurmqueue import COMMENT_PREFIX
from app.supervise import policy
from trainer_bridge.rundir import attempts

# rankwatch launch's exit statuses after which another run of the job would do the same:
# the restart budget, the same failure before the first step twice, no progress (NVRx's 93).
CANNOT_PROGRESS = (policy.BUDGET, policy.STARTUP, policy.NO_PROGRESS)

TEMPLATE = """\
#!/bin/bash
# rankwatch launch under Slurm (docs/slurm.md). Printed by: rankwatch slurm template{argv}
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task={cpus}
#SBATCH --requeue
# SIGTERM to this shell N s before the time limit: N must cover the graceful stop (docs/slurm.md).
#SBATCH --signal=B:TERM@{signal_s}
#SBATCH --open-mode=append
#SBATCH --output={output}
{time_line}{comment_line}
set -u

# Stable across requeues (same job name and submit directory): the requeued job resumes from it.
RUN_DIR={run_dir}
WORKERS_PER_NODE={workers}
MASTER_PORT={master_port}
TRAIN=({train})

# The master: the first host of the allocation, at Slurm's own address for it (NodeAddr, the node's
# name unless the cluster's slurm.conf gives another).
FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_ADDR=$(scontrol show node "$FIRST_NODE" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
MASTER_ADDR=${{MASTER_ADDR:-$FIRST_NODE}}
WORKER_NUM=$((WORKERS_PER_NODE * SLURM_JOB_NUM_NODES))
export RUN_DIR MASTER_ADDR MASTER_PORT WORKERS_PER_NODE WORKER_NUM
mkdir -p "$RUN_DIR"
echo "rankwatch slurm: job $SLURM_JOB_ID, restart ${{SLURM_RESTART_COUNT:-0}}, nodes $SLURM_JOB_NODELIST," \\
    "run directory $RUN_DIR"

# Whether the stop fits in KillWait, from the save time measured at the run's last stop (a warning only).
rankwatch slurm check --run-dir "$RUN_DIR" || true

# Slurm's signal asks for the graceful stop: the flag, one agreed step, a checkpoint on every rank.
# --at: when the shell got it (the command's own start takes seconds of KillWait; the note says so).
on_signal() {{
    rankwatch slurm signalled --run-dir "$RUN_DIR" --signal "$1" --at "$(date +%s.%N)"
}}
trap 'on_signal TERM' TERM
trap 'on_signal USR1' USR1

srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=0 \\
    bash -c 'exec rankwatch launch --run-dir "$RUN_DIR" {launch_args}-- msrun \\
        --worker_num="$WORKER_NUM" --local_worker_num="$WORKERS_PER_NODE" \\
        --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --node_rank="$SLURM_NODEID" \\
        --log_dir="$RUN_DIR/msrun_logs" --join=True "$@"' rankwatch-launch "${{TRAIN[@]}}" &
SRUN=$!
# A trapped signal interrupts wait: wait again until srun has ended.
while :; do
    wait "$SRUN"
    rc=$?
    kill -0 "$SRUN" 2>/dev/null || break
done

# Requeue only a preempted attempt; never a run that cannot progress (launch's 4, 5, 93).
trap '' TERM USR1
exec rankwatch slurm ended --run-dir "$RUN_DIR" --launch-exit "$rc"
"""


def render(
    train: list[str],
    job_name: str = "rankwatch",
    nodes: int = 1,
    workers: int = 8,
    cpus: int = 1,
    signal_s: int = 120,
    master_port: int = 8118,
    run_dir: str | None = None,
    time_limit: str | None = None,
    launch_args: list[str] | None = None,
    argv: list[str] | None = None,
) -> str:
    q = shlex.quote
    return TEMPLATE.format(
        argv=(" " + " ".join(q(a) for a in argv)) if argv else "",
        job_name=q(job_name),
        nodes=nodes,
        cpus=cpus,
        signal_s=signal_s,
        output=q(f"{job_name}-%j.out"),
        time_line=f"#SBATCH --time={q(time_limit)}\n" if time_limit else "",
        # How the dashboard (RANKWATCH_SLURM) finds the run of a queued job: without it, SUBMIT_DIR/runs/NAME.
        comment_line=f"#SBATCH --comment={q(COMMENT_PREFIX + os.path.abspath(run_dir))}\n" if run_dir else "",
        run_dir=q(run_dir) if run_dir else '"$SLURM_SUBMIT_DIR/runs/$SLURM_JOB_NAME"',
        workers=workers,
        master_port=master_port,
        train=" ".join(q(a) for a in train),
        # Inside the single-quoted bash -c: plain words only (click's choices below are numbers).
        launch_args="".join(f"{a} " for a in (launch_args or [])),
    )


def after_launch(run_dir: str, code: int, env: dict) -> tuple[int, bool, str]:
    """(the batch script's exit status, requeue or not, what to print) once ``rankwatch launch`` returned."""
    if code in CANNOT_PROGRESS:
        return code, False, f"rankwatch launch exited {code}: the run cannot progress; not requeued"
    if code != policy.OK:
        return code, False, f"rankwatch launch exited {code}; not requeued"
    try:
        rows = attempts.fold(attempts.read_lines(run_dir)[0])
    except OSError:
        rows = []
    cause = (rows[-1].get("cause") or {}) if rows else {}
    if cause.get("kind") != "preempted":
        return code, False, f"the run ended ({cause.get('kind') or 'finished'}); not requeued"
    return code, True, f"preempted by {cause.get('signal')}: requeueing job {env.get('SLURM_JOB_ID')}"


def requeue(job_id: str) -> str | None:
    """``scontrol requeue JOB``; what went wrong, or None (Slurm may have requeued it already)."""
    try:
        r = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit status {r.returncode}")
