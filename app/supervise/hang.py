"""The hang rule of ``rankwatch launch``: a rank ``stalled`` too long ends the attempt as a ``hang``.

Off unless ``--hang-restart-s S`` is given. The verdict is the dashboard's
own: a ``RunState`` on the run directory, judged with the dashboard's
thresholds (the ``RANKWATCH_*`` settings, as ``rankwatch status`` judges
from the files), looked at about once a second. A rank of this attempt (its
heartbeat's pid is one of the attempt's workers) that stays ``stalled`` for
``S`` seconds in a row is a hang. A rank stalled because it saves a
checkpoint, compiles or waits for its first step is not ``stalled`` (the
verdict rules say ``healthy``/``starting``), so a slow save is not a hang.

``--hang-mode dry-run`` (the default, as the stop policy's) only says what it
would do, once per stall, in the terminal; ``restart`` ends the attempt
(SIGTERM, then SIGKILL after the grace: a process stopped with SIGSTOP
obeys SIGKILL) with cause ``hang``, the rank, its host and pid, the verdict's
reason and the newest stack capture of the rank if one exists, and the
supervisor relaunches it like a crash (the budget and the rules count it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from trainer_bridge.rundir import schema, stackfiles

MODES = ("dry-run", "restart")
# How often the run directory is judged (a scan reads every heartbeat file).
EVERY_S = 1.0


@dataclass
class Hang:
    """A rank stalled past the limit."""

    rank: int
    host: str | None
    pid: int | None
    since: float  # when it was first seen stalled
    reason: str
    capture: str | None  # the newest stack capture of the rank, relative to the run directory

    def text(self, limit_s: float) -> str:
        told = f"stalled for over {limit_s:g} s: {self.reason}"
        return told + (f"; stack capture {self.capture}" if self.capture else "; no stack capture")


class HangWatch:
    def __init__(
        self,
        run_dir: str,
        limit_s: float,
        mode: str,
        say: Callable[[str], None],
        open_state: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        if mode not in MODES:
            raise ValueError(f"--hang-mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.run_dir = run_dir
        self.limit_s = limit_s
        self.mode = mode
        self.say = say
        self.clock = clock
        self._open_state = open_state or self._default_state
        self._state = None
        self._since: dict[int, float] = {}
        self._said: set[int] = set()
        self._looked = 0.0

    def _default_state(self):
        from app.compose import build
        from app.config import from_env

        config = {**from_env(), "RUN_DIR": self.run_dir}
        return build(self.run_dir, config, live=False).state

    def begin(self) -> None:
        """A new attempt: stalls of the previous one are forgotten."""
        self._since.clear()
        self._said.clear()
        self._looked = 0.0

    def check(self, worker_pids: Iterable[int]) -> Hang | None:
        """The hang that ends the attempt (restart mode), or None; says a dry run's decision once."""
        now = self.clock()
        if now - self._looked < EVERY_S:
            return None
        self._looked = now
        if self._state is None:
            self._state = self._open_state()
        self._state.scan(now)
        pids = set(worker_pids)
        stalled = {}
        for row in self._state.rows():
            if row.get("health") == "stalled" and row.get("pid") in pids:
                stalled[row["rank"]] = row
        for rank in list(self._since):
            if rank not in stalled:
                del self._since[rank]
                self._said.discard(rank)
        for rank in stalled:
            self._since.setdefault(rank, now)
        # The rank stalled longest first: in a hang its peers stall after it, blocked in a collective.
        for rank in sorted(stalled, key=lambda r: (self._since[r], r)):
            row, since = stalled[rank], self._since[rank]
            if now - since < self.limit_s:
                continue
            hang = Hang(rank, row.get("host"), row.get("pid"), since, str(row.get("reason") or ""), None)
            hang.capture = self._capture(rank)
            if self.mode == "restart":
                return hang
            if rank not in self._said:
                self._said.add(rank)
                self.say(
                    f"hang rule (dry run): rank {rank} {hang.text(self.limit_s)}; with --hang-mode restart "
                    "the attempt would end now with cause hang and be relaunched"
                )
        return None

    def _capture(self, rank: int) -> str | None:
        try:
            files = stackfiles.capture_files(self.run_dir, rank)
        except OSError:
            return None
        if not files:
            return None
        newest = max(files, key=lambda p: int(p.name.split("-", 1)[0]))
        try:
            return str(newest.relative_to(self.run_dir))
        except ValueError:
            return newest.name


def hang_cause(outcome, host: str, trained: bool, limit_s: float) -> dict:
    """The supervised line's cause for an attempt the hang rule ended."""
    hang: Hang = outcome.hang
    return {
        "kind": "hang",
        "rank": hang.rank,
        "host": hang.host or host,
        "pid": hang.pid,
        "role": "worker",
        "error": hang.text(limit_s)[: schema.MAX_ERROR],
        "before_first_step": not trained,
    }


def hang_words(cause: dict) -> str:
    """A hang cause in one line, as ``describe`` says a crash."""
    pid = f" (pid {cause['pid']} on {cause.get('host')})" if cause.get("pid") else ""
    return f"rank {cause.get('rank')}{pid} hung: {cause.get('error') or 'stalled'}"
