"""Which ranks have ended, whether msrun has, and what a probe of this host says of their processes.

``RunState`` hands ``RankEnds`` its board (``app.run.judging``) and its
worker logs (``app.run.logmode``) each scan: ``probe_late`` probes the
processes of this host's ranks whose heartbeat is late and tells the board;
``note`` records which ranks have ended (a final state, or the process
gone) and, once all have, whether msrun has; ``facts`` and ``job_over`` are
what the stop (``app.run.jobend``), the status line and goodput read of it.
A probe on this host (``app.run.endproof``) backs what the files claim.
"""

from __future__ import annotations

from app.run.endproof import EndProof
from app.run.heartbeats import ProcessProbe, Stopped, Unreaped
from app.run.jobend import JobFacts
from app.run.judging import VerdictBoard
from app.run.verdicts import TERMINAL_STATES
from trainer_bridge.rundir import copies


class RankEnds:
    """The ends of one view's ranks; not thread-safe (``RunState`` holds the lock)."""

    def __init__(self, hostname: str, probe: ProcessProbe, check_after_s: float):
        self.hostname = hostname
        self._probe = probe
        self.check_after_s = check_after_s
        # rank -> ((pid, started_at), probed at, why gone or None)
        self._probes: dict[int, tuple] = {}
        # rank -> (first seen ended, why): a final state, or its process gone (app.run.jobend)
        self.ended: dict[int, tuple[float, str]] = {}
        self.launcher_gone: str | None = None
        self.launcher_alive = False
        # What a probe on this host says of the processes the ranks that say they ended
        # (app.run.endproof): the stop calls a job over on such evidence, not on files alone.
        self.proof = EndProof(hostname, self.probe_gone, check_after_s)
        # A copied run directory (trainer_bridge.rundir.copies): its pids are the original run's, so
        # nothing is probed, every rank has ended as far as it can tell, and nothing of it runs.
        self.copied = False

    def note(self, board: VerdictBoard, logs, from_log: set[int], view: set[int], now: float) -> None:
        """Which ranks have ended (a final state, or the process gone) and whether msrun has.

        msrun is looked at only once every rank has ended: until then the job
        runs, whatever its launcher does. In a copied run directory every rank has
        ended as far as it can tell, and nothing is probed.
        """
        if self.copied:
            ended = {}
            for r in view:
                hb = board.latest.get(r)
                state = hb.get("state") if hb else None
                why = state if state in TERMINAL_STATES else copies.COPIED
                ended[r] = (self.ended[r][0] if r in self.ended else now, why)
            self.ended = ended
            self.launcher_gone, self.launcher_alive = None, False
            return
        ended = {}
        # msrun kills every worker before it says the job exited: that ends the log ranks too
        # (words not taken while msrun's own process runs: a rank can write its log directory).
        exited = logs.dir.job_exited(self.probe_gone) if logs is not None else None
        for r in view:
            hb = board.latest.get(r)
            state = hb.get("state") if hb else None
            why = state if state in TERMINAL_STATES else board.gone(r)
            if not why and exited and r in from_log:
                why = exited
            if why:
                ended[r] = (self.ended[r][0] if r in self.ended else now, why)
        self.ended = ended
        self.proof.check(set(ended), now)
        self.launcher_gone, self.launcher_alive = None, False
        if logs is not None and view and view <= set(ended):
            self.launcher_gone = logs.launcher_gone(self.probe_gone)
            self.launcher_alive = self.launcher_gone is None and logs.dir.launcher is not None

    def probe_gone(self, pid: int, started: float | None) -> str | None:
        why = self._probe(pid, started)
        return None if isinstance(why, Stopped) else why

    def job_over(self, world: int, logs, from_log: set[int]) -> str | None:
        """Why the job is over (every rank ended, msrun not running), or None while it may run."""
        if not self.facts(logs, from_log).job_ended(world):
            return None
        counts: dict[str, int] = {}
        for _, why in self.ended.values():
            key = why if why in (*TERMINAL_STATES, copies.COPIED) else "gone"
            counts[key] = counts.get(key, 0) + 1
        told = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        return told + (f"; {self.launcher_gone}" if self.launcher_gone else "")

    def facts(self, logs, from_log: set[int]) -> JobFacts:
        """What the stop service needs beyond the heartbeats (see ``app.run.jobend``)."""
        return JobFacts(
            ended=dict(self.ended),
            launcher_gone=self.launcher_gone,
            launcher_alive=self.launcher_alive,
            triggered={r: logs.triggered_at(r) for r in from_log} if logs is not None else {},
            # A copy's processes are not its own: nothing of it runs, whatever runs under those pids.
            proven=frozenset(self.ended) if self.copied else self.proof.proven,
            running=frozenset() if self.copied else self.proof.running,
        )

    def rank0_alive(self, job: dict) -> bool:
        """job.json's rank 0 runs on this host (elsewhere it cannot be told: no)."""
        pid = job.get("pid")
        return (
            not self.copied
            and job.get("host") == self.hostname
            and pid is not None
            and not self._probe(pid, job.get("started_at"))
        )

    def probe_late(self, board: VerdictBoard, logs, from_log: set[int], now: float) -> None:
        """Probe the processes of this host's ranks whose heartbeat is late, and tell the board.

        Each late rank is probed at most once per ``PROCESS_CHECK_AFTER_S``,
        and a process found gone stays gone, so a hung 1024-rank job costs
        few probes; the board finds the late ranks with one vector pass.
        In a copy none is made, and what was is forgotten.
        """
        if self.copied:
            self._probes.clear()
            return
        late = set(board.late(now, self.check_after_s, local_only=True))
        # The silent rule's verdicts say whether the process still runs, so a "runs" probe taken
        # before a rank crossed STALL_MIN_S or DEAD_AFTER_S is taken again as it crosses: else a rank
        # SIGSTOPped just after its probe is announced "still runs" for up to PROCESS_CHECK_AFTER_S.
        edges = (board.th.stall_min_s, board.th.dead_after_s)
        # Ranks shown from their logs: msrun's own words about their end count too (app.run.logmode).
        log_late = {r for r in board.late(now, self.check_after_s) if r in from_log}
        for r in set(self._probes) - late - log_late:
            del self._probes[r]
            board.set_probe(r, None, None, False)
        for r in late:
            hb = board.latest[r]
            pid, started = hb["pid"], hb.get("started_at")
            who, checked_at, why = self._probes.get(r, (None, None, None))
            if (
                who != (pid, started)
                or (
                    (why is None or isinstance(why, (Stopped, Unreaped)))
                    and now - checked_at >= self.check_after_s
                )
                or (why is None and _crossed(hb.get("time"), edges, checked_at, now))
            ):
                why = self._probe(pid, started)
                self._probes[r] = ((pid, started), now, why)
            said = logs.gone(r) if r in log_late else None
            if isinstance(why, Stopped):
                board.set_probe(r, None, f"{why} (host {self.hostname})", False)
            elif why:
                board.set_probe(
                    r, f"{why} (host {self.hostname})" + (f"; {said}" if said else ""), None, False
                )
            else:
                board.set_probe(r, None, None, True)  # it runs: what an old log line says is over
        for r in log_late - late:
            # Not probed from here (no pid, another host): msrun's words alone, once its log is late.
            said = logs.gone(r)
            self._probes[r] = ((None, None), now, said)
            board.set_probe(r, said, None, False)


def _crossed(beat, edges, since: float, now: float) -> bool:
    """Whether a heartbeat written at ``beat`` became ``edge`` old after ``since`` (for any edge)."""
    if not isinstance(beat, (int, float)) or isinstance(beat, bool):
        return False
    return any(since < beat + e <= now for e in edges)
