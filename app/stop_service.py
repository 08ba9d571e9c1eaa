"""The stop request's life: write the flag, follow every rank, cancel, re-arm, audit.

The flag file is the request's only record the trainers see, so the service
keeps the request's facts in it too (``request_id``, ``requested_at``,
``requested_by``, ``reason``); after a cancel or re-arm the file says
``{"GracefulExit": 0, ...}`` and keeps the served request under
``last_request``. A restarted dashboard therefore rebuilds the whole story
from the flag and the heartbeats.

Stages per rank, in order: ``requested`` (flag written, rank has not seen it)
→ ``seen`` → ``agreed`` (stop step fixed) → ``saving`` → ``saved`` →
``exited``. A rank that stays in one stage longer than ``STOP_DEADLINE_S``
is flagged late; the ranks at the lowest stage are the ones holding the
others up.
"""
from __future__ import annotations

import fcntl
import json
import threading
import time
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any

from trainer_bridge import runfiles

from app.audit import AuditLog
from app.errors import ApiError

STAGES = ("requested", "seen", "agreed", "saving", "saved", "exited")
# Once a rank has agreed, its stop step is fixed everywhere: too late to cancel.
COMMITTED = frozenset(STAGES[2:])
SYSTEM = "rankwatch"


class StopService:
    def __init__(self, run_dir: str, audit: AuditLog, *, deadline_s: float, auto_rearm: bool):
        self.run_dir = run_dir
        self.audit = audit
        self.deadline_s = deadline_s
        self.auto_rearm = auto_rearm
        self._lock = threading.Lock()

    # ------------------------------------------------------------ the flag
    @contextmanager
    def _flag_lock(self):
        """Serialise read-modify-write of the flag across threads and processes."""
        with self._lock:
            lock_path = runfiles.state_dir(self.run_dir) / ".flag.lock"
            lock_path.parent.mkdir(parents=True, exist_ok=True)
            with open(lock_path, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)

    def read_flag(self) -> tuple[dict | None, str | None]:
        """(the flag's JSON object or None, an error sentence if it is unreadable)."""
        try:
            flag = runfiles.read_flag(self.run_dir)
        except runfiles.FlagError as e:
            return None, str(e)
        except OSError as e:
            return None, f"cannot read {runfiles.FLAG_NAME}: {e.strerror or e}"
        return (flag.raw if flag else None), None

    @staticmethod
    def _active(flag: dict | None) -> dict | None:
        """The pending request in the flag, or None if the flag does not say stop."""
        if flag and runfiles.flag_from_obj(flag).exit:
            return flag
        return None

    # ------------------------------------------------------------- actions
    def request(self, reason: str, who: str, remote_addr: str | None) -> tuple[str, bool]:
        """Ask every rank to stop. Returns (request id, created); a second press joins the first."""
        with self._flag_lock():
            flag, _ = self.read_flag()
            active = self._active(flag)
            if active is not None:
                rid = active.get("request_id") or "native-flag"
                self.audit.record("request", who=who, remote_addr=remote_addr, reason=reason,
                                  request_id=rid, outcome=f"duplicate: joined request {rid}")
                return rid, False
            rid = runfiles.new_request_id()
            try:
                runfiles.write_flag(self.run_dir, True, request_id=rid, requested_at=time.time(),
                                    requested_by=who, reason=reason)
            except OSError as e:
                self.audit.record("request", who=who, remote_addr=remote_addr, reason=reason,
                                  request_id=rid, outcome=f"failed: {e.strerror or e}")
                raise ApiError(507, f"could not write the stop flag: {e.strerror or e}") from None
            self.audit.record("request", who=who, remote_addr=remote_addr, reason=reason,
                              request_id=rid, outcome="accepted")
            return rid, True

    def _pending_or_refuse(self, action: str, who: str, remote_addr: str | None,
                           reason: str | None, refusal: str) -> dict:
        """The pending request in the flag; if there is none, audit the refusal and answer 409."""
        active = self._active(self.read_flag()[0])
        if active is None:
            self.audit.record(action, who=who, remote_addr=remote_addr, reason=reason,
                              outcome=f"refused: {refusal}")
            raise ApiError(409, refusal)
        return active

    def cancel(self, ranks: Mapping[int, dict | None], who: str, remote_addr: str | None,
               reason: str | None) -> str:
        with self._flag_lock():
            active = self._pending_or_refuse("cancel", who, remote_addr, reason,
                                             "no stop request is pending")
            rid = active.get("request_id")
            committed = sorted(r for r, s in self._stages(rid, ranks).items() if s["stage"] in COMMITTED)
            if committed:
                self.audit.record("cancel", who=who, remote_addr=remote_addr, reason=reason,
                                  request_id=rid, outcome=f"refused: ranks {committed} already agreed")
                raise ApiError(409, f"too late to cancel: rank(s) {_ranks_text(committed)} already "
                                    "agreed on the stop step")
            runfiles.write_flag(self.run_dir, False, cancelled=rid, cancelled_at=time.time(),
                                cancelled_by=who, last_request=_request_facts(active))
            self.audit.record("cancel", who=who, remote_addr=remote_addr, reason=reason,
                              request_id=rid, outcome="accepted")
            return rid

    def rearm(self, ranks: Mapping[int, dict | None], world_size: int, who: str,
              remote_addr: str | None, reason: str | None, force: bool = False) -> str:
        """Return the flag to ``{"GracefulExit": 0}`` after a stop, so a relaunch runs."""
        with self._flag_lock():
            active = self._pending_or_refuse("rearm", who, remote_addr, reason,
                                             "nothing to re-arm: the flag does not say stop")
            rid = active.get("request_id")
            done = self._completed(rid, ranks, world_size)
            if not done and not force:
                self.audit.record("rearm", who=who, remote_addr=remote_addr, reason=reason,
                                  request_id=rid, outcome="refused: the stop has not completed")
                raise ApiError(409, "the stop has not completed on every rank; re-arming now lets "
                                    "ranks that have not stopped run on (send force: true to do it anyway)")
            self._write_rearmed(active, who)
            self.audit.record("rearm", who=who, remote_addr=remote_addr, reason=reason, request_id=rid,
                              outcome="accepted" if done else "accepted (forced before completion)")
            return rid

    def _write_rearmed(self, active: dict, who: str) -> None:
        runfiles.write_flag(self.run_dir, False, rearmed_after=active.get("request_id"),
                            rearmed_at=time.time(), rearmed_by=who, last_request=_request_facts(active))

    def tick(self, ranks: Mapping[int, dict | None], world_size: int) -> None:
        """Called by the watcher: record a completed stop once, and re-arm if configured."""
        flag, _ = self.read_flag()
        active = self._active(flag)
        if active is None:
            return
        rid = active.get("request_id")
        if rid is None or not self._completed(rid, ranks, world_size):
            return
        with self._flag_lock():
            current, _ = self.read_flag()
            if self._active(current) is None or current.get("request_id") != rid:
                return  # someone else re-armed or replaced it meanwhile
            if not self.audit.has("complete", rid):
                status = self.status(ranks, world_size, time.time())
                self.audit.record("complete", who=SYSTEM, request_id=rid, outcome=f"completed: {status['summary']}",
                                  detail={"stop_step": status["stop_step"],
                                          "save_s": status["save_s"], "bytes": status["bytes"]})
            if self.auto_rearm:
                self._write_rearmed(current, SYSTEM)
                self.audit.record("rearm", who=SYSTEM, request_id=rid,
                                  outcome="accepted (automatic after completion)")

    # -------------------------------------------------------------- status
    def _stages(self, rid: str | None, ranks: Mapping[int, dict | None]) -> dict[int, dict]:
        out = {}
        for rank, hb in ranks.items():
            stop = (hb or {}).get("stop")
            if isinstance(stop, dict) and stop.get("request_id") == rid and stop.get("stage") in STAGES:
                out[rank] = {"stage": stop["stage"], "seen_step": stop.get("seen_step"),
                             "stop_step": stop.get("stop_step"), "checkpoint": stop.get("checkpoint"),
                             "at": stop.get("at") or {}, "error": stop.get("error"),
                             "state": (hb or {}).get("state")}
            else:
                out[rank] = {"stage": "requested", "seen_step": None, "stop_step": None,
                             "checkpoint": None, "at": {}, "error": None,
                             "state": (hb or {}).get("state")}
        return out

    def _completed(self, rid: str | None, ranks: Mapping[int, dict | None], world_size: int) -> bool:
        stages = self._stages(rid, ranks)
        return (world_size > 0 and len(stages) >= world_size
                and all(stages.get(r, {}).get("stage") == "exited" for r in range(world_size)))

    def status(self, ranks: Mapping[int, dict | None], world_size: int, now: float) -> dict[str, Any]:
        """The body of ``GET /api/exit``."""
        flag, flag_error = self.read_flag()
        active = self._active(flag)
        request = _request_facts(active) if active else (flag or {}).get("last_request")
        base = {"flag": flag, "flag_error": flag_error, "request": request, "state": "idle",
                "ranks": [], "stop_step": None, "summary": None, "holding_up": [], "late": [],
                "can_cancel": False, "can_rearm": active is not None, "save_s": None, "bytes": None,
                "bridge_seen": bool(ranks), "deadline_s": self.deadline_s}
        if request is None:
            return base
        rid = request.get("request_id")
        stages = self._stages(rid, ranks)
        requested_at = request.get("requested_at") or now
        rows = []
        for rank in sorted(stages):
            s = stages[rank]
            entered = max([requested_at, *[t for t in s["at"].values() if isinstance(t, (int, float))]])
            late = s["stage"] != "exited" and active is not None and now - entered > self.deadline_s
            rows.append({"rank": rank, **s, "late": late, "stage_since": entered})
        order = {name: i for i, name in enumerate(STAGES)}
        lowest = min((order[r["stage"]] for r in rows), default=0)
        all_exited = bool(rows) and all(r["stage"] == "exited" for r in rows) and len(rows) >= world_size
        stop_steps = sorted({r["stop_step"] for r in rows if r["stop_step"] is not None})
        saves = [r["checkpoint"] for r in rows if r["checkpoint"]]
        total_bytes = sum(c.get("bytes") or 0 for c in saves)
        save_s = max((c.get("seconds") or 0 for c in saves), default=None)
        if active is None:
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
            summary = (f"all {len(rows)} ranks stopped after step {_steps_text(stop_steps)}, "
                       f"{len(saves)} checkpoints, {_gb(total_bytes)}, in {ended - requested_at:.1f} s")
        base.update(
            state=state, ranks=rows, stop_step=stop_steps[0] if len(stop_steps) == 1 else stop_steps or None,
            summary=summary, save_s=save_s, bytes=total_bytes or None,
            holding_up=[] if all_exited or active is None else
            [r["rank"] for r in rows if order[r["stage"]] == lowest],
            late=[r["rank"] for r in rows if r["late"]],
            can_cancel=active is not None and not any(r["stage"] in COMMITTED for r in rows))
        return base

    def estimate(self, ranks: Mapping[int, dict | None], world_size: int) -> dict[str, Any]:
        """What the dialog shows before confirming: ranks, time to stop, where checkpoints go."""
        steps_ms = [(hb.get("step_time_mean_ms") or hb.get("step_time_ms") or 0) * (hb.get("sync_every") or 1)
                    for hb in ranks.values() if hb]
        sync_s = max(steps_ms, default=0) / 1000.0
        last = next((r for r in self.audit.rows(limit=50) if r["action"] == "complete"), None)
        save_s = (json.loads(last["detail"]) or {}).get("save_s") if last and last["detail"] else None
        seconds = None if not ranks else round(1.0 + sync_s + (save_s or 0.0), 1)
        return {"ranks": world_size, "seconds": seconds, "save_s": save_s,
                "save_measured": save_s is not None,
                "checkpoint_dir": f"{runfiles.CHECKPOINT_DIR}/rank_{{r}}/",
                "basis": ("flag poll (<= 0.2 s) + steps until the next agreement "
                          f"({sync_s:.2f} s) + save time "
                          + (f"({save_s:.2f} s, measured at the last stop)" if save_s is not None
                             else "(not measured yet: this is the job's first stop)"))}


def _request_facts(flag: dict) -> dict:
    return {k: flag.get(k) for k in ("request_id", "requested_at", "requested_by", "reason")}


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:10])) + (f" and {len(ranks) - 10} more" if len(ranks) > 10 else "")


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "?"
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}..{steps[-1]} (ranks disagree!)"


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
