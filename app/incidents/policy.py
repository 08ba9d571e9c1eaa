"""The automatic stop policy: rules declared as data, acted on by the watcher (off by default).

``POLICY_RULES`` lists the rules as ``kind:seconds``, comma-separated
(``device_unhealthy:60,node_lost:30``); ``POLICY_MODE`` says what a rule
that fires does: ``off`` (nothing is evaluated), ``dry_run`` (an audit row
and an alert saying what it would have done) or ``on`` (the same graceful
stop as the button, ``who = "policy"``, the rule and its evidence as the
reason, audited and alerted). The kinds (``RULES``):

* ``device_unhealthy:N``: a rank's device has reported a health other than
  ``OK`` (``npu-smi``) for N seconds;
* ``straggler:N``: a rank has been a straggler for N seconds;
* ``stalled:N``: a rank has been stalled for N seconds;
* ``node_lost:N``: a host's ranks have been ``node_lost`` (every rank of
  the host silent together while others report) for N seconds.

Limits. Each rule fires at most once per job run (the run is job.json's
``started_at``; the audit trail remembers what fired, so a restarted
dashboard does not fire again), and once the policy has requested a stop no
other rule fires for that run. A human's cancel works on the policy's stop
as on any other, and the policy does not ask again.

A rank that cannot answer. A graceful stop completes only when every rank
saves and exits, and ranks agree on the stop step through a collective, so
one dead, lost or hung rank holds up all of them. When a rule fires while
ranks are in that state, the policy still writes the flag (if they recover,
the job stops at once), and its audit row and alert name those ranks and
say that the stop cannot complete until they answer. If the stop has still
not completed after ``STOP_DEADLINE_S``, it alerts once more. It never
retries, never kills a process, and never loops.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from app.audit import POLICY, AuditLog
from app.errors import RankwatchError
from app.incidents.alerts import AlertDesk, ranks_text
from app.stop.service import StopService

WHO = "policy"
MODES = ("off", "dry_run", "on")
# What the device rule says on a job whose ranks report no device (the CPU demo): a rule about
# npu-smi there only puzzled a newcomer (issue 33, section 6).
NO_DEVICE = "no rank here reports an NPU (a CPU job), so this rule cannot fire"
RULES = {
    "device_unhealthy": "a rank's Ascend NPU reports a health other than OK (npu-smi) for N s",
    "straggler": "a rank is a straggler for N s",
    "stalled": "a rank is stalled for N s",
    "node_lost": "a host's ranks are node_lost (all silent together while other hosts report) for N s",
}
# Verdicts of ranks that cannot take part in a graceful stop.
CANNOT_ANSWER = ("stalled", "dead", "node_lost", "agent_lost", "pending", "corrupt")
MAX_REASON = 500  # the stop API's limit on a reason (app.audit.MAX_TEXT)


@dataclass(frozen=True)
class Rule:
    kind: str
    for_s: float

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.for_s:g}"

    def holds(self, row: Mapping) -> bool:
        """Whether rank ``row`` is in this rule's condition right now."""
        if self.kind == "device_unhealthy":
            health = row.get("device_health")
            return health is not None and health != "OK"
        return row.get("health") == self.kind


def parse_rules(text: str) -> list[Rule]:
    """``"device_unhealthy:60, stalled:300"`` as rules; ValueError naming the setting otherwise."""
    rules, seen = [], set()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        kind, sep, seconds = item.partition(":")
        kind = kind.strip()
        if kind not in RULES:
            raise ValueError(
                f"setting POLICY_RULES (RANKWATCH_POLICY_RULES): unknown rule {kind!r} in {item!r}; "
                f"the kinds are {', '.join(RULES)}"
            )
        try:
            for_s = float(seconds) if sep else math.nan
        except ValueError:
            for_s = math.nan
        if not (for_s >= 0 and math.isfinite(for_s)):
            raise ValueError(
                f"setting POLICY_RULES (RANKWATCH_POLICY_RULES): {item!r} must be kind:seconds, "
                f"e.g. {kind}:60"
            )
        if kind in seen:
            raise ValueError(f"setting POLICY_RULES (RANKWATCH_POLICY_RULES): {kind} is declared twice")
        seen.add(kind)
        rules.append(Rule(kind, for_s))
    return rules


def parse_mode(text: str) -> str:
    mode = text.strip().lower().replace("-", "_")
    if mode not in MODES:
        raise ValueError(
            f"setting POLICY_MODE (RANKWATCH_POLICY_MODE) must be one of {', '.join(MODES)}, not {text!r}"
        )
    return mode


