"""Issue 18, invariant 3: ``kill -9`` of the deleter at random points never leaves a set
that looks complete but is not, and the next run finishes the job.

The deleter is ``rankwatch checkpoints gc --apply`` in a process of its own
(the same ``Retention.apply`` the page's Apply and the policy run). Each round
adds new sets, starts it, waits until it has begun deleting (its journal
appears), lets it run a random moment more and kills it with SIGKILL. Then
the real index must report every set that lost a file as partial.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

from app.audit import AuditLog
from app.checkpoints import retention as rt
from tests.helpers import ckptcraft
from tests.helpers.heartbeats import write_job
from trainer_bridge.rundir import ckptindex

WORLD = 32
# Kills that land while the journal is there (mid-deletion). Counted as events, not
# expected from a fixed number of rounds: on a loaded host more kills land after it.
MID_DELETE_KILLS = 20
MAX_ROUNDS = 400  # a guard only
OLD = time.time() - 3600


def write_set(run_dir: Path, step: int) -> dict[str, Path]:
    paths = {}
    for r in range(WORLD):
        p = ckptcraft.write(
            run_dir / f"ckpt/rank_{r}/net-1_{step}.ckpt",
            ckptcraft.ckpt(
                ckptcraft.entry("w", ckptcraft.tensor([256], "Float32", b"\1" * 1024)), global_step=step
            ),
        )
        os.utime(p, (OLD, OLD))
        paths[r] = p
    return paths


def gc(run_dir: Path) -> int:
    """Fork a deleter: ``Retention.apply`` as the CLI's ``gc --apply`` runs it; its pid."""
    pid = os.fork()
    if pid == 0:  # the child: apply and leave, never back into pytest
        code = 1
        try:
            from tests.helpers.checkpoints import retention

            r = retention(run_dir, RETENTION_KEEP=3, RETENTION_SETTLE_S=1.0)
            code = 0 if not r.apply(None, WORLD, {}, who="cli")["failed"] else 2
        finally:
            os._exit(code)
    return pid


def alive(pid: int) -> bool:
    done, _ = os.waitpid(pid, os.WNOHANG)
    return done == 0


def identity(path: Path) -> tuple | None:
    """The journal's inode and mtime: each atomic rewrite makes a new file."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def check(run_dir: Path, written: dict[int, dict[str, Path]]) -> int:
    """No set reported complete with a missing file; returns how many sets were caught partial."""
    index = ckptindex.scan(run_dir, WORLD)
    by_step = {s.global_step: s for s in index.sets}
    caught = 0
    for step, paths in written.items():
        missing = [p for p in paths.values() if not p.exists()]
        s = by_step.get(step)
        if s is None:
            assert len(missing) == WORLD, f"set {step} vanished from the index with files left"
            continue
        if missing:
            assert not s.complete, f"set {step} is reported complete but {missing} is gone"
            assert 0 in s.ranks_missing, f"set {step} lost a file other than rank 0's first"
            caught += 1
    return caught


def test_kill_9_of_the_deleter_at_random_points(run_dir):
    write_job(run_dir, WORLD)
    rng = random.Random(18)
    written: dict[int, dict[str, Path]] = {}
    step = 0
    rounds = mid_delete = partial_seen = 0
    journal = Path(rt.journal_path(str(run_dir)))
    while (mid_delete < MID_DELETE_KILLS or not partial_seen) and rounds < MAX_ROUNDS:
        rounds += 1
        for _ in range(3):
            step += 10
            written[step] = write_set(run_dir, step)
        before = identity(journal)
        pid = gc(run_dir)
        # Wait for the event (a journal written anew: deletion has begun), then a random moment more.
        deadline = time.monotonic() + 120
        running = True
        while identity(journal) == before and time.monotonic() < deadline:
            running = alive(pid)
            if not running:
                break
            time.sleep(0.0005)
        time.sleep(rng.uniform(0, 0.03))
        if running and alive(pid):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            mid_delete += journal.exists()
        partial_seen += check(run_dir, written)
    # The killed runs really stopped mid-deletion, and some left a set half deleted.
    assert mid_delete >= MID_DELETE_KILLS, (mid_delete, rounds)
    assert partial_seen > 0, rounds
    # The next run finishes the job: only the newest three sets are left, all whole.
    _, status = os.waitpid(gc(run_dir), 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not journal.exists()
    index = ckptindex.scan(run_dir, WORLD)
    assert [s.global_step for s in index.sets] == [step, step - 10, step - 20]
    assert all(s.complete for s in index.sets)
    check(run_dir, written)
    # Every set that went is in the audit trail, once.
    rows = [r for r in AuditLog(run_dir / "rankwatch/audit.sqlite3").rows() if r["action"] == "delete"]
    audited = [r["detail"] for r in rows if "deleted" in r["outcome"]]
    gone = [s for s in written if s < step - 20]
    for s in gone:
        assert sum(f'#g{s}"' in d for d in audited) >= 1, f"set {s} deleted without an audit row"
