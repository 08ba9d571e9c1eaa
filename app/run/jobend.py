"""What the run says about the job's processes beyond the bridge's stop stages.

The stop service follows a stop through each rank's heartbeat (``stop.stage``).
Two kinds of job give it nothing there:

* a script without the bridge, shown from msrun's worker logs: its stop is
  ``OnRequestExit``'s, whose only trace is the line "Graceful exit is
  triggered" and then the process's end;
* any job whose ranks ended without obeying the stop (the script ignores
  the flag, trained to its end, or died).

``JobFacts`` is what ``app.run.state.RunState.job_facts`` hands the stop service
for both: when each log rank obeyed, which ranks have ended and why, and
whether msrun is still there. ``log_stage`` turns a log rank's facts into the
same stage record a bridge heartbeat gives, so one completion rule serves
both; ``JobFacts.job_ended`` says when a stop can no longer be obeyed, and
``proven_ended`` whether a probe backs that, beyond the files (issue 32, P1).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# A log line's time is the file's mtime when it was read, on the same clock as the
# request's; allow for a filesystem's coarse timestamps.
CLOCK_SLACK_S = 1.0


@dataclass(frozen=True)
class JobFacts:
    # rank → (when the dashboard first saw it ended, why: its final state or a probe's words)
    ended: Mapping[int, tuple[float, str]] = field(default_factory=dict)
    # Why msrun is known to be over (its words, or its process gone), else None.
    launcher_gone: str | None = None
    # msrun's process was found and still runs.
    launcher_alive: bool = False
    # Ranks shown from their worker logs → when the log showed OnRequestExit obeying the flag.
    triggered: Mapping[int, float | None] = field(default_factory=dict)
    # Ranks whose end a probe on this host proves: every process that reported for them is gone
    # (app.run.endproof). The others' end is the run directory's word only.
    proven: frozenset[int] = frozenset()
    # Ranks said to have ended while a probe on this host finds their process running.
    running: frozenset[int] = frozenset()

    @property
    def from_log(self) -> frozenset[int]:
        return frozenset(self.triggered)

    def job_ended(self, world: int) -> bool:
        """Every rank has ended and msrun is not known to run: nothing is left to obey a stop."""
        return world > 0 and not self.launcher_alive and all(r in self.ended for r in range(world))

    def proven_ended(self, world: int) -> bool:
        """``job_ended``, and every rank's end is proven by a probe (not only by what its files say)."""
        return self.job_ended(world) and all(r in self.proven for r in range(world))

    def looks_ended(self, world: int) -> bool:
        """``job_ended`` by the run directory's word, with no probe contradicting it."""
        return self.job_ended(world) and not self.running

    def why_ended(self, rank: int) -> str | None:
        end = self.ended.get(rank)
        return end[1] if end else None


@dataclass(frozen=True)
class StopInputs:
    """What following a stop reads of the run, taken together (``RunState.stop_inputs``).

    ``ranks``: each rank's newest bridge heartbeat (None: a rank shown from its
    worker log, or silent); ``world_size``; ``logs``: what the stop panel says
    of the ranks shown only from their logs (``RunState.log_stop_facts``);
    ``facts``: which ranks have ended and why, whether msrun is still there
    (``JobFacts``).
    """

    ranks: Mapping[int, dict | None]
    world_size: int
    logs: dict | None = None
    facts: JobFacts | None = None


def log_stage(rank: int, facts: JobFacts, requested_at: float | None) -> dict:
    """A log rank's stop record, in the shape the bridge's heartbeat gives.

    ``saving`` from the graceful-exit line (``OnRequestExit`` saves right
    after it), ``exited`` once the process has ended too. A line older than
    the request belongs to an earlier stop.
    """
    at = facts.triggered.get(rank)
    obeyed = at is not None and (requested_at is None or at >= requested_at - CLOCK_SLACK_S)
    end = facts.ended.get(rank)
    if obeyed and end is not None:
        stage, times = "exited", {"saving": at, "exited": max(at, end[0])}
    elif obeyed:
        stage, times = "saving", {"saving": at}
    else:
        stage, times = "requested", {}
    return {"stage": stage, "at": times}
