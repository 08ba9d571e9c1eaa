"""The job's own files: ``job.json``, ``retention.json`` and the lines of ``attempts.jsonl``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from trainer_bridge.rundir.schema.base import (
    MAX_ERROR,
    MAX_PATH,
    MAX_RANKS,
    Count,
    Host,
    LaunchId,
    Path_,
    Pid,
    RequestId,
    UnixTime,
    WorldSize,
    _Model,
)


class Job(_Model):
    """``RUN/rankwatch/job.json``, written by rank 0 when the bridge starts."""

    world_size: WorldSize = Field(description="ranks in the job")
    started_at: UnixTime | None = Field(None, description="when rank 0's bridge started")
    host: Host | None = Field(None, description="rank 0's host")
    pid: Pid | None = Field(None, description="rank 0's process id")
    argv: Annotated[list[Annotated[str, Field(max_length=MAX_PATH)]], Field(max_length=256)] = Field(
        default_factory=list, description="the training script's `sys.argv` (for the relaunch command)"
    )
    launcher_argv: Annotated[list[Annotated[str, Field(max_length=MAX_PATH)]], Field(max_length=256)] = Field(
        default_factory=list,
        description="msrun's own command line (rank 0's parent), with its options; empty when not launched by msrun",
    )
    env: Annotated[
        dict[
            Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")],
            Annotated[str, Field(max_length=MAX_PATH)],
        ],
        Field(max_length=64),
    ] = Field(
        default_factory=dict,
        description="the `MS_*`, `GLOG_*`, `HCCL_*` and `ASCEND_*` variables the job ran with (not msrun's own)",
    )
    front_end: Literal["callback", "loop"] | None = Field(
        None, description="how the bridge is attached: `Model.train`'s callback or `bridge.loop`"
    )
    checkpoint_dir: Path_ = Field(
        "checkpoints", description="where the bridge saves, relative to the run directory"
    )
    sync_interval_s: Annotated[float, Field(gt=0, le=1e6)] | None = Field(
        None, description="the bridge's target seconds between agreements"
    )
    dir_ino: Annotated[int, Field(ge=0, lt=2**64)] | None = Field(
        None,
        description="the inode of `RUN/rankwatch` rank 0 wrote this file in: a directory whose inode differs is "
        "a copy (`cp -a`, a restored backup), whose heartbeats name processes that are not its own",
    )


# The most sets one retention file may pin, and the longest set id it may name.
MAX_PINS = 1000
MAX_SET_ID = 2 * MAX_PATH


class RetentionFile(_Model):
    """``RUN/rankwatch/retention.json``: this run's checkpoint retention, over the dashboard's settings.

    Every field is optional: a missing one keeps the setting's value. The
    checkpoint browser's pin and unpin rewrite ``pinned``.
    """

    mode: Literal["off", "dry_run", "on"] | None = Field(None, description="`RETENTION_MODE` for this run")
    keep: Annotated[int, Field(ge=1, le=100_000)] | None = Field(
        None, description="`RETENTION_KEEP`: the newest complete sets kept"
    )
    every: Annotated[int, Field(ge=0, le=2**53)] | None = Field(
        None, description="`RETENTION_EVERY`: sets at a multiple of this global step are kept (0: off)"
    )
    pinned: Annotated[list[Annotated[str, Field(max_length=MAX_SET_ID)]], Field(max_length=MAX_PINS)] = Field(
        default_factory=list, description="ids of the sets never deleted"
    )


class SpikesFile(_Model):
    """``RUN/rankwatch/spikes.json``: this run's loss-spike policy, over the dashboard's settings.

    Every field is optional: a missing one keeps the setting's value.
    """

    mode: Literal["off", "observe", "enforce"] | None = Field(None, description="`SPIKE_MODE` for this run")
    factor: Annotated[float, Field(gt=1, le=1e6)] | None = Field(None, description="`SPIKE_FACTOR`")
    steps: Annotated[int, Field(ge=1, le=10**6)] | None = Field(None, description="`SPIKE_STEPS`")
    recover_steps: Annotated[int, Field(ge=1, le=10**9)] | None = Field(
        None, description="`SPIKE_RECOVER_STEPS`"
    )
    skip_batches: Annotated[int, Field(ge=0, le=10**9)] | None = Field(None, description="`SKIP_BATCHES`")
    max_rollbacks: Annotated[int, Field(ge=0, le=100)] | None = Field(None, description="`MAX_ROLLBACKS`")


# An attempt line names at most this many hosts (a job's hosts beyond are counted, not named).
MAX_ATTEMPT_HOSTS = 256
AttemptNo = Annotated[int, Field(ge=1, le=10**9)]
Hosts = Annotated[list[Host], Field(max_length=MAX_ATTEMPT_HOSTS)]


class AttemptResume(_Model):
    """The checkpoint set an attempt resumed from."""

    set: Annotated[str, Field(max_length=2 * MAX_PATH)] | None = Field(description="the set's id")
    global_step: Count = Field(description="the set's global step")


class AttemptNode(_Model):
    """One node's end of a supervised attempt, with several nodes (``app/supervise/nodes.py``)."""

    node: Annotated[int, Field(ge=0, lt=MAX_RANKS)] = Field(description="msrun's `--node_rank`")
    host: Host = Field(description="the node's supervisor's host")
    cause: Annotated[str, Field(max_length=16)] = Field(
        description="why it ended there: a cause's kind, or `peer` (another node's failure ended it)"
    )
    ended_at: UnixTime | None = Field(None, description="when its last process of the attempt was gone")
    last_step: Count | None = Field(None, description="the last global step its ranks trained")