def _ago(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


class Policy:
    """Evaluates the rules against the rows the watcher keeps, and acts. Used from the watcher only."""

    def __init__(
        self,
        rules: list[Rule],
        mode: str,
        stop: StopService,
        audit: AuditLog,
        alerts: AlertDesk,
        *,
        deadline_s: float,
        clock: Callable[[], float] = time.time,
    ):
        self.rules = rules
        self.mode = mode
        self.stop = stop
        self.audit = audit
        self.alerts = alerts
        self.deadline_s = deadline_s
        self.clock = clock
        # rule kind -> {rank: when its condition began}
        self._since: dict[str, dict[int, float]] = {r.kind: {} for r in rules}
        # Ranks whose row names a device: the device rule applies to them only.
        self._with_device: set[int] = set()
        self._job: object = None
        # rule name -> {"at", "rank", "evidence", "mode", "outcome", "request_id"} for this job run
        self.fired: dict[str, dict] = {}
        self._watch: dict | None = None  # the policy's own stop, followed until it completes
        self.version = 0
        # The watcher changes the state; GET /api/policy reads it from another thread.
        self._lock = threading.RLock()

    @property
    def armed(self) -> bool:
        return self.mode != "off" and bool(self.rules)

    # ------------------------------------------------------------------ input
    def observe(self, rank: int, row: Mapping | None, now: float) -> None:
        """Rank ``rank``'s row changed (None: it left the job); start or end its conditions."""
        with self._lock:
            had = bool(self._with_device)
            if row is not None and row.get("device"):
                self._with_device.add(rank)
            else:
                self._with_device.discard(rank)
            if had != bool(self._with_device):
                self.version += 1
            for rule in self.rules:
                since = self._since[rule.kind]
                if row is not None and rule.holds(row):
                    if rank not in since:
                        since[rank] = now
                        self.version += 1
                elif since.pop(rank, None) is not None:
                    self.version += 1

    def new_job(self, job_key: object) -> None:
        """A new job run: forget what fired, except what the audit trail says fired for it."""
        with self._lock:
            if job_key == self._job:
                return
            if self._job is None and job_key is not None:
                # job.json appeared after the ranks' first heartbeats (rank 0,
                # which writes it, started last): the same run, so what fired
                # before stays fired, now under the run's name.
                self.fired = {name: {**f, "job": job_key} for name, f in self.fired.items()}
            else:
                self.fired, self._watch = {}, None
            self._job = job_key
            if job_key is None:
                return
            for row in self.audit.rows(limit=1000):
                if row["action"] != "policy" or not row["detail"]:
                    continue
                detail = json.loads(row["detail"])
                # A dry run's firing does not disarm the rule for a dashboard now set to act.
                if detail.get("job") == job_key and detail.get("rule") and detail.get("mode") == self.mode:
                    self.fired.setdefault(
                        detail["rule"], {**detail, "at": row["at"], "outcome": row["outcome"]}
                    )
            self.version += 1

    # ------------------------------------------------------------------ evaluation
    def tick(self, now: float, rows: Mapping[int, Mapping], stop_status: Mapping | None) -> bool:
        """Fire what is due and follow the policy's stop; True when the status changed."""
        with self._lock:
            if not self.armed:
                return False
            changed = self._follow(now, stop_status)
            if any(f.get("mode") == "on" for f in self.fired.values()):
                return changed  # the job is stopping: no other rule has anything to add
            for rule in self.rules:
                if rule.name in self.fired or not self._since[rule.kind]:
                    continue
                rank, began = min(self._since[rule.kind].items(), key=lambda kv: kv[1])
                if now - began >= rule.for_s:
                    self._fire(rule, rank, now - began, rows, now)
                    changed = True
                    if self.mode == "on":
                        break
            return changed

    def _evidence(self, rule: Rule, rank: int, held_s: float, row: Mapping) -> str:
        host = f" on {row['host']}" if row.get("host") else ""
        if rule.kind == "device_unhealthy":
            return (
                f"rank {rank}{host}: device {row.get('device') or '?'} reports health "
                f"{row.get('device_health')} for {_ago(held_s)}"
            )
        return f"rank {rank}{host} {rule.kind} for {_ago(held_s)}: {row.get('reason') or 'no reason given'}"

    def _fire(self, rule: Rule, rank: int, held_s: float, rows: Mapping[int, Mapping], now: float) -> None:
        evidence = self._evidence(rule, rank, held_s, rows.get(rank) or {})
        reason = f"policy {rule.name}: {evidence}"
        if len(reason) > MAX_REASON:
            reason = reason[: MAX_REASON - 3] + "..."
        stuck = sorted(r for r, row in rows.items() if row.get("health") in CANNOT_ANSWER)
        stuck_note = ""
        if stuck:
            kinds = sorted({rows[r]["health"] for r in stuck})
            stuck_note = (
                f"; rank{'s' if len(stuck) > 1 else ''} {ranks_text(stuck, 8)} cannot answer "
                f"({', '.join(kinds)}), so a graceful stop cannot complete until "
                f"{'they do' if len(stuck) > 1 else 'it does'}; the policy will not retry"
            )
        record = {"job": self._job, "rule": rule.name, "rank": rank, "evidence": evidence, "mode": self.mode}
        request_id = None
        if self.mode == "dry_run":
            outcome = "dry run: would have requested a graceful stop" + stuck_note
            event, text = "policy_dry_run", f"policy (dry run) would stop the job: {reason}{stuck_note}"
        else:
            try:
                request_id, created, _, _ = self.stop.request(reason, WHO, None, basis=POLICY)
            except RankwatchError as e:
                outcome = f"failed: {e.message}; the policy will not retry"
                event, text = "policy_failed", f"policy could not stop the job: {e.message} ({reason})"
            else:
                how = "requested a graceful stop" if created else "joined the pending stop"
                outcome = f"{how} {request_id}{stuck_note}"
                event = "policy_stop"
                text = f"policy {how} ({request_id}): {reason}{stuck_note}"
                self._watch = {"request_id": request_id, "at": now, "alerted": False}
        record.update(request_id=request_id, stuck=stuck)
        self.audit.record(
            "policy",
            who=WHO,
            reason=reason,
            request_id=request_id,
            outcome=outcome,
            detail=record,
            basis=POLICY,
        )
        self.fired[rule.name] = {**record, "at": now, "outcome": outcome}
        self.alerts.once(
            f"policy:{self._job}:{rule.name}:{self.mode}",
            event,
            text,
            rule=rule.name,
            rank=rank,
            evidence=evidence,
            mode=self.mode,
            request_id=request_id,
            cannot_answer=stuck,
        )
        self.version += 1

    def _follow(self, now: float, stop_status: Mapping | None) -> bool:
        """One more alert if the policy's stop is still incomplete after ``deadline_s``; never more."""
        watch = self._watch
        if watch is None or watch["alerted"] or stop_status is None:
            return False
        request = stop_status.get("request") or {}
        if request.get("request_id") != watch["request_id"] or stop_status.get("summary"):
            self._watch = None  # completed, cancelled or replaced: nothing left to follow
            return False
        if now - watch["at"] < self.deadline_s:
            return False
        watch["alerted"] = True
        holding = stop_status.get("holding_up") or []
        text = (
            f"the stop the policy requested ({watch['request_id']}) has not completed after "
            f"{_ago(now - watch['at'])}: rank{'s' if len(holding) != 1 else ''} "
            f"{ranks_text(holding, 8) or '?'} hold it up; the policy will not retry"
        )
        self.audit.record(
            "policy",
            who=WHO,
            request_id=watch["request_id"],
            outcome=f"incomplete: {text}",
            detail={"job": self._job, "holding_up": holding},
        )
        self.alerts.once(
            f"policy-late:{watch['request_id']}",
            "policy_stop_incomplete",
            text,
            request_id=watch["request_id"],
            holding_up=holding,
        )
        self.version += 1
        return True

    # ------------------------------------------------------------------ the page
    def status(self, now: float) -> dict:
        """``GET /api/policy``: the mode, each rule and whether it is armed, holding or fired."""
        with self._lock:
            rules = []
            for rule in self.rules:
                since = self._since.get(rule.kind) or {}
                holding = None
                if since:
                    rank, began = min(since.items(), key=lambda kv: kv[1])
                    holding = {
                        "rank": rank,
                        "since": began,
                        "for_s": round(now - began, 1),
                        "ranks": len(since),
                    }
                fired = self.fired.get(rule.name)
                rules.append(
                    {
                        "rule": rule.name,
                        "kind": rule.kind,
                        "for_s": rule.for_s,
                        "help": RULES[rule.kind]
                        + (
                            f"; {NO_DEVICE}"
                            if rule.kind == "device_unhealthy" and not self._with_device
                            else ""
                        ),
                        "state": "fired" if fired else ("armed" if self.armed else "off"),
                        "holding": holding,
                        "fired": fired,
                    }
                )
            return {"mode": self.mode, "armed": self.armed, "job": self._job, "rules": rules}
