"""The run's attempts as the dashboard shows them (``GET /api/attempts``, the page's timeline).

``attempts.jsonl`` (``trainer_bridge.rundir.attempts``) says how each launch began
and, once it wrote its end line, how it ended. The newest attempt has no end
line while it runs, and never gets one if it was killed: its end is then
judged from its ranks' heartbeats by the same rule the next launch's rank 0
uses when it seals it (``trainer_bridge.rundir.attempts.outcome``), once the
dashboard sees every rank ended and msrun gone.

The file is read again only when its stat changes (it grows by two lines a
launch), and only its bounded tail.
"""

from __future__ import annotations

import copy
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

from trainer_bridge.rundir import attempts, runfiles, safeio, schema

# Run directories whose folded attempts are kept (a runs root will watch many).
CACHED_RUNS = 64
# Ranks a conflict message names per launch.
NAMED = 4


class _Cache:
    """(stat signature, rows, lines skipped, read error, refused launches) per run directory, least recently used out."""

    def __init__(self):
        self._lock = threading.Lock()
        self._runs: OrderedDict[str, tuple] = OrderedDict()

    def rows(self, run_dir: Path) -> tuple[list[dict], int, str | None]:
        return self.read(run_dir)[:3]

    def read(self, run_dir: Path) -> tuple[list[dict], int, str | None, list[dict]]:
        """(rows, lines skipped, read error, the newest refused launches)."""
        path = runfiles.attempts_path(run_dir)
        sig = tuple(_stat(p) for p in (path, Path(f"{path}.1")))
        key = str(run_dir)
        with self._lock:
            hit = self._runs.get(key)
            if hit is not None and hit[0] == sig:
                self._runs.move_to_end(key)
                return hit[1:]
        try:
            records, skipped = attempts.read_lines(run_dir, with_refused=True)
            rows, error, refused = attempts.fold(records), None, attempts.refused(records)
        except OSError as e:
            rows, skipped, error, refused = [], 0, f"cannot read {path.name}: {safeio.why(e)}", []
        with self._lock:
            self._runs[key] = (sig, rows, skipped, error, refused)
            self._runs.move_to_end(key)
            while len(self._runs) > CACHED_RUNS:
                self._runs.popitem(last=False)
        return rows, skipped, error, refused