class AttemptStart(_Model):
    """A start line of ``RUN/rankwatch/attempts.jsonl``, appended by rank 0 when a launch begins."""

    kind: Literal["start"] = Field(description="`start`")
    attempt: AttemptNo = Field(description="1 for the run's first launch, then +1 per launch")
    launch: LaunchId = Field(description="the launch's id, as in its ranks' heartbeats")
    started_at: UnixTime = Field(description="when rank 0's bridge started")
    world_size: WorldSize = Field(description="ranks in the launch")
    hosts: Hosts = Field(description="hosts of its ranks known so far (rank 0's at start)")
    host_count: Annotated[int, Field(ge=0, le=MAX_RANKS)] | None = Field(
        None, description="how many hosts in all, when more than `hosts` names"
    )
    pid: Pid | None = Field(None, description="rank 0's process id")
    resumed_from: AttemptResume | None = Field(
        None, description="`{set, global_step}`, or null: a fresh start"
    )
    first_step: Count = Field(description="the first global step this attempt trains")
    previous_last_step: Count | None = Field(
        None, description="the last global step the previous attempt trained, as known at start"
    )
    replayed: Annotated[list[Count], Field(min_length=2, max_length=2)] | None = Field(
        None,
        description="`[from, to]`: global steps the previous attempt had trained that this one trains again "
        "(it resumed from an older set); null when it goes on after the last step",
    )
    skipped: Annotated[list[Count], Field(min_length=2, max_length=2)] | None = Field(
        None,
        description="`[from, to]`: global steps whose batches this attempt skipped, untrained (a loss-spike "
        "rollback, `RANKWATCH_SKIP_BATCHES`); the step numbers still count them, so a step is a data position",
    )


class AttemptHosts(_Model):
    """A hosts line: the hosts of every rank, once rank 0 has seen each rank's first heartbeat."""

    kind: Literal["hosts"] = Field(description="`hosts`")
    attempt: AttemptNo = Field(description="as in its start line")
    launch: LaunchId = Field(description="as in its start line")
    hosts: Hosts = Field(description="the hosts of the launch's ranks")
    host_count: Annotated[int, Field(ge=0, le=MAX_RANKS)] = Field(description="how many hosts in all")


class AttemptEnd(_Model):
    """An end line: how an attempt ended, by rank 0, or by the next attempt's rank 0 when it wrote none."""

    kind: Literal["end"] = Field(description="`end`")
    attempt: AttemptNo = Field(description="as in its start line")
    launch: LaunchId = Field(description="as in its start line")
    ended_at: UnixTime | None = Field(None, description="when it ended (the last heartbeat, if sealed later)")
    end: Literal["graceful_stop", "finished", "failed", "killed", "unknown"] = Field(
        description="`graceful_stop`, `finished`, `failed`, `killed` (its ranks vanished without a word) "
        "or `unknown`"
    )
    last_step: Count | None = Field(None, description="the last global step it trained")
    request_id: RequestId | None = Field(None, description="the stop request it served (`graceful_stop`)")
    requested_by: Annotated[str, Field(max_length=200)] | None = Field(
        None, description="who asked for that stop (the flag's `requested_by`; `policy` for the stop policy)"
    )
    source: Literal["flag", "sigterm"] | None = Field(None, description="what asked: the flag or SIGTERM")
    error: Annotated[str, Field(max_length=MAX_ERROR)] | None = Field(None, description="why it failed")
    sealed_by: AttemptNo | None = Field(
        None, description="the attempt that wrote this line from the heartbeats left behind, if not itself"
    )


