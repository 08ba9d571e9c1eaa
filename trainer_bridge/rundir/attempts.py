"""Attempts: each launch of a job in one run directory, in ``RUN/rankwatch/attempts.jsonl``.

Rank 0 of each launch appends a start line when training begins, a hosts
line once every rank has reported, and an end line when it ends
(``schema.AttemptStart``, ``AttemptHosts``, ``AttemptEnd``). A launch that
was killed writes no end line: the next launch's rank 0 writes one for it
from the heartbeats its ranks left behind (``outcome``), and until then the
dashboard judges it from the same heartbeats. ``fold`` turns the lines into
one row per attempt, oldest first.

The launch guard, which reads the same heartbeats before a launch writes
anything, is ``launchguard``.

Nothing here may stop training: the writer logs a problem once and goes on,
and the reader reads a bounded tail and skips lines that are not ours.
Free of MindSpore (the dashboard imports it).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from typing import Any

from trainer_bridge.rundir import runfiles, safedirs, safeio, schema, supervised

log = logging.getLogger("trainer_bridge")

# The reader's bounds: the newest bytes of the file (about 1,000 attempts),
# one line, and the rows it answers with.
MAX_TAIL_BYTES = 512 * 1024
MAX_LINE_BYTES = 64 * 1024
MAX_ATTEMPTS = 1000
# The writer starts a new segment (the old one kept as ``.1``) past this.
SEGMENT_BYTES = 1024 * 1024
# How long rank 0 waits for every rank's first heartbeat to name the hosts.
ROLL_CALL_S = 300.0
ROLL_CALL_READS = 256  # heartbeats read per reporter tick at most

TERMINAL = ("exited", "finished", "failed")
LINE_MODELS = {
    "start": schema.AttemptStart,
    "hosts": schema.AttemptHosts,
    "end": schema.AttemptEnd,
    "supervised": schema.AttemptSupervised,
    "refused": schema.AttemptRefused,
}

END_OF_STATE = {"exited": "graceful_stop", "finished": "finished", "failed": "failed"}


# ------------------------------------------------------------------ how a launch ended


def outcome(beats: Iterable[dict]) -> dict:
    """How a launch ended, by its ranks' last heartbeats: the fields of an end line.

    A failed rank makes the launch failed; every rank exited, a graceful
    stop; every rank finished, finished; ranks still saying they train
    (their processes are gone) make it killed; no heartbeat at all, unknown.
    """
    beats = list(beats)
    if not beats:
        return {"end": "unknown", "last_step": None, "ended_at": None}
    steps = [hb["global_step"] for hb in beats if hb.get("global_step") is not None]
    told = {
        "last_step": max(steps) if steps else None,
        "ended_at": max(hb["time"] for hb in beats),
    }
    failed = [hb for hb in beats if hb["state"] == "failed"]
    states = {hb["state"] for hb in beats}
    if failed:
        first = min(failed, key=lambda hb: hb["rank"])
        error = f"rank {first['rank']}: {first.get('error') or 'failed without an error message'}"
        return {**told, "end": "failed", "error": error[: schema.MAX_ERROR]}
    if not states <= set(TERMINAL):
        return {**told, "end": "killed"}
    if "exited" in states:
        stop = next((hb["stop"] for hb in beats if hb.get("stop")), None) or {}
        return {
            **told,
            "end": "graceful_stop",
            "request_id": stop.get("request_id"),
            "source": stop.get("source"),
        }
    return {**told, "end": "finished"}


# ------------------------------------------------------------------ reading


def _tail_lines(path, budget: int) -> tuple[list[bytes], int]:
    """(the complete lines in the newest ``budget`` bytes of ``path``, the file's size)."""
    try:
        data, start = safeio.read_tail(path, budget)
    except FileNotFoundError:
        return [], 0
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]  # the first is cut
    return [ln for ln in lines if ln.strip()], start + len(data)


def parse_line(line: bytes) -> dict | None:
    """One line as a validated record (``kind`` first), or None if it is not one of ours."""
    if len(line) > MAX_LINE_BYTES:
        return None
    try:
        obj = runfiles.loads_bounded(line)
    except (ValueError, UnicodeDecodeError):
        return None
    model = LINE_MODELS.get(obj.get("kind")) if isinstance(obj, dict) else None
    if model is None:
        return None
    try:
        return schema.validate(model, obj).to_dict()
    except schema.SchemaError:
        return None


def read_lines(run_dir: str | os.PathLike, *, with_refused: bool = False) -> tuple[list[dict], int]:
    """(the valid records in the newest ``MAX_TAIL_BYTES`` of the file and its previous segment, lines skipped).

    Every record is an attempt's (it has ``attempt``), unless ``with_refused``
    adds the refused launches' lines, which belong to no attempt.

    Raises OSError when the file is there but cannot be read (a FIFO, a directory, no permission).
    """
    path = runfiles.attempts_path(run_dir)
    current, size = _tail_lines(path, MAX_TAIL_BYTES)
    older: list[bytes] = []
    if size < MAX_TAIL_BYTES:
        try:
            older, _ = _tail_lines(f"{path}.1", MAX_TAIL_BYTES - size)
        except OSError:
            older = []
    records, skipped = [], 0
    for line in older + current:
        rec = parse_line(line)
        if rec is None:
            skipped += 1
        elif with_refused or rec["kind"] != "refused":
            records.append(rec)
    return records, skipped


