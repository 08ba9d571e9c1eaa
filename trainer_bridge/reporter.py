"""The bridge's reporter: flag watcher and heartbeat writer.

The training thread updates a ``Counters`` object (a few numbers per step)
and calls the stop-stage methods here; the reporter turns them into files:
the heartbeat and its history (``trainer_bridge/rundir/schema/``), the flag
poll, the device sample, and the stack captures of ``StackWatcher``.

Who runs it: the training thread at its agreements while steps flow, the
reporter's own thread when they do not (``trainer_bridge/handover.py``).

Nothing the reporter does can stop training: a reporter error is logged
once per kind and the reporter carries on.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

from trainer_bridge.beatsink import BeatSink
from trainer_bridge.counters import Counters, Snapshot
from trainer_bridge.device import DeviceProbe
from trainer_bridge.flagpoll import FlagPoller
from trainer_bridge.handover import HandOver, Work
from trainer_bridge.jobfile import clip, job_record
from trainer_bridge.procstats import ProcessStats
from trainer_bridge.rundir import copies, runfiles, safedirs, schema
from trainer_bridge.rundir.attempts import AttemptLog
from trainer_bridge.saving import ResumePoint, Served
from trainer_bridge.stacks import StackWatcher

log = logging.getLogger("trainer_bridge")


def _scalar(value) -> float | None:
    """A Python number or a Tensor's first element as a float (NaN kept); None if it is neither."""
    try:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        return float(value.asnumpy().reshape(-1)[0])
    except (AttributeError, IndexError, TypeError, ValueError, RuntimeError, OverflowError):
        return None