# The causes a supervised attempt can end with (``rankwatch launch``, app/supervise/).
CAUSES = ("crash", "hang", "node_lost", "rollback", "preempted", "stop", "finished", "interrupted")


SlurmName = Annotated[str, Field(max_length=256)]


class Scheduler(_Model):
    """The batch scheduler an attempt ran under, as its supervisor's environment told it (Slurm's variables)."""

    kind: Literal["slurm"] = Field(description="`slurm`")
    job_id: Annotated[str, Field(max_length=64)] = Field(description="`SLURM_JOB_ID`")
    array_task_id: Annotated[str, Field(max_length=64)] | None = Field(
        None, description="`SLURM_ARRAY_TASK_ID`"
    )
    restart_count: Annotated[int, Field(ge=0, le=10**6)] = Field(
        0, description="`SLURM_RESTART_COUNT`: how many times Slurm requeued the job before this run of it"
    )
    partition: SlurmName | None = Field(None, description="`SLURM_JOB_PARTITION`")
    nodelist: Annotated[str, Field(max_length=4096)] | None = Field(None, description="`SLURM_JOB_NODELIST`")
    job_name: SlurmName | None = Field(None, description="`SLURM_JOB_NAME`")
    kill_wait_s: Annotated[int, Field(ge=0, le=86400)] | None = Field(
        None,
        description="Slurm's `KillWait` (`scontrol show config`) when the attempt started: the seconds between "
        "its SIGTERM and its SIGKILL, which a graceful stop must fit in",
    )


class AttemptCause(_Model):
    """Why an attempt ended, as ``rankwatch launch`` saw it."""

    kind: Literal[
        "crash", "hang", "node_lost", "rollback", "preempted", "stop", "finished", "interrupted"
    ] = Field(
        description="`crash` (a process of the attempt exited non-zero or on a signal), `stop` (a graceful "
        "stop: never relaunched), `preempted` (a graceful stop the batch scheduler asked for, by a signal: "
        "the scheduler requeues the job), `finished`, `interrupted` (a second Ctrl-C to the supervisor ended "
        "it at once), `hang` (a rank stalled past `--hang-restart-s`), `rollback` (a graceful stop asked by "
        "the loss-spike detector in `enforce` mode: relaunched from an older healthy set with the bad data "
        "skipped, or ended when no target or budget is left); `node_lost` is reserved for the rule that "
        "detects it"
    )
    rank: Annotated[int, Field(ge=0, lt=MAX_RANKS)] | None = Field(
        None, description="the rank that failed first (`crash`), when known"
    )
    host: Host | None = Field(None, description="its host")
    pid: Pid | None = Field(None, description="its process id")
    role: Literal["worker", "scheduler", "msrun"] | None = Field(
        None, description="what the failed process was: a worker, msrun's scheduler, or msrun itself"
    )
    exit_code: Annotated[int, Field(ge=0, le=255)] | None = Field(None, description="its exit status")
    signal: Annotated[str, Field(max_length=16)] | None = Field(
        None, description="the signal that ended it (`SIGKILL`, ...)"
    )
    error: Annotated[str, Field(max_length=MAX_ERROR)] | None = Field(
        None, description="the error line, from its worker log (the last exception line)"
    )
    before_first_step: bool = Field(
        False, description="true when the attempt trained no step (the startup rule counts these)"
    )
    # The rollback's fields (issue 34), set with kind `rollback` only; optional, so older lines still load.
    rule: Annotated[str, Field(max_length=32)] | None = Field(
        None, description="`rollback`: the detector's rule (`nonfinite`, `spike`, `grad_norm`, `divergence`)"
    )
    evidence: Annotated[str, Field(max_length=MAX_ERROR)] | None = Field(
        None, description="`rollback`: the evidence in words (rank, step, value, level)"
    )
    from_step: Count | None = Field(None, description="`rollback`: the spike's first abnormal global step")
    to_set: Annotated[str, Field(max_length=2 * MAX_PATH)] | None = Field(
        None, description="`rollback`: the set rolled back to"
    )
    to_step: Count | None = Field(None, description="`rollback`: its global step")
    skip_batches: Count | None = Field(
        None,
        description="`rollback`: `RANKWATCH_SKIP_BATCHES`: the data resumes at global step `E - 1 + "
        "skip_batches`, E being the step the abnormal value was seen at (`from_step` or later; the batches "
        "since `to_step` are skipped too)",
    )
    rung: Annotated[int, Field(ge=1, le=100)] | None = Field(
        None, description="`rollback`: the ladder's rung (2 and up: the same place again, more skipped)"
    )
    signalled_at: UnixTime | None = Field(None, description="when the scheduler's signal came (`preempted`)")
    time_left_s: Annotated[float, Field(ge=0, le=10**9)] | None = Field(
        None, description="the job's time left when the signal came, as the scheduler said (`preempted`)"
    )