def stop_by(row: dict) -> str | None:
    """Who stopped a gracefully stopped attempt: ``policy``, ``operator`` or ``sigterm``."""
    if row.get("end") != "graceful_stop":
        return None
    if row.get("source") == "sigterm":
        return "sigterm"
    return "policy" if row.get("requested_by") == "policy" else "operator"


def _blank(rec: dict) -> dict:
    return {
        **{k: v for k, v in rec.items() if k != "kind"},
        "last_step": None,
        "ended_at": None,
        "end": None,
        "request_id": None,
        "requested_by": None,
        "source": None,
        "error": None,
        "sealed_by": None,
        "cause": None,
        "restarted_by": None,
        "supervisor": None,
    }


def fold(records: Iterable[dict]) -> list[dict]:
    """One row per attempt, oldest first (the newest ``MAX_ATTEMPTS``); the latest end line wins."""
    rows: dict[int, dict] = {}
    for rec in records:
        if rec["kind"] == "refused":
            continue  # a launch turned away made no attempt (``refused``)
        n, kind = rec["attempt"], rec["kind"]
        if kind == "start":
            rows[n] = _blank(rec)
            continue
        if kind == "supervised":
            supervised.merge(rows, rec, _blank)
            continue
        row = rows.get(n)
        if row is None or row["launch"] != rec["launch"]:
            continue  # its start line is gone (cut off the tail) or belongs to another launch
        if kind == "hosts":
            row["hosts"], row["host_count"] = rec["hosts"], rec["host_count"]
        else:
            row.update({k: v for k, v in rec.items() if k not in ("kind", "attempt", "launch")})
    out = [rows[n] for n in sorted(rows)][-MAX_ATTEMPTS:]
    for i, row in enumerate(out):
        row["stop_by"] = stop_by(row)
        row["downtime"] = supervised.downtime(row)
        after = out[i + 1] if i + 1 < len(out) else None
        if row["downtime"] is not None and after is not None and after["launch"] is not None:
            # The next attempt's bridge started (its first step follows at once, after the compile).
            relaunched = row["supervisor"].get("relaunched_at")
            if relaunched is not None:
                row["downtime"]["relaunched_to_bridge_start_s"] = round(after["started_at"] - relaunched, 3)
    return out


def refused(records: Iterable[dict], newest: int = 3) -> list[dict]:
    """The newest refused lines: launches turned away while another launch trained."""
    return [r for r in records if r["kind"] == "refused"][-newest:]


def resumed_text(global_step: int, set_id: str | None) -> str:
    """The words the terminal, the page and the rank rows use for a resume."""
    return f"resumed from global step {global_step}" + (f" (set {set_id})" if set_id else "")


# ------------------------------------------------------------------ writing


def append_record(run_dir, record) -> None:
    """Append one validated line (a new segment past ``SEGMENT_BYTES``); raises OSError."""
    path = runfiles.attempts_path(run_dir)
    line = record.to_json() + b"\n"
    try:
        if path.stat().st_size + len(line) > SEGMENT_BYTES:
            os.replace(path, f"{path}.1")
    except FileNotFoundError:
        pass
    safedirs.makedirs(run_dir, runfiles.STATE_DIR)
    safeio.append(run_dir, safeio.relative(run_dir, path), line)


def note_refusal(run_dir, reason: str, world: int, host: str, pid: int) -> bool:
    """Rank 0 of a refused launch: its refused line, for the page. Best effort: False if not written."""
    try:
        append_record(
            run_dir,
            schema.build(
                schema.AttemptRefused,
                kind="refused",
                at=time.time(),
                host=host[:253] or "?",
                pid=pid,
                world_size=world,
                reason=reason[: schema.MAX_ERROR],
            ),
        )
        return True
    except (OSError, ValueError) as e:
        log.warning("rankwatch: could not record the refused launch in attempts.jsonl: %s", e)
        return False


