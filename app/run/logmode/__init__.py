"""Zero-instrumentation mode: ranks shown from msrun's worker logs, for scripts without the bridge.

A job launched with ``msrun --log_dir DIR`` writes each rank's output to
``DIR/worker_N.log``. The dashboard reads those files (``LOG_DIR``, by
default ``RUN/msrun_logs``) a few new bytes at a time and turns what they
say into the same heartbeats the bridge writes, so the same rows, verdicts
and charts follow, marked ``"source": "log"``. A rank whose bridge writes
heartbeats is shown from them instead: the bridge wins, rank by rank.

The package, from the bytes up:

* ``tailer``: reads only what a file appended, bounded, through rotation
  and truncation;
* ``patterns``: every line understood, as data, each with a real example;
* ``parser``: folds lines into facts (pure);
* ``writers``: finds the local process writing a log (its stdout);
* ``reader``: a directory of logs → one ``schema.Heartbeat`` per rank;
* ``LogView`` (here): what ``app.run.state.RunState`` holds: the log ranks'
  slots and the few facts only logs have (their pace, msrun's words about a
  process's end, OnRequestExit evidence for the stop panel).

What a log cannot tell, and a log rank's row therefore lacks: CPU and
memory of the process, the device, and the stages of a graceful stop.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.run.logmode.reader import LogDir

__all__ = ["LogView", "DEFAULT_DIR", "resolve_dir"]

DEFAULT_DIR = "msrun_logs"
# What a row read from a log cannot show, for the page and the API's readers.
CANNOT_SHOW = ("cpu_percent", "rss_bytes", "device", "stop_stage")


def resolve_dir(run_dir: str | os.PathLike | None, setting: str) -> Path | None:
    """The log directory: ``LOG_DIR`` (relative to the run directory), by default ``RUN/msrun_logs``."""
    if run_dir is None:
        return Path(setting) if setting and os.path.isabs(setting) else None
    return Path(run_dir) / (setting or DEFAULT_DIR)


class LogView:
    """The log ranks of one run, as ``RunState`` slots. Called under ``RunState``'s lock."""

    def __init__(self, path: str | os.PathLike, hostname: str, new_slot: Callable[[], Any]):
        self.dir = LogDir(path, hostname)
        self._new_slot = new_slot
        self.slots: dict[int, Any] = {}
        # When a log rank was first shown: the job's start when no writer's start is known.
        self.first_seen: float | None = None

    @property
    def path(self) -> Path:
        return self.dir.path

    def read(self, now: float) -> set[int]:
        """Fold what the logs appended into the slots; returns the ranks that changed."""
        changed = self.dir.poll(now)
        for rank in changed:
            lr = self.dir.ranks.get(rank)
            if lr is None or lr.heartbeat is None:
                self.slots.pop(rank, None)
                continue
            slot = self.slots.get(rank)
            if slot is None:
                slot = self.slots[rank] = self._new_slot()
                if self.first_seen is None:
                    self.first_seen = now
            slot.observe(lr.heartbeat, now)
        return changed

    @property
    def world_size(self) -> int:
        return self.dir.world_size if self.slots else 0

    def pace_ms(self, rank: int) -> float | None:
        """The median ms between the rank's step lines (``health.judge``'s ``log_pace_ms``)."""
        lr = self.dir.ranks.get(rank)
        return lr.pace_ms if lr is not None else None

    def gone(self, rank: int) -> str | None:
        """What msrun's logs say about the end of ``rank``'s process, if anything.

        ``RunState`` appends it to a probe's "process 4242 is gone", or, for a
        rank it cannot probe (no pid, another host), lets it stand alone once
        the rank's log is late: a log that still grows belongs to a live
        process, whatever an old line says.
        """
        return self.dir.gone(rank)

    def triggered_at(self, rank: int) -> float | None:
        """When ``rank``'s log showed OnRequestExit obeying the flag (see ``LogRank.triggered_at``)."""
        return self.dir.triggered_at(rank)

    def launcher_gone(self, probe) -> str | None:
        """Why msrun is known to be over, or None (see ``LogDir.launcher_gone``)."""
        return self.dir.launcher_gone(probe)

    def heartbeats_expected(
        self, job: dict | None, now: float, grace_s: float, alive: Callable[[dict], bool]
    ) -> bool:
        """Whether the bridge may still report, so that the log ranks' warnings would be premature.

        True while job.json (which only the bridge writes) names a rank 0
        that ``alive`` says still runs, or within ``grace_s`` of the job's
        start: the bridge writes its first heartbeat only once training
        starts, after minutes of graph compilation on a large model, and
        until then msrun's logs are all there is.
        """
        if job and alive(job):
            return True
        starts = [s.hb.get("started_at") for s in self.slots.values() if s.hb is not None]
        starts = [t for t in starts if isinstance(t, (int, float))]
        if job and isinstance(job.get("started_at"), (int, float)):
            starts.append(job["started_at"])
        start = min(starts) if starts else self.first_seen
        return start is not None and now - start < grace_s

    def stop_facts(self, bridge_ranks) -> dict | None:
        """For the stop panel: how many ranks only a log shows, and whether the script obeys the flag."""
        only = sorted(set(self.slots) - set(bridge_ranks))
        if not only:
            return None
        facts = {
            "ranks": len(only),
            "log_dir": str(self.dir.path),
            "on_request_exit": self.dir.on_request_exit(),
            "cannot_show": list(CANNOT_SHOW),
        }
        return facts | {"note": stop_note(facts)}

    def problems(self) -> list[str]:
        out = [self.dir.error] if self.dir.error else []
        return out + self.dir.problems + self.dir.read_errors()


def stop_note(facts: dict) -> str:
    """What the page's stop panel and ``rankwatch stop`` say about ranks shown only from their logs."""
    n = facts["ranks"]
    who = f"{n} rank{' is' if n == 1 else 's are'} shown only from msrun's worker logs"
    if facts["on_request_exit"]:
        return (
            f'{who}; their logs show OnRequestExit at work ("{facts["on_request_exit"]}"), so the script '
            "obeys the flag: Rankwatch follows its stop from the logs (the graceful-exit line, then the "
            "process's end), but cannot see its checkpoints' progress."
        )
    return (
        f"{who}, and nothing in them shows that the script uses OnRequestExit: it may ignore the flag. "
        "Stop gracefully still writes RUN/graceful_exit.json; if the job ends without obeying it, the "
        "stop is reported as not obeyed and the flag re-armed. For a script that is sure to stop, add "
        "the Rankwatch bridge (or OnRequestExit(config_file=RUN/graceful_exit.json) with "
        "MS_ENABLE_GRACEFUL_EXIT=1 on Ascend or in one process)."
    )
