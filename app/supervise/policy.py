"""What the supervisor decides after an attempt: where to resume, and whether to relaunch at all.

The rules, each counted from the run directory's supervised lines
(``attempts.jsonl``), so a supervisor started again on the run continues
them rather than starting afresh:

* **the budget**: at most ``max_restarts`` relaunches by ``rankwatch launch``
  in the run directory, whatever supervisor made them (exit ``BUDGET``);
* **no progress**: ``no_progress`` attempts in a row that did not train past
  the furthest global step of any attempt before them end the run (exit
  ``NO_PROGRESS``, distinct from the budget: a job that cannot get further
  is not helped by more restarts, the nvidia-resiliency-ext rule);
* **startup**: the same failure twice in a row before the first step ends
  the run at once with its error line (exit ``STARTUP``): a script that
  fails at import must not burn the budget through long backoffs;
* **backoff**: ``backoff_s * 2 ** (restarts in a row - 1)``, capped; an
  attempt that trained a step resets the streak.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.checkpoints import finite, target
from trainer_bridge.rundir import ckpthealth, ckptindex, rollbacks, supervised

# The exit statuses of rankwatch launch (docs/cli.md, "launch").
OK = 0
FAILED = 1  # a failure that is not relaunched (a stop was asked, or TTP/MindCluster own recovery)
REFUSED = 3
# The statuses that give up on a failing run live with the supervised lines: the dashboard reads them.
BUDGET, STARTUP, NO_PROGRESS = supervised.BUDGET, supervised.STARTUP, supervised.NO_PROGRESS
ROLLBACK_REFUSED = supervised.ROLLBACK_REFUSED  # a loss-spike rollback found no healthy set to go back to
ROLLBACK_EXHAUSTED = supervised.ROLLBACK_EXHAUSTED  # MAX_ROLLBACKS loss-spike rollbacks spent in this run
INTERRUPTED = 130
MAX_BACKOFF_S = 300.0
# The causes that are failures: relaunched, and counted by the budget and the rules.
FAILURES = ("crash", "hang")


@dataclass
class History:
    """The run's supervised attempts so far, as the rules need them."""

    restarts: int = 0
    best_step: int | None = None
    stalled: int = 0  # attempts in a row that did not advance
    startup_streak: tuple[str, int] | None = None  # (failure signature, count) before step 1
    restart_streak: int = 0  # relaunches since an attempt last trained a step

    def add(self, rec: dict) -> None:
        """Fold one supervised record (oldest first)."""
        cause = rec["cause"]
        # A loss-spike rollback has its own budget (rollback.py, rollbacks.jsonl), not the restarts'.
        if rec.get("restarted_by") == "launch" and cause["kind"] != "rollback":
            self.restarts += 1
        if cause["kind"] not in FAILURES:
            return
        last = rec.get("last_step")
        if rec.get("progressed"):
            self.stalled = 0
            self.restart_streak = 0
        else:
            self.stalled += 1
        if rec.get("restarted_by") == "launch":
            self.restart_streak += 1
        if last is not None and (self.best_step is None or last > self.best_step):
            self.best_step = last
        if cause.get("before_first_step"):
            sig = signature(cause)
            n = self.startup_streak[1] + 1 if self.startup_streak and self.startup_streak[0] == sig else 1
            self.startup_streak = (sig, n)
        else:
            self.startup_streak = None

    @classmethod
    def of(cls, records: list[dict]) -> History:
        """From ``attempts.read_lines``: one supervised line per attempt, written when it was decided."""
        h = cls()
        for rec in records:
            if rec.get("kind") == "supervised":
                h.add(rec)
        return h


def signature(cause: dict) -> str:
    """Two failures are the same when the same error line (or exit status or signal) ended them."""
    if cause.get("error"):
        return f"error:{cause['error']}"
    return f"{cause.get('role')}:{cause.get('exit_code')}:{cause.get('signal')}"


def advanced(last_step: int | None, best_before: int | None) -> bool:
    """Did an attempt train past every earlier attempt's last step?"""
    if last_step is None:
        return False
    return best_before is None or last_step > best_before


def backoff(base_s: float, streak: int) -> float:
    return min(MAX_BACKOFF_S, base_s * 2 ** max(0, streak - 1))


# The most checkpoint bytes one choice reads to check that weights are finite (finite.py).
SCAN_BUDGET_BYTES = 8 << 30
ResumeChoice = target.Choice


def tensors() -> finite.Reader:
    """The supervisor's tensor check, fresh for each choice: up to ``SCAN_BUDGET_BYTES`` read."""
    return finite.Reader(SCAN_BUDGET_BYTES)


def choose_resume(run_dir: str, world_size: int, max_named: int = 5) -> ResumeChoice:
    """The newest set that is complete across ``world_size`` ranks and healthy, of any origin.

    ``target.newest_healthy``: newer sets that are incomplete, corrupt or
    unhealthy (``ckpthealth``: a MindSpore ``*_breakpoint.ckpt``, a save after
    a NaN loss, MindFormers' health file), and sets with a weight that is NaN
    or infinite (read from the files, up to ``SCAN_BUDGET_BYTES`` in all: past
    it a set is taken unread) are passed over and named. A set without a
    global step cannot be pinned (``RANKWATCH_RESUME_STEP``) and is passed
    over too, and so are the sets a loss-spike rollback went back past (``target.left_behind``):
    resumed after a crash or by a restarted supervisor, they would undo it. A rollback's target is
    ``target.rollback_target``.
    """
    index = ckptindex.scan(run_dir, world_size=world_size)
    lines, _ = rollbacks.read_lines(run_dir)
    unhealthy = {**ckpthealth.unhealthy(run_dir, index), **target.left_behind(index, lines)}
    return target.newest_healthy(index, unhealthy, tensors=tensors(), max_named=max_named)
