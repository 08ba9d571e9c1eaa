"""Process evidence that a rank has ended, beyond what its files say.

A heartbeat's ``state: finished`` is a claim: anything that writes the run
directory can make it (issue 32, P1). A stop is called "not obeyed" and
re-armed automatically only on evidence: every process that has reported for
the rank (its host, pid and start time, as its heartbeats carried them) is
gone by a probe on this host. A rank any of whose processes ran on another
host, or reported no pid, cannot be proven here; one whose process a probe
finds running has not ended, whatever its file says. A log-mode beat read
before msrun's scheduler named the rank's host is taken as this host's when
a later beat names the same pid here.

``EndProof`` keeps the identities each rank's heartbeats carried (a few,
newest last) and probes those of the ranks said to have ended: a gone
process stays gone, a running one is probed again at most once per
``PROCESS_CHECK_AFTER_S``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

# Identities kept per rank: a relaunch adds one; a second writer (a forged file) adds more.
MAX_IDENTITIES = 4


class EndProof:
    def __init__(self, hostname: str, probe_gone: Callable[[int, float | None], str | None], every_s: float):
        self.hostname = hostname
        self._probe_gone = probe_gone
        self.every_s = every_s
        self._ids: dict[int, list[tuple]] = {}
        # (pid, started_at) -> (probed at, why gone or None)
        self._probes: dict[tuple, tuple[float, str | None]] = {}
        self.proven: frozenset[int] = frozenset()
        self.running: frozenset[int] = frozenset()

    def observe(self, rank: int, hb: dict | None) -> None:
        """Note the identity ``hb`` carries (a rank's newest heartbeat, bridge or log)."""
        if not hb:
            return
        ident = (hb.get("host"), hb.get("pid"), hb.get("started_at"))
        ids = self._ids.setdefault(rank, [])
        if ident in ids:
            ids.remove(ident)
        ids.append(ident)
        del ids[:-MAX_IDENTITIES]

    def check(self, ended: Iterable[int], now: float) -> None:
        """Probe the processes of the ranks said to have ended; sets ``proven`` and ``running``."""
        proven, running, used = set(), set(), set()
        for rank in ended:
            verdict = True
            ids = self._ids.get(rank, ())
            if any(pid is not None for _, pid, _ in ids):
                # A beat without a pid (a log read before its writer was found) names no process.
                ids = [i for i in ids if i[1] is not None]
            local = {pid for host, pid, _ in ids if host == self.hostname}
            for host, pid, started in ids:
                if host is None and pid in local:
                    # A log read before msrun's scheduler named the rank's host: the same pid, seen
                    # on this host since. Probed without a start time, so any process under that
                    # pid counts as running: a forged start time cannot make it look gone.
                    host, started = self.hostname, None
                if host != self.hostname or pid is None:
                    verdict = None
                    continue
                key = (pid, started)
                used.add(key)
                at, why = self._probes.get(key, (None, None))
                if at is None or (why is None and now - at >= self.every_s):
                    why = self._probe_gone(pid, started)
                    self._probes[key] = (now, why)
                if not why:
                    verdict = False
                    break
            if verdict is False:
                running.add(rank)
            elif verdict and self._ids.get(rank):
                proven.add(rank)
        self._probes = {k: v for k, v in self._probes.items() if k in used}
        self.proven, self.running = frozenset(proven), frozenset(running)