def _stat(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


_cache = _Cache()


def served_by(run_dir: str | os.PathLike, request_id: str | None) -> int | None:
    """The attempt that stopped gracefully for ``request_id``, by attempts.jsonl; None if none did."""
    if request_id is None:
        return None
    rows, _, _ = _cache.rows(Path(run_dir))
    return next(
        (
            r["attempt"]
            for r in reversed(rows)
            if r["end"] == "graceful_stop" and r["request_id"] == request_id
        ),
        None,
    )


def rows(run_dir: str | os.PathLike) -> list[dict]:
    """The folded rows as read from the file (shared: never change them); the same list while it is unchanged."""
    return _cache.rows(Path(run_dir))[0]


def launches(run_dir: str | os.PathLike) -> list[tuple[float, str]]:
    """(started_at, launch id) of each attempt, oldest first: which launch a history line's time fell in."""
    rows, _, _ = _cache.rows(Path(run_dir))
    return [(r["started_at"], r["launch"]) for r in rows]


def answer(
    run_dir: Path | None,
    heartbeats: Mapping[int, dict | None],
    job_over: str | None,
    from_logs: list[dict] | None = None,
) -> dict:
    """``/api/attempts``: every attempt, oldest first, the newest completed from the live heartbeats.

    ``heartbeats``: each rank's newest bridge heartbeat (``RunState.heartbeats``);
    ``job_over``: why the job is over, or None while it may run (``RunState.job_ended``);
    ``from_logs``: the attempts inferred from msrun's worker logs (``RunState.log_attempts``),
    the answer when the bridge wrote none (a script without it).
    """
    if run_dir is None:
        return {"attempts": [], "skipped_lines": 0, "error": None, "refused": []}
    rows, skipped, error, refused = _cache.read(run_dir)
    if not rows and from_logs:
        return {
            "attempts": _log_rows(from_logs, job_over),
            "skipped_lines": 0,
            "error": error,
            "refused": refused,
        }
    rows = copy.deepcopy(rows)
    for row in rows[:-1]:
        if row["end"] is None:
            # A later launch began without sealing it (its write failed): nothing more is known.
            row["end"] = "unknown"
    if rows and rows[-1]["end"] is None:
        last = rows[-1]
        mine = [hb for hb in heartbeats.values() if hb is not None and hb.get("launch") == last["launch"]]
        steps = [hb["global_step"] for hb in mine if hb.get("global_step") is not None]
        if steps:
            last["last_step"] = max(steps)
        hosts = sorted({hb["host"] for hb in mine if hb.get("host")})
        if len(hosts) > len(last["hosts"]):
            last["hosts"], last["host_count"] = hosts[: schema.MAX_ATTEMPT_HOSTS], len(hosts)
        if job_over:
            told = attempts.outcome(mine)
            last.update({k: v for k, v in told.items() if v is not None})
            last["stop_by"] = attempts.stop_by(last)
            last["inferred"] = f"no end line: judged from its ranks' heartbeats ({job_over})"
    for row in rows:
        resumed = row["resumed_from"]
        # The step in words; the set's id (…#g495) is a newcomer's puzzle: the page puts it in the
        # item's tooltip, from resumed_from (issue 33, section 6).
        row["resumed_text"] = (
            attempts.resumed_text(resumed["global_step"], None) if resumed else "a fresh start"
        )
    return {"attempts": rows, "skipped_lines": skipped, "error": error, "refused": refused}


def _log_rows(rows: list[dict], job_over: str | None) -> list[dict]:
    """Attempts read from the logs: the open one ended once the job is over, every one with its words."""
    for row in rows:
        if row["end"] is None and job_over:
            row["end"], row["inferred"] = "unknown", f"read from msrun's worker logs ({job_over})"
        row["resumed_text"] = "not known from the logs (the script has no Rankwatch bridge)"
    return rows


class LaunchWatch:
    """Which launch each rank's heartbeat names, to say loudly when two launches write at once.

    Two launches' ranks may sit side by side (rank 0 of one, rank 1 of the
    other), or take turns at the same file (both have a rank 0): a rank whose
    heartbeat goes back to a launch it named before is the second kind. Either
    is reported, and the warning stays ``STICKY_S`` after it was last seen, so
    a page that looks between two rewrites still shows it. ``observe`` costs
    one dict update per changed heartbeat; ``conflict`` looks at every rank
    only while more than one launch is shown.
    """

    STICKY_S = 60.0

    def __init__(self):
        self._now: dict[int, str] = {}  # rank -> the launch its newest heartbeat names
        self._before: dict[int, str] = {}  # rank -> the launch it named before that
        self._ranks: dict[str, set[int]] = {}
        self._flipped: tuple[float, int, str, str] | None = None  # (when, rank, launch, launch)
        self._said: tuple[float, str] | None = None

    def observe(self, rank: int, hb: Mapping | None, now: float) -> None:
        launch = hb.get("launch") if hb is not None else None
        old = self._now.get(rank)
        if launch == old:
            return
        if old is not None and launch is not None and self._before.get(rank) == launch:
            self._flipped = (now, rank, old, launch)
        if old is not None:
            self._ranks[old].discard(rank)
            if not self._ranks[old]:
                del self._ranks[old]
            self._before[rank] = old
        if launch is None:
            self._now.pop(rank, None)
            return
        self._now[rank] = launch
        self._ranks.setdefault(launch, set()).add(rank)

    def conflict(
        self, latest: Mapping[int, dict | None], ended: Mapping[int, object], now: float
    ) -> str | None:
        """The loud sentence while (or up to ``STICKY_S`` after) two launches wrote at once, else None."""
        sentence = None
        if len(self._ranks) > 1:
            sentence = _side_by_side(self._ranks, latest, ended)
        flipped = self._flipped
        if sentence is None and flipped is not None and now - flipped[0] <= self.STICKY_S:
            _, rank, a, b = flipped
            sentence = (
                f"TWO LAUNCHES ARE WRITING TO THIS RUN DIRECTORY: rank {rank}'s heartbeat went from launch "
                f"{a} to {b} and back, so two jobs take turns at the same files. Stop one of them; a bridge "
                "of this version refuses to start beside a live launch."
            )
        if sentence is not None:
            self._said = (now, sentence)
            return sentence
        if self._said is not None and now - self._said[0] <= self.STICKY_S:
            return f"{self._said[1]} (last seen {now - self._said[0]:.0f} s ago)"
        return None


def _side_by_side(
    ranks: Mapping[str, set[int]], latest: Mapping[int, dict | None], ended: Mapping[int, object]
) -> str | None:
    live: dict[str, list[dict]] = {}
    for launch, members in ranks.items():
        for rank in sorted(members):
            hb = latest.get(rank)
            if hb is None or rank in ended or hb.get("state") in attempts.TERMINAL:
                continue
            live.setdefault(launch, []).append(hb)
            if len(live[launch]) > NAMED:
                break
    if len(live) < 2:
        return None

    def named(beats: list[dict]) -> str:
        text = ", ".join(
            f"rank {hb['rank']} (pid {hb.get('pid')} on {hb.get('host')})" for hb in beats[:NAMED]
        )
        return text + (" and more" if len(beats) > NAMED else "")

    groups = sorted(live.items(), key=lambda kv: kv[1][0]["rank"])
    told = "; ".join(f"launch {launch}: {named(beats)}" for launch, beats in groups)
    return (
        f"TWO LAUNCHES ARE WRITING TO THIS RUN DIRECTORY ({len(groups)} launches): {told}. Their "
        "heartbeats overwrite each other, so the table mixes ranks of different jobs. Stop one of "
        "them; a bridge of this version refuses to start beside a live launch."
    )
