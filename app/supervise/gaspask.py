"""The supervisor's side of the dying gasp: ask the survivors to save their replica, wait, forget.

The bridge's side, and the protocol, are ``trainer_bridge/gasp.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from app.supervise import procs
from app.supervise.attempt import Attempt
from trainer_bridge.rundir import gaspfiles, launchguard, runfiles

# With several nodes, the answers read at each poll: the lowest ranks asked (the lowest survivor saves).
WATCHED = 8


def ask(
    run_dir: str,
    attempt: Attempt,
    failed: procs.Proc,
    gasp_s: float,
    wake,
    say: Callable[[str], None],
    world: int | None = None,
) -> str | None:
    """Ask the attempt's survivors to save their replica; wait at most ``gasp_s``.

    ``failed``: the process whose fault ends the attempt. A dead one is no
    survivor anyway; a hung one (the hang rule) is alive but is not asked:
    it may be stuck anywhere, while the others are blocked in a collective
    with it, at their last finished step.

    ``world``: with several nodes, the job's rank count: the ranks of the other
    nodes are asked too (the request file is in the shared run directory), and
    the lowest of them saves when this node has no survivor. Returns what came
    of it, in words, or None when there was no one to ask (no survivor, or a
    job without the bridge).
    """
    workers = [p for p in attempt.procs.values() if p.role == "worker"]
    survivors = {
        p.rank: p
        for p in workers
        if p.status is None and not p.vanished and p.rank is not None and p.pid != failed.pid
    }
    dead = sorted({p.rank for p in workers if p.rank is not None and p.rank not in survivors})
    local = {p.rank for p in workers if p.rank is not None}
    asked = sorted({*survivors, *(r for r in range(world or 0) if r not in local)})
    asked = asked[:WATCHED] if world else asked
    pids = {p.pid for p in workers}
    beats = launchguard.read_heartbeats(run_dir)
    launch = next((hb["launch"] for _, hb in beats if hb.get("pid") in pids and hb.get("launch")), None)
    if not asked or launch is None:
        return None
    try:
        runfiles.atomic_write_json(
            gaspfiles.request_path(run_dir),
            {"launch": launch, "dead": dead, "at": time.time()},
            root=run_dir,
        )
    except OSError as e:
        return f"dying gasp not asked: {e}"
    whom = ", ".join(map(str, asked)) + (" and the ranks above" if world and len(asked) == WATCHED else "")
    say(f"asked rank(s) {whom} to save their replica (dying gasp)")
    deadline = time.monotonic() + gasp_s
    answers: dict[int, dict] = {}
    while time.monotonic() < deadline:
        for rank in asked:
            got = runfiles.read_json_or_none(gaspfiles.answer_path(run_dir, rank))
            if isinstance(got, dict) and got.get("launch") == launch:
                answers[rank] = got
        if any(a.get("status") == "saved" for a in answers.values()) or len(answers) == len(asked):
            break
        wake.wait(0.05)
        wake.clear()
    saved = next((a for a in answers.values() if a.get("status") == "saved"), None)
    if saved is not None:
        told = (
            f"dying gasp: rank {saved.get('rank')} saved its replica at global step "
            f"{saved.get('global_step')} in {float(saved.get('seconds') or 0) * 1e3:.0f} ms"
        )
    elif answers:
        told = "dying gasp: nothing saved: " + "; ".join(
            f"rank {r}: {str(a.get('why'))[:200]}" for r, a in sorted(answers.items())
        )
    else:
        told = f"dying gasp: no survivor answered within {gasp_s:g} s"
    say(told)
    return told


def forget(run_dir: str, world_size: int) -> None:
    """The request and the answers are for one attempt only."""
    paths = [gaspfiles.request_path(run_dir)]
    paths += [gaspfiles.answer_path(run_dir, r) for r in range(world_size)]
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass
