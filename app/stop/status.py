"""Following a stop: each rank's stage, who holds the others up, the status the page and CLI show.

``StopView`` is the read side of ``StopService`` (``app/stop/service.py``,
which acts: request, cancel, re-arm, and completes a stop in ``tick``). It
reads the flag, the heartbeats and the audit trail and writes nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from app.attempts import served_by
from app.audit import MAX_TEXT, AuditError, AuditLog
from app.run.jobend import JobFacts, StopInputs, log_stage
from trainer_bridge.rundir import runfiles
from trainer_bridge.rundir.listing import first_of

# A rank's stages of a stop, in order.
STAGES = ("requested", "seen", "agreed", "saving", "saved", "exited")
# The outcome of a stop the job ended without obeying (audit rows and the re-armed flag say it).
NOT_OBEYED = "not obeyed"
# Once a rank has agreed, its stop step is fixed everywhere: too late to cancel.
COMMITTED = frozenset(STAGES[2:])
# A stop is called not obeyed on the run directory's word alone (no probe here proves the
# ranks' processes gone) only once its flag has said stop this long, and ten times the
# bridge's flag poll plus the job's agreement interval: a rank obeying it has long since
# shown it by then. Anything that writes the run directory can write "finished" (issue 32, P1).
CLAIMS_MIN_S = 60.0
FLAG_POLL_S = 1.0


class StopView:
    """The status of the stop in the flag, per rank and as a whole (``StopService``'s read side).

    What it reads of the run comes from ``view`` (a ``RunState``:
    ``stop_inputs()``), taken once per call, or as a caller hands it in.
    ``StopService`` holds one and asks it; it writes nothing.
    """

    def __init__(
        self, run_dir: str, audit: AuditLog, *, view=None, deadline_s: float, holding_after_s: float
    ):
        self.run_dir = run_dir
        self.audit = audit
        # has stop_inputs() -> StopInputs; None: no run to follow (every rank unknown)
        self.view = view
        self.deadline_s = deadline_s
        self.holding_after_s = holding_after_s
        # request id -> when this process first saw it pending (the flag's own time is a file's word)
        self._first_seen: dict[str, float] = {}

    def read_flag(self) -> tuple[dict | None, str | None]:
        """(the flag's JSON object or None, an error sentence if it is unreadable)."""
        try:
            flag = runfiles.read_flag(self.run_dir)
        except runfiles.FlagError as e:
            return None, str(e)
        except OSError as e:
            return None, f"cannot read {runfiles.FLAG_NAME}: {e.strerror or e}"
        return (flag.raw if flag else None), None

    # -------------------------------------------------------------- status
    def stages(
        self,
        rid: str | None,
        ranks: Mapping[int, dict | None],
        facts: JobFacts | None = None,
        requested_at: float | None = None,
    ) -> dict[int, dict]:
        """Each rank's stage for request ``rid``, from whatever its heartbeat's ``stop`` holds.

        The dashboard validates heartbeats before they get here, but the stop
        must not depend on that: every field is checked again for its type,
        and one that does not fit is dropped, never trusted. A rank shown from
        its worker log gets its stage from the log (``facts``). Each record's
        ``not_obeyed`` says why a rank that never exited for the stop has ended.
        """
        out = self._stages_of(rid, ranks)
        if facts is None:
            return out
        for rank, s in out.items():
            if rank in facts.triggered and not (ranks.get(rank) or {}).get("stop"):
                s.update(log_stage(rank, facts, requested_at))
            s["not_obeyed"] = facts.why_ended(rank) if s["stage"] != "exited" else None
        return out

    def _stages_of(self, rid: str | None, ranks: Mapping[int, dict | None]) -> dict[int, dict]:
        out = {}
        for rank, hb in ranks.items():
            hb = hb if isinstance(hb, dict) else {}
            stop = hb.get("stop")
            state = hb.get("state") if isinstance(hb.get("state"), str) else None
            if isinstance(stop, dict) and stop.get("request_id") == rid and stop.get("stage") in STAGES:
                at = stop.get("at")
                out[rank] = {
                    "stage": stop["stage"],
                    "seen_step": _count(stop.get("seen_step")),
                    "stop_step": _count(stop.get("stop_step")),
                    "checkpoint": _checkpoint(stop.get("checkpoint")),
                    "at": {k: t for k, t in at.items() if k in STAGES and _finite(t) is not None}
                    if isinstance(at, dict)
                    else {},
                    "error": stop.get("error") if isinstance(stop.get("error"), str) else None,
                    "state": state,
                    "not_obeyed": None,
                }
            else:
                out[rank] = {
                    "stage": "requested",
                    "seen_step": None,
                    "stop_step": None,
                    "checkpoint": None,
                    "at": {},
                    "error": None,
                    "state": state,
                    "not_obeyed": None,
                }
        return out

    def completed(
        self,
        rid: str | None,
        ranks: Mapping[int, dict | None],
        world_size: int,
        facts: JobFacts | None = None,
        requested_at: float | None = None,
    ) -> bool:
        stages = self.stages(rid, ranks, facts, requested_at)
        return (
            world_size > 0
            and len(stages) >= world_size
            and all(stages.get(r, {}).get("stage") == "exited" for r in range(world_size))
        )

    def _audit_last_id(self) -> int | None:
        """The newest audit row's id (a new row is news for every page); None if the trail is unusable."""
        try:
            return self.audit.last_id()
        except AuditError:
            return None

    def status(self, now: float, inputs: StopInputs | None = None) -> dict[str, Any]:
        """The body of ``GET /api/exit``, from the flag as it is now and the run as ``view`` shows it."""
        flag, flag_error = self.read_flag()
        return self.status_of(flag, flag_error, self.inputs(inputs), now)

    def inputs(self, given: StopInputs | None) -> StopInputs:
        """``given`` (a test's, or one tick's), else the run as ``view`` shows it now."""
        if given is not None:
            return given
        return self.view.stop_inputs() if self.view is not None else StopInputs({}, 0)

    def status_of(
        self, flag: dict | None, flag_error: str | None, inputs: StopInputs, now: float
    ) -> dict[str, Any]:
        """The status of the stop in ``flag`` (as read once by the caller).

        ``inputs.logs`` is ``RunState.log_stop_facts()``: the ranks shown only from
        msrun's worker logs, whose stop stages nobody reports, and whether
        their logs show that the script obeys the flag (OnRequestExit).
        ``inputs.facts`` is ``RunState.job_facts()``: the log ranks' stages and
        which ranks have ended (see ``app.run.jobend``).
        """
        ranks, world_size, logs, facts = inputs.ranks, inputs.world_size, inputs.logs, inputs.facts
        active = active_request(flag)
        last = (flag or {}).get("last_request")
        request = active if active else (request_facts(last) if isinstance(last, dict) else None)
        base = {
            "flag": _json_safe(flag),
            "flag_error": flag_error,
            "request": request,
            "state": "idle",
            "ranks": [],
            "stop_step": None,
            "summary": None,
            "holding_up": [],
            "late": [],
            "can_cancel": False,
            "can_rearm": active is not None,
            "save_s": None,
            "bytes": None,
            # Any heartbeat at all: a world size alone (job.json, or the worker logs) is no bridge.
            "bridge_seen": any(hb for hb in ranks.values()),
            "logs": logs,
            "deadline_s": self.deadline_s,
            # A new audit row (a second operator joining, a stop from a shell)
            # changes the status, so the watcher pushes it and pages reload the trail.
            "audit_last_id": self._audit_last_id(),
            # The stop an earlier launch of the job obeyed (or ignored), once the ranks were relaunched.
            "last_stop": None,
            # Why the job only looks ended, or why that is not believed (issue 32, P1).
            "warning": None,
        }
        if request is None:
            return base
        if relaunched_since(ranks, request["requested_at"]):
            # Every rank reporting now is a process started after the request: a later launch,
            # which that stop is not about, once the flag is cleared or an earlier attempt
            # stopped for it (attempts.jsonl; the bridge leaves a served flag alone).
            earlier = served_by(self.run_dir, request["request_id"])
            if active is None or earlier is not None:
                outcome = _outcome(flag) if active is None else "completed"
                base.update(request=None, last_stop={**request, "outcome": outcome, "attempt": earlier})
                return base
        rid = request["request_id"]
        stages = self.stages(rid, ranks, facts, request["requested_at"])
        requested_at = request["requested_at"] or now
        verdict = self.job_over(rid if active else None, ranks, world_size, facts, now)
        rows = []
        for rank in sorted(stages):
            s = stages[rank]
            entered = max([requested_at, *[t for t in s["at"].values() if isinstance(t, (int, float))]])
            late = s["stage"] != "exited" and active is not None and now - entered > self.deadline_s
            rows.append({"rank": rank, **s, "late": late, "stage_since": entered})
        order = {name: i for i, name in enumerate(STAGES)}
        lowest = min((order[r["stage"]] for r in rows), default=0)
        all_exited = bool(rows) and all(r["stage"] == "exited" for r in rows) and len(rows) >= world_size
        ignored = not all_exited and (
            (active is not None and verdict is not None)
            or (active is None and (flag or {}).get("outcome") == NOT_OBEYED)
        )
        warning = None if all_exited else self._end_warning(active, verdict, ranks, world_size, facts)
        stop_steps = sorted({r["stop_step"] for r in rows if r["stop_step"] is not None})
        saves = [r["checkpoint"] for r in rows if r["checkpoint"]]
        total_bytes = sum(c.get("bytes") or 0 for c in saves)
        save_s = max((c.get("seconds") or 0 for c in saves), default=None)
        if ignored:
            state = "not_obeyed"
        elif active is None:
            state = "cancelled" if flag and flag.get("cancelled") == rid else "rearmed"
        elif all_exited:
            state = "completed"
        elif lowest == 0 and not any(order[r["stage"]] > 0 for r in rows):
            state = "requested"
        else:
            state = "stopping"
        summary = None
        if all_exited:
            ended = max(r["at"].get("exited", requested_at) for r in rows)
            summary = (
                f"all {len(rows)} ranks stopped after step {_steps_text(stop_steps)}, "
                f"{len(saves)} checkpoints, {_gb(total_bytes)}, in {ended - requested_at:.1f} s"
            )
        elif ignored:
            missed = [r for r in rows if r["stage"] != "exited"]
            why = next((r["not_obeyed"] for r in missed if r["not_obeyed"]), None)
            summary = (
                f"not obeyed: the job ended without stopping for it; rank{'s' if len(missed) > 1 else ''} "
                f"{ranks_text([r['rank'] for r in missed])} ended without exiting for the stop"
                + (f" ({why})" if why else "")
                + (
                    "; by the run directory's word only: no probe here proves their processes gone, "
                    "so the flag still says stop (re-arm it yourself)"
                    if verdict == "claims"
                    else ""
                )
            )
        base.update(
            state=state,
            ranks=rows,
            stop_step=stop_steps[0] if len(stop_steps) == 1 else stop_steps or None,
            summary=summary,
            save_s=save_s,
            bytes=total_bytes or None,
            holding_up=[]
            if all_exited or ignored or active is None
            else _holding_up(rows, order, lowest, now, self.holding_after_s),
            late=[r["rank"] for r in rows if r["late"]],
            warning=warning,
            can_cancel=active is not None and not ignored and not any(r["stage"] in COMMITTED for r in rows),
        )
        return base

    def job_over(
        self,
        rid: str | None,
        ranks: Mapping[int, dict | None],
        world_size: int,
        facts: JobFacts | None,
        now: float,
    ) -> str | None:
        """Whether the pending stop ``rid`` can no longer be obeyed: ``proven`` (every rank's
        process gone by a probe here), ``claims`` (the files say so, the flag has said stop
        past ``claims_min_s``, and no probe finds a rank running), else None."""
        if rid is None or facts is None:
            return None
        first = self._first_seen.get(rid)
        if first is None:
            # Only the request being followed is remembered: a bounded map whatever the flag says.
            self._first_seen = {rid: now}
            first = now
        if facts.proven_ended(world_size):
            return "proven"
        if facts.looks_ended(world_size) and now - first >= self.claims_min_s(ranks):
            return "claims"
        return None

    def claims_min_s(self, ranks: Mapping[int, dict | None]) -> float:
        """How long a flag says stop before the files' word alone can end it (``CLAIMS_MIN_S``)."""
        return max(CLAIMS_MIN_S, 10 * (FLAG_POLL_S + _agreement_s(ranks)))

    def _end_warning(
        self, active: dict | None, verdict: str | None, ranks, world_size: int, facts: JobFacts | None
    ) -> str | None:
        if active is None or facts is None or verdict == "proven":
            return None
        if facts.running and facts.job_ended(world_size):
            return (
                f"rank(s) {ranks_text(sorted(facts.running))} say they have ended, but their process "
                "still runs on this host: the stop stays pending (a second writer may forge their files)"
            )
        if verdict is None and facts.looks_ended(world_size):
            return (
                "the job looks ended by its files alone (no probe here proves its processes gone): "
                f"the stop stays pending; it is called not obeyed after {self.claims_min_s(ranks):.0f} s, "
                "and only you re-arm it"
            )
        return None

    def estimate(self, inputs: StopInputs | None = None) -> dict[str, Any]:
        """What the dialog shows before confirming: ranks, time to stop, where checkpoints go."""
        inputs = self.inputs(inputs)
        ranks, world_size = inputs.ranks, inputs.world_size
        sync_s = _agreement_s(ranks)
        save_s = self._last_save_s()
        seconds = None if not any(ranks.values()) else round(1.0 + sync_s + (save_s or 0.0), 1)
        return {
            "ranks": world_size,
            "seconds": seconds,
            "save_s": save_s,
            "save_measured": save_s is not None,
            # Without the bridge, a script's OnRequestExit saves where its own arguments say.
            "checkpoint_dir": f"{runfiles.CHECKPOINT_DIR}/rank_{{r}}/"
            if any(ranks.values())
            else "OnRequestExit's directory: rank_{r}/<file_name>_train.ckpt under the script's "
            "directory= argument",
            "basis": (
                "flag poll (<= 1 s) + steps until the next agreement "
                f"({sync_s:.2f} s) + save time "
                + (
                    f"({save_s:.2f} s, measured at the last stop)"
                    if save_s is not None
                    else "(not measured yet: this is the job's first stop)"
                )
            ),
        }

    def _last_save_s(self) -> float | None:
        """The save time measured at the last completed stop, from the audit trail, if it says."""
        try:
            last = next((r for r in self.audit.rows(limit=50) if r["action"] == "complete"), None)
            detail = json.loads(last["detail"]) if last and last["detail"] else None
        except (AuditError, ValueError, TypeError, RecursionError):
            return None
        return _finite(detail.get("save_s")) if isinstance(detail, dict) else None


def _agreement_s(ranks: Mapping[int, dict | None]) -> float:
    """The slowest rank's agreement interval (``sync_every`` steps), in seconds, from its heartbeat."""
    steps_ms = [
        (_finite(hb.get("step_time_mean_ms")) or _finite(hb.get("step_time_ms")) or 0)
        * (_count(hb.get("sync_every")) or 1)
        for hb in ranks.values()
        if isinstance(hb, dict)
    ]
    return max(steps_ms, default=0) / 1000.0


def _holding_up(
    rows: list[dict], order: dict[str, int], lowest: int, now: float, after_s: float
) -> list[int]:
    """The ranks at the lowest stage that keep the others waiting: named only once
    they have been in it ``after_s``, and never when every rank is there (then
    nobody is behind: the stop is simply in progress, or ignored by all)."""
    behind = [r for r in rows if order[r["stage"]] == lowest]
    if len(behind) == len(rows):
        return []
    return [r["rank"] for r in behind if now - r["stage_since"] >= after_s]


def relaunched_since(ranks: Mapping[int, dict | None], requested_at: float | None) -> bool:
    """Every rank that reports is a process started after ``requested_at`` (and one reports)."""
    starts = [_finite(hb.get("started_at")) for hb in ranks.values() if isinstance(hb, dict)]
    return (
        requested_at is not None
        and bool(starts)
        and all(start is not None and start > requested_at for start in starts)
    )


def _outcome(flag: dict | None) -> str:
    """How the request a re-armed flag remembers ended: completed, cancelled or not obeyed."""
    flag = flag or {}
    last = flag.get("last_request")
    if (
        isinstance(last, dict)
        and flag.get("cancelled") is not None
        and flag.get("cancelled") == last.get("request_id")
    ):
        return "cancelled"
    return NOT_OBEYED if flag.get("outcome") == NOT_OBEYED else "completed"


def active_request(flag: dict | None) -> dict | None:
    """The pending request in the flag as checked facts, or None if the flag does not say stop.

    Only ``request_facts`` of the flag is ever used: its other keys are
    whatever the last writer left, and any rank can be that writer.
    """
    if flag and runfiles.flag_from_obj(flag).exit:
        return request_facts(flag)
    return None


def request_facts(flag: dict) -> dict:
    """A request's facts from a flag (or its ``last_request``), each of its type or None."""
    by, reason = flag.get("requested_by"), flag.get("reason")
    return {
        "request_id": runfiles.flag_from_obj(flag).request_id,
        "requested_at": _finite(flag.get("requested_at")),
        "requested_by": by[:MAX_TEXT] if isinstance(by, str) else None,
        "reason": reason[:MAX_TEXT] if isinstance(reason, str) else None,
    }


def _finite(value) -> float | None:
    """A number that is one (not a bool, not NaN or infinite, not a 400-digit int), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53 else None


def _checkpoint(value) -> dict | None:
    if not isinstance(value, dict):
        return None
    path = value.get("path")
    return {
        "path": path if isinstance(path, str) else None,
        "bytes": _count(value.get("bytes")),
        "seconds": _finite(value.get("seconds")),
    }


def _json_safe(value, depth: int = 0):
    """The flag as the API sends it: non-finite numbers as text (JSON has none), and
    nothing nested past what a flag needs."""
    if depth > 20:
        return "..."
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v, depth + 1) for v in value]
    return value


def ranks_text(ranks: list[int]) -> str:
    return first_of(ranks, 10)


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "?"
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}..{steps[-1]} (ranks disagree!)"


def _gb(n: int) -> str:
    """Binary units, as everywhere on the page (KiB, MiB, GiB)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"
