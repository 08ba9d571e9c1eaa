"""The launch guard: before any rank of a launch writes, rank 0 looks at the run's heartbeats.

It reads every heartbeat file of the run directory (``read_heartbeats``)
and looks for ranks of another launch that are alive (``live_ranks``); the
engine (and ``rankwatch launch``) refuses to start if it finds any, saying
why (``refusal``): two launches in one run directory overwrite each other's
heartbeats and checkpoints. Free of MindSpore (the dashboard imports it).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from trainer_bridge.rundir import copies, runfiles, safedirs, schema
from trainer_bridge.rundir.attempts import TERMINAL
from trainer_bridge.rundir.listing import first_of
from trainer_bridge.rundir.liveness import Stopped, probe_process

# A rank on another host counts as alive while its heartbeat is younger than
# this: above beatsink.FILE_EVERY_S, the file's period while Redis carries
# the heartbeats. On this host its pid decides.
LIVE_AGE_S = 30.0
HEARTBEAT_NAME = re.compile(r"rank_(\d+)\.json")
# Set by `rankwatch launch` on several nodes for the attempt after this launch id: its supervisors ended
# every process of it on every node, so its ranks on other hosts (whose pids cannot be probed from
# here) are not alive, however fresh their last heartbeats (app/supervise/nodes.py).
ENDED_ENV = "RANKWATCH_ENDED_LAUNCH"


def read_heartbeats(run_dir: str | os.PathLike) -> list[tuple[int, dict]]:
    """Every valid heartbeat file of the run, as (rank, heartbeat); bad or foreign files skipped."""
    try:
        entries, _ = safedirs.scan_regular(runfiles.state_dir(run_dir), 4 * schema.MAX_RANKS + 64)
    except OSError:
        return []
    out = []
    for entry in entries:
        m = HEARTBEAT_NAME.fullmatch(entry.name)
        if not m or len(m.group(1)) > 7:
            continue
        rank = int(m.group(1))
        try:
            hb = schema.load(schema.Heartbeat, entry.path).to_dict()
        except (OSError, schema.SchemaError):
            continue
        if hb["rank"] == rank:
            out.append((rank, hb))
    return sorted(out, key=lambda p: p[0])


@dataclass(frozen=True)
class LiveRank:
    """A rank of another launch that is alive, as the refusal names it."""

    rank: int
    pid: int | None
    host: str | None
    age_s: float
    launch: str | None


def live_ranks(
    beats: Iterable[tuple[int, dict]],
    *,
    own_launch: str | None,
    host: str,
    now: float,
    probe: Callable[[int, float | None], str | None] = probe_process,
    own_pid: int | None = None,
    ended: str | None = None,
) -> list[LiveRank]:
    """Ranks not of ``own_launch`` that are alive: not ended, a fresh heartbeat, and (on this host) a live pid.

    ``own_pid``'s heartbeat on this host is this very process's earlier run
    (a notebook cell interrupted and run again), never another job.
    """
    live = []
    for rank, hb in beats:
        if hb.get("launch") is not None and hb.get("launch") in (own_launch, ended):
            continue
        if own_pid is not None and hb.get("host") == host and hb.get("pid") == own_pid:
            continue
        if hb["state"] in TERMINAL:
            continue
        age = now - hb["time"]
        if age > LIVE_AGE_S:
            continue
        if hb.get("host") == host and hb.get("pid"):
            why = probe(hb["pid"], hb.get("started_at"))
            if why and not isinstance(why, Stopped):
                continue
        live.append(LiveRank(rank, hb.get("pid"), hb.get("host"), max(0.0, age), hb.get("launch")))
    return live


# How long a launch into a copied run directory watches its heartbeats for one that advances: the
# bridge writes about once a second, at most about 2 s apart (agreements stretched by load).
COPY_WATCH_S = 3.0


def live_others(
    run_dir: str | os.PathLike,
    *,
    host: str,
    now: float,
    own_pid: int | None = None,
    watch_s: float = COPY_WATCH_S,
    ended: str | None = None,
) -> tuple[list[tuple[int, dict]], list[LiveRank]]:
    """(the run's heartbeats, the ranks of another launch alive in it): what a launch checks at start.

    In a copy of a run directory (``copies``) the heartbeats name the original
    run's processes, which may train on, but elsewhere: a rank counts only if
    its heartbeat advances here within ``watch_s`` (a job writing on in a
    ``rankwatch/`` restored under it). Only a copy whose pids run pays that wait.
    """
    beats = read_heartbeats(run_dir)
    live = live_ranks(beats, own_launch=None, host=host, now=now, own_pid=own_pid, ended=ended)
    if not live or not copies.copied_dir(run_dir):
        return beats, live
    time.sleep(watch_s)
    before = {r: (hb.get("started_at"), hb["seq"]) for r, hb in beats}
    after = {r: (hb.get("started_at"), hb["seq"]) for r, hb in read_heartbeats(run_dir)}
    writing = {
        r
        for r, (started, seq) in before.items()
        if r in after and after[r][0] == started and after[r][1] > seq
    }
    return beats, [lr for lr in live if lr.rank in writing]


def refusal(run_dir: str | os.PathLike, live: list[LiveRank], named: int = 8) -> str:
    """Why a launch refuses to start, naming the live ranks of the other one."""
    parts = first_of(
        (
            f"rank {r.rank} (pid {r.pid if r.pid is not None else '?'} on {r.host or '?'}, "
            f"heartbeat {r.age_s:.1f} s ago)"
            for r in live
        ),
        named,
    )
    return (
        f"rankwatch: refusing to start: another launch of a job is training in {run_dir}: "
        f"{parts}. Two launches in one run directory overwrite each other's "
        "heartbeats and checkpoints. Stop that job first (rankwatch stop --run-dir ...) or give "
        "this one its own run directory. A rank on another host counts as alive until its "
        f"heartbeat is {LIVE_AGE_S:.0f} s old."
    )