class Reporter:
    """The reporter. ``close()`` writes the last heartbeat and is safe to call twice.

    ``Reporter.latest`` is the newest started in this process (the one an
    uncaught exception marks failed after its close).

    Args:
        run_dir, rank, world: where and who.
        counters: the training thread's ``Counters``.
        served: stop requests already served; a flag asking for one of them is stale.
        heartbeat_interval_s, poll_interval_s: the heartbeat's and the flag poll's periods.
        sync_interval_s: written into ``job.json`` (rank 0).
        batch_size: for ``samples_per_s``.
        resumed: the set this launch resumed from, for ``resumed_from``.
        launch: the launch's id, the same on every rank of it (heartbeat ``launch``).
        attempts: rank 0's ``attempts.jsonl`` writer: its hosts roll call and end line.
    """

    latest: Reporter | None = None

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world: int,
        counters: Counters,
        *,
        served: Served,
        heartbeat_interval_s: float,
        poll_interval_s: float,
        sync_interval_s: float,
        batch_size: int | None,
        resumed: ResumePoint | None,
        front_end: str | None = None,
        launch: str | None = None,
        attempts: AttemptLog | None = None,
    ):
        self.run_dir = run_dir
        self.rank, self.world = rank, world
        self.counters = counters
        self.served = served
        self.heartbeat_interval_s = heartbeat_interval_s
        self.poll_interval_s = poll_interval_s
        self.sync_interval_s = sync_interval_s
        self.batch_size = batch_size
        self.front_end = front_end
        self.launch = launch
        self.attempts = attempts
        self.state = "starting"
        self.reporter_cpu_ms = 0.0
        self.loss: float | None = None
        self.grad_norm: float | None = None
        self.loss_step: int | None = None  # the global step whose loss self.loss is
        self.loss_due = 0.0
        self.request: runfiles.Flag | None = None
        self.stop: dict | None = None
        self.committed = False  # the ranks agreed to stop: a cancel comes too late
        self.error: str | None = None
        self.warnings: list[str] = []
        # The heartbeat file, and Redis when RANKWATCH_REDIS_URL is set (beatsink.py).
        self.sink = BeatSink(run_dir, rank, world)
        self.resumed_from = None
        if resumed is not None:
            self.resumed_from = {
                "global_step": resumed.global_step,
                "epoch": resumed.epoch,
                "path": os.path.relpath(resumed.path, self.run_dir),
                "set": resumed.set_id,
            }
        self._totals = (0.0, 0.0, 0)  # (in, out, steps) at the previous heartbeat
        self._last_step_ms = None
        self._window = {
            "step_time_mean_ms": None,
            "step_in_ms": None,
            "step_out_ms": None,
            "samples_per_s": None,
        }
        self._logged: set[str] = set()
        self._seq = 0
        self.started_at = time.time()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()  # one writer at a time: the thread, or close()
        self._flag_lock = threading.Lock()
        self._flags = FlagPoller(run_dir, served, self._log_once)
        # Its thread, or the agreements (trainer_bridge/handover.py): given this, and nothing else of ours.
        self.handover = HandOver(
            Work(self._tick, self._steady, self._closed, self._wake, heartbeat_interval_s, poll_interval_s)
        )
        self._next_poll = self._next_beat = 0.0  # time.monotonic()
        self._device = DeviceProbe()
        self._procstats = ProcessStats()  # CPU and RSS, for the heartbeat
        self._host = socket.gethostname()
        # stacks (trainer_bridge/stacks.py): built here, on the training thread, which it marks.
        self.stacks = StackWatcher(self.run_dir, self.rank, self._host)
        self.gasp = None  # set by the engine: trainer_bridge.gasp.Gasp

    # ------------------------------------------------ training-thread side
    def take_loss(self, outputs, grad_norm=None, step: int | None = None) -> None:
        """Convert the loss (and the norm) about once a heartbeat; every step would cost a device sync.

        A NaN or infinite value is kept as it is: the schema writes it as
        null plus ``loss_nonfinite`` (valid JSON), and the dashboard's spike
        detector judges it.
        """
        self.loss_due = time.perf_counter() + self.heartbeat_interval_s
        value = outputs[0] if isinstance(outputs, (tuple, list)) and outputs else outputs
        self.loss = _scalar(value)
        self.grad_norm = None if grad_norm is None else _scalar(grad_norm)
        self.loss_step = step if self.loss is not None else None

    def saw_request(self, flag: runfiles.Flag | None, source: str, step: int) -> None:
        if self.stop is None:
            self.stop = {
                "request_id": flag.request_id if flag else None,
                "source": source,
                "stage": "seen",
                "seen_step": step,
                "stop_step": None,
                "checkpoint": None,
                "at": {"seen": time.time()},
            }
            self.state = "stopping"
            self._next_beat = 0.0  # the next tick shows it
            self._wake.set()

    def begin_stop(self, request_id: str, source: str, stop_step: int) -> None:
        if self.stop is None:
            self.stop = {
                "request_id": request_id,
                "source": source,
                "stage": "agreed",
                "seen_step": None,
                "stop_step": stop_step,
                "checkpoint": None,
                "at": {},
            }
        self.stop.update(request_id=request_id, stop_step=stop_step)
        self.committed = True
        self.state = "stopping"
        self.set_stage("agreed")

    def set_stage(self, stage: str) -> None:
        if self.stop is not None:
            self.stop["stage"] = stage
            self.stop["at"][stage] = time.time()
            self.write_now()

    def saved(self, path: Path, size: int, seconds: float) -> None:
        self.stop["checkpoint"] = {
            "path": os.path.relpath(path, self.run_dir),
            "bytes": size,
            "seconds": round(seconds, 4),
        }
        self.state = "stopping"
        self.set_stage("saved")

    def save_failed(self, message: str) -> None:
        self.stop["error"] = message
        self.warnings.append(f"checkpoint save failed: {message}")
        self.write_now()

    def on_agreement(self) -> None:
        """The training thread, at an agreement step: do the reporter's work if it is due.

        Costs a clock read and a ``timer_settime`` when nothing is due. Never
        raises: it runs inside someone else's training loop.
        """
        try:
            self.handover.on_agreement(time.monotonic())
        except Exception as e:  # noqa: BLE001 - a reporter bug must not reach the training loop
            self._log_once(
                f"agree:{type(e).__name__}", "rankwatch: reporter error (training continues): %s", e
            )

    def write_now(self) -> None:
        """Write a heartbeat synchronously: stop stages must not wait for the next tick."""
        self._write_heartbeat()

    def read_flag_now(self) -> runfiles.Flag | None:
        self._poll_flag(force=True)
        return self.request

    # ------------------------------------------------------ thread side
    def start(self) -> None:
        try:
            safedirs.makedirs(self.run_dir, runfiles.STATE_DIR)
        except OSError as e:
            self._report_io_error(e)
        if self.rank == 0:
            self._write_job()
        self._write_heartbeat()
        self.handover.start()
        Reporter.latest = self
        atexit.register(self.close)
        self._chain_excepthook()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        self.handover.stop()
        self._write_heartbeat()
        self._end_attempt()
        # Under the writers' lock: a thread the join above gave up on must
        # not write through a descriptor closed (and its number reused) here.
        # A later heartbeat (the excepthook's) walks to the directory again.
        with self._lock:
            self.sink.close()
            self._procstats.close()

    def _end_attempt(self) -> None:
        """Rank 0: this launch's end line in attempts.jsonl, as the rank's state now says."""
        if self.attempts is None:
            return
        try:
            self.attempts.end(
                state=self.state,
                last_step=self.counters.global_step,
                stop=self.stop,
                error=self.error,
                flag_raw=self.request.raw if self.request is not None else None,
            )
        except Exception as e:  # noqa: BLE001 - the end of training must not fail on our file
            self._log_once("attempt-end", "rankwatch: attempts.jsonl end line not written: %s", e)

    def _steady(self) -> bool:
        """Whether the agreements may run the work: training, and no hosts roll call (rank 0 reads
        hundreds of heartbeats a tick: not on the training thread)."""
        return self.state == "training" and not (
            self.attempts is not None and self.attempts.roll_call_pending
        )

    def _tick(self, now: float, slack: float = 0.0) -> None:
        """The reporter's work, on whichever thread runs it: what is due, or due within ``slack`` s."""
        cpu = time.thread_time()
        now += slack
        try:
            if now >= self._next_poll:
                self._next_poll = now + self.poll_interval_s
                self._poll_flag()
                if self.attempts is not None:
                    self.attempts.roll_call()
                if self.gasp is not None:
                    self.gasp.poll()  # rankwatch launch asks for the dying gasp (trainer_bridge/gasp.py)
                snap = self.counters.snapshot()
                # stacks: answer requests, and capture once when no step ends for too long.
                self.stacks.poll(
                    steps=snap.steps_total,
                    since_step_s=time.perf_counter() - snap.last_step_end,
                    step_s=(self._window["step_time_mean_ms"] or 0.0) / 1e3,
                    global_step=snap.global_step,
                    stepping=self.state in ("training", "stopping"),
                )
            if now >= self._next_beat:
                self._next_beat = now + self.heartbeat_interval_s
                self._write_heartbeat(history=True)
        except Exception as e:  # the reporter must never die: log once per kind
            self._log_once(
                f"reporter:{type(e).__name__}",
                "rankwatch: reporter error (training continues): %s",
                e,
                exc_info=True,
            )
        self.reporter_cpu_ms += (time.thread_time() - cpu) * 1e3

    def _poll_flag(self, force: bool = False) -> None:
        # The reporter polls (on its thread, or at an agreement); the training
        # thread also forces a read before it votes with a pending request.
        # One at a time.
        with self._flag_lock:
            self._poll_flag_locked(force)

    def _poll_flag_locked(self, force: bool) -> None:
        flag, withdrawn = self._flags.read(force)
        if withdrawn:
            self._withdraw(withdrawn)
        elif flag is not None and self.request is None:
            self.request = flag
            self.saw_request(flag, "flag", self.counters.global_step)

    def _withdraw(self, why: str) -> None:
        """Drop a request this rank saw but has not voted through: the operator cancelled it."""
        if self.request is None or self.committed:
            return
        log.warning("rankwatch: stop request %s withdrawn: %s", self.request.request_id, why)
        self.request = None
        if self.stop is not None and self.stop.get("source") == "flag":
            self.stop = None
            self.state = "training"
            self._next_beat = 0.0
            self._wake.set()

    def _heartbeat(self) -> schema.Heartbeat:
        snap = self.counters.snapshot()
        times = self.counters.drain_step_times()
        times_ms = [round(t * 1000.0, 3) for t in times]
        if times_ms:
            self._last_step_ms = times_ms[-1]
        per_epoch = snap.per_epoch or 0
        gstep = snap.global_step
        cpu, cpu_s, rss = self._procstats.sample()
        totals = (snap.in_total, snap.out_total, snap.steps_total)
        steps = totals[2] - self._totals[2]
        if steps:
            # A heartbeat with no step since the last one (the final one, a
            # stall) keeps the last window's figures instead of blanking them.
            self._window = {
                "step_time_mean_ms": round(sum(times_ms) / len(times_ms), 3) if times_ms else None,
                "step_in_ms": round((totals[0] - self._totals[0]) / steps * 1e3, 3),
                "step_out_ms": round((totals[1] - self._totals[1]) / steps * 1e3, 3),
            }
            mean_ms = self._window["step_time_mean_ms"]
            self._window["samples_per_s"] = (
                round(self.batch_size * 1000.0 / mean_ms, 2) if mean_ms and self.batch_size else None
            )
        self._totals = totals
        self._seq += 1
        return schema.build(
            schema.Heartbeat,
            rank=self.rank,
            world_size=self.world,
            host=self._host,
            pid=os.getpid(),
            state=self.state,
            epoch=snap.epoch,
            step=(gstep - 1) % per_epoch + 1 if per_epoch and gstep else 0,
            global_step=gstep,
            loss=self.loss,
            loss_step=self.loss_step,
            # A negative norm is no norm (the schema would refuse the heartbeat): left out.
            grad_norm=None if self.grad_norm is not None and self.grad_norm < 0 else self.grad_norm,
            step_time_ms=self._last_step_ms,
            **self._window,
            step_times_ms=times_ms,
            batch_size=self.batch_size,
            cpu_percent=cpu,
            cpu_seconds=cpu_s,
            rss_bytes=rss,
            device=self._device.sample(block=False),
            time=time.time(),
            last_step_at=self._last_step_at(snap),
            started_at=self.started_at,
            seq=self._seq,
            sync_every=snap.sync_every,
            bridge_cost={
                "agreements": snap.agreements,
                "agree_ms": round(snap.agree_ms, 3),
                "first_agree_ms": snap.first_agree_ms,
                "reporter_cpu_ms": round(self.reporter_cpu_ms, 3),
                "reporter_thread": self.handover.thread is not None,
                "reporter_thread_starts": self.handover.starts,
            },
            stop=self.stop,
            resumed_from=self.resumed_from,
            launch=self.launch,
            error=clip(self.error, schema.MAX_ERROR),
            warnings=[
                clip(w, schema.MAX_WARNING)
                for w in (self.warnings + self.sink.warnings)[-schema.MAX_WARNINGS :]
            ],
        )

    @staticmethod
    def _last_step_at(snap: Snapshot) -> float | None:
        """Wall time of the last step end, from the perf_counter the step hook already read."""
        if not snap.global_step:
            return None
        return time.time() - (time.perf_counter() - snap.last_step_end)

    def _write_heartbeat(self, history: bool = False) -> None:
        with self._lock:
            try:
                beat = self._heartbeat()
            except schema.SchemaError as e:  # a bridge bug must not reach the training thread
                self._log_once("schema", "rankwatch: heartbeat not written (training continues): %s", e)
                return
            try:
                self.sink.write(beat.to_json(), beat.state)
                if history:
                    self.sink.append_history(beat)
            except OSError as e:
                self._report_io_error(e)

    def _report_io_error(self, e: OSError) -> None:
        message = f"cannot write to {runfiles.state_dir(self.run_dir)}: {e.strerror or e}"
        if message not in self.warnings:
            self.warnings.append(message)
        self._log_once(f"io:{e.errno}", "rankwatch: %s (training continues)", message)

    def _write_job(self) -> None:
        try:
            job = job_record(
                self.world,
                self.started_at,
                self._host,
                self.front_end,
                self.sync_interval_s,
                dir_ino=copies.dir_ino(self.run_dir),
            )
            runfiles.atomic_write_bytes(runfiles.job_path(self.run_dir), job.to_json(), root=self.run_dir)
        except OSError as e:
            self._report_io_error(e)
        except schema.SchemaError as e:
            self._log_once("schema-job", "rankwatch: job.json not written (training continues): %s", e)

    def _chain_excepthook(self) -> None:
        """Mark the rank failed if the script dies of an exception, then defer to the old hook."""
        previous = sys.excepthook

        def hook(kind, value, tb):
            # Also after close(): a functional loop the exception left early
            # closed as "finished" (a generator cannot tell a break from a
            # raise). A rank that stopped gracefully keeps its "exited".
            if self.state != "exited" and (not self._closed.is_set() or Reporter.latest is self):
                self.state = "failed"
                self.error = f"{kind.__name__}: {value}"
                if self._closed.is_set():
                    self._write_heartbeat()
                    self._end_attempt()
                else:
                    self.close()
            previous(kind, value, tb)

        sys.excepthook = hook

    def _log_once(self, key: str, msg: str, *args, **kwargs) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args, **kwargs)
