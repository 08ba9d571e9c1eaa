"""The two verdicts the board adds after ``health``'s rules: ``node_lost`` and ``corrupt``.

``lost_nodes`` finds the hosts whose every rank went silent as one while
other hosts still report (a machine or network failure, named within
``stall_min_s`` instead of ``dead_after_s``), by vector operations over the
board's columns; ``with_file_problem`` makes a rank whose heartbeat file
does not validate ``corrupt``. ``app.run.judging.VerdictBoard`` applies both.
"""

from __future__ import annotations

import numpy as np

from app.run.health import Thresholds, Verdict


def lost_nodes(
    th: Thresholds,
    host_names: list[str],
    age: np.ndarray,
    *,
    present: np.ndarray,
    has_hb: np.ndarray,
    terminal: np.ndarray,
    host: np.ndarray,
    from_log: np.ndarray,
    local: np.ndarray,
    time: np.ndarray,
) -> dict[int, str]:
    """rank -> the node-lost reason, for every rank of a host judged lost (the board's columns by rank).

    That is a machine or network failure, not N rank failures, and it is
    known after ``stall_min_s`` of silence instead of ``dead_after_s``.
    A host counts as lost when all its ranks that have not ended (exited,
    finished, failed) sent no heartbeat for ``stall_min_s``, their last
    heartbeats were written within ``stall_min_s`` of each other, and some
    rank on another host wrote one within ``stall_min_s``. The
    dashboard's own host is never lost: its processes are probed directly.
    """
    hosts = len(host_names)
    lost: dict[int, str] = {}
    if hosts >= 2:
        with np.errstate(invalid="ignore"):
            # A quiet worker log is not a silent host (health.judge): only heartbeats count.
            live = present & has_hb & ~terminal & (host >= 0) & ~from_log
            silent = live & (age > th.stall_min_s)
            fresh = live & (age <= th.stall_min_s)
        ids = host[live]
        total = np.bincount(ids, minlength=hosts)
        quiet = np.bincount(host[silent], minlength=hosts)
        heard = np.bincount(host[fresh], minlength=hosts)
        probed = np.bincount(host[live & local], minlength=hosts)
        newest = np.full(hosts, -np.inf)
        oldest = np.full(hosts, np.inf)
        np.maximum.at(newest, host[silent], time[silent])
        np.minimum.at(oldest, host[silent], time[silent])
        others = heard.sum() - heard
        candidates = (total > 0) & (quiet == total) & (probed == 0) & (others > 0)
        candidates &= newest - oldest <= th.stall_min_s
        reporting = int(np.count_nonzero(heard))
        for h in np.flatnonzero(candidates).tolist():
            ranks = np.flatnonzero(silent & (host == h)).tolist()
            n = len(ranks)
            reason = (
                f"node {host_names[h]} lost: all {n} of its rank{'s' if n != 1 else ''} "
                f"stopped sending heartbeats together, while {reporting} other "
                f"{'hosts still report' if reporting != 1 else 'host still reports'}: "
                "a machine or network failure" + (f", not {n} separate rank failures" if n > 1 else "")
            )
            for r in ranks:
                lost[r] = reason
    return lost


def with_file_problem(verdict: Verdict, error: str | None, skew_s: float | None, *, has_hb: bool) -> Verdict:
    """A rank whose heartbeat file is invalid is ``corrupt``; a clock ahead is said in the reason."""
    if error is not None:
        shown = "showing its last valid heartbeat" if has_hb else "it has written no valid one yet"
        return Verdict("corrupt", f"invalid heartbeat ({error}); {shown}", cause="corrupt")
    if skew_s is not None:
        return Verdict(
            verdict.health,
            f"{verdict.reason}; its clock is {skew_s:g} s ahead of the dashboard's "
            "(times clamped to when the heartbeat was read; synchronise clocks with NTP)",
            verdict.score,
            verdict.cause,
        )
    return verdict