class AttemptSupervised(_Model):
    """A supervised line: how ``rankwatch launch`` ended an attempt and what it did next.

    It joins the attempt's row by ``attempt`` (and ``launch`` when the bridge
    wrote a start line). An attempt whose processes died before the bridge
    started (a script that fails at import) has only this line.
    """

    kind: Literal["supervised"] = Field(description="`supervised`")
    attempt: AttemptNo = Field(description="the attempt's number, as in its start line if it has one")
    launch: LaunchId | None = Field(None, description="its launch id, when the bridge wrote a start line")
    supervisor_pid: Pid = Field(description="the `rankwatch launch` process")
    host: Host = Field(description="the supervisor's host")
    world_size: WorldSize | None = Field(None, description="msrun's `--worker_num`")
    spawned_at: UnixTime = Field(description="when the supervisor started msrun for this attempt")
    first_step: Count | None = Field(None, description="the first global step it was to train")
    cause: AttemptCause = Field(description="why it ended")
    fault_at: UnixTime | None = Field(
        None, description="when the first failed process was seen gone (within one poll of the fault)"
    )
    detected_at: UnixTime | None = Field(None, description="when the supervisor decided the attempt failed")
    ended_at: UnixTime | None = Field(None, description="when the last process of the attempt was gone")
    relaunched_at: UnixTime | None = Field(
        None, description="when the next attempt was started (a later line of the same attempt adds it)"
    )
    restarted_by: Literal["launch"] | None = Field(
        None, description="`launch` when `rankwatch launch` relaunched the job after it"
    )
    last_step: Count | None = Field(None, description="the last global step it trained (its heartbeats)")
    progressed: bool = Field(
        False,
        description="true when it trained past every earlier attempt's last step (the no-progress rule)",
    )
    action: Literal["relaunch", "end", "record_only"] = Field(
        description="`relaunch`, `end` (the supervisor ended the run) or `record_only` (MindIO TTP or "
        "MindCluster own recovery)"
    )
    exit_code: Annotated[int, Field(ge=0, le=255)] | None = Field(
        None, description="the supervisor's exit status, when it ended the run"
    )
    resume: AttemptResume | None = Field(None, description="the set the next attempt resumes from")
    note: Annotated[str, Field(max_length=MAX_ERROR)] | None = Field(
        None, description="what the supervisor said: a set passed over, why the run ended"
    )
    scheduler: Scheduler | None = Field(None, description="the batch scheduler it ran under (Slurm), if any")
    nodes: Annotated[list[AttemptNode], Field(max_length=MAX_RANKS)] | None = Field(
        None, description="with several nodes (node 0 writes the line): each node's end of the attempt"
    )


class AttemptRefused(_Model):
    """A refused line: a launch into the run directory while another launch's ranks were alive.

    Its rank 0 appends it before it exits: msrun sends a worker's output to
    its log, so without this line the page and the person who launched it
    never learn why the second job ended.
    """

    kind: Literal["refused"] = Field(description="`refused`")
    at: UnixTime = Field(description="when the launch was refused")
    host: Host = Field(description="the refused launch's rank 0 host")
    pid: Pid = Field(description="its rank 0 process id")
    world_size: WorldSize = Field(description="ranks in the refused launch")
    reason: Annotated[str, Field(max_length=MAX_ERROR)] = Field(
        description="the refusal, naming the live ranks"
    )