class AttemptLog:
    """Rank 0's writer: ``begin`` at start, ``roll_call`` from the reporter's thread, ``end`` at the end.

    Every method swallows what the disk or a bad file can throw (logged once):
    a dashboard's file must never stop training.
    """

    def __init__(self, run_dir, launch: str, world: int, host: str, pid: int):
        self.run_dir = run_dir
        self.launch = launch
        self.world = world
        self.host = host
        self.pid = pid
        self.number: int | None = None
        self.replayed: list[int] | None = None
        self._hosts: set[str] = {host}
        self._pending: set[int] = set()
        self._roll_until = 0.0
        self._logged: set[str] = set()

    def begin(
        self,
        *,
        started_at: float,
        resumed,
        first_step: int,
        beats: list[tuple[int, dict]],
        skipped: list[int] | None = None,
    ) -> None:
        """Append this launch's start line (and an end line for a previous launch that wrote none).

        ``beats``: the run's heartbeats as read before this launch wrote any.
        Sets ``number`` and ``replayed`` when the line is written.
        """
        if self.number is not None:
            return  # a second model.train on the same bridge: the same launch
        try:
            self._begin(started_at, resumed, first_step, beats, skipped)
        except (OSError, schema.SchemaError, ValueError) as e:
            self._log_once("begin", "rankwatch: attempts.jsonl not written (training continues): %s", e)

    def _begin(self, started_at: float, resumed, first_step: int, beats, skipped=None) -> None:
        try:
            records, _ = read_lines(self.run_dir)
        except OSError as e:
            self._log_once("read", "rankwatch: cannot read attempts.jsonl (numbering from it anyway): %s", e)
            records = []
        rows = fold(records)
        prev = rows[-1] if rows else None
        number = max((r["attempt"] for r in records), default=0) + 1
        others = [hb for _, hb in beats if hb.get("launch") != self.launch]
        prev_beats = [hb for hb in others if prev is None or hb.get("launch") == prev["launch"]]
        left = outcome(prev_beats)
        prev_last = prev["last_step"] if prev is not None and prev["end"] else None
        if prev_last is None:
            prev_last = left["last_step"]
        if prev is not None and prev["end"] is None:
            # It wrote no end line (killed, or its disk was full): say what its heartbeats say.
            self._append(
                schema.build(
                    schema.AttemptEnd,
                    kind="end",
                    attempt=prev["attempt"],
                    launch=prev["launch"],
                    sealed_by=number,
                    **{k: v for k, v in left.items()},
                )
            )
        base = first_step - 1
        replayed = [base + 1, prev_last] if prev_last is not None and prev_last > base else None
        start = schema.build(
            schema.AttemptStart,
            kind="start",
            attempt=number,
            launch=self.launch,
            started_at=started_at,
            world_size=self.world,
            hosts=[self.host],
            pid=self.pid,
            resumed_from=None
            if resumed is None
            else {"set": getattr(resumed, "set_id", None), "global_step": resumed.global_step},
            first_step=first_step,
            previous_last_step=prev_last,
            replayed=replayed,
            skipped=skipped,
        )
        self._append(start)
        self.number = number
        self.replayed = replayed
        if self.world > 1:
            self._pending = set(range(self.world)) - {0}
            self._roll_until = time.monotonic() + ROLL_CALL_S

    @property
    def roll_call_pending(self) -> bool:
        """Ranks whose first heartbeat is still to be read (up to ROLL_CALL_READS a tick)."""
        return bool(self._pending) and self.number is not None

    def roll_call(self) -> None:
        """Learn the other ranks' hosts from their first heartbeats; one hosts line when all are in."""
        if not self._pending or self.number is None:
            return
        try:
            for rank in sorted(self._pending)[:ROLL_CALL_READS]:
                try:
                    hb = schema.load(schema.Heartbeat, runfiles.heartbeat_path(self.run_dir, rank))
                except (OSError, schema.SchemaError):
                    continue
                if hb.launch == self.launch:
                    self._pending.discard(rank)
                    if hb.host:
                        self._hosts.add(hb.host)
            if self._pending and time.monotonic() < self._roll_until:
                return
            self._pending = set()
            if self._hosts != {self.host}:
                hosts = sorted(self._hosts)
                self._append(
                    schema.build(
                        schema.AttemptHosts,
                        kind="hosts",
                        attempt=self.number,
                        launch=self.launch,
                        hosts=hosts[: schema.MAX_ATTEMPT_HOSTS],
                        host_count=len(hosts),
                    )
                )
        except (OSError, schema.SchemaError) as e:
            self._pending = set()
            self._log_once("hosts", "rankwatch: attempts.jsonl hosts line not written: %s", e)

    def end(self, *, state: str, last_step: int, stop: dict | None, error: str | None, flag_raw: Any) -> None:
        """Append this launch's end line (again, if a later fate replaces an earlier one)."""
        if self.number is None:
            return
        stop = stop or {}
        by = flag_raw.get("requested_by") if isinstance(flag_raw, dict) else None
        end = END_OF_STATE.get(state, "unknown")
        try:
            self._append(
                schema.build(
                    schema.AttemptEnd,
                    kind="end",
                    attempt=self.number,
                    launch=self.launch,
                    ended_at=time.time(),
                    end=end,
                    last_step=last_step,
                    request_id=stop.get("request_id") if end == "graceful_stop" else None,
                    source=stop.get("source") if end == "graceful_stop" else None,
                    requested_by=by[:200] if isinstance(by, str) and end == "graceful_stop" else None,
                    error=error[: schema.MAX_ERROR] if error and end == "failed" else None,
                )
            )
        except (OSError, schema.SchemaError) as e:
            self._log_once("end", "rankwatch: attempts.jsonl end line not written: %s", e)

    def _append(self, record) -> None:
        append_record(self.run_dir, record)

    def _log_once(self, key: str, msg: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args)
