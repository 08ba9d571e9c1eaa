"""``GracefulExitBridge``: the callback that connects a trainer to Rankwatch.

It lives inside someone else's training loop, so it is built around three
rules:

* **The step hooks are cheap.** ``on_train_step_begin`` and ``_end`` read
  the clock, add to running totals, append to a deque and compare two
  integers. Files, psutil and the flag are
  handled by one daemon thread (``_Reporter``).
* **Agreement is amortised.** Ranks agree on "stop now?" with one float32 SUM
  AllReduce (the one collective MindSpore's CPU backend has for this) every
  *K* steps, at global step numbers every rank computes alike. *K* is
  recomputed at each agreement from *reduced* values (the mean step time and
  the mean cost of an agreement), the same floats on every rank, so every
  rank picks the same next step: ``K = clamp(max(sync_interval_s / step,
  agree_cost / (max_overhead * step)), 1, max_sync_every)``. When
  agreements are cheap, the stop latency decides K; when the machine is so
  loaded that one costs more, K stretches so that agreeing never takes more
  than ``max_overhead`` of the training time.
* **Nothing the dashboard does can hurt training.** A bad flag is logged once
  and ignored, a full disk is logged once and reported, a reporter bug is
  logged and the reporter carries on. Only a stop request stops training.

On Ascend with ``MS_ENABLE_GRACEFUL_EXIT=1`` MindSpore's in-graph exit works,
so the bridge only reports there and leaves stopping to ``OnRequestExit``.
"""

from __future__ import annotations

import atexit
import collections
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.train import Callback

from trainer_bridge import runfiles, schema
from trainer_bridge.ckptindex import ORIGIN_BRIDGE, Index, scan
from trainer_bridge.device import DeviceProbe
from trainer_bridge.stacks import StackWatcher

__all__ = ["GracefulExitBridge", "ResumePoint", "Served", "find_resume_point", "served_requests"]

log = logging.getLogger("trainer_bridge")

# The heartbeat carries each step's time since the previous heartbeat; this
# bounds that list (and the deque behind it) for very fast steps.
MAX_STEP_TIMES = 64


def _clip(text: str | None, limit: int) -> str | None:
    """Keep a message within the schema's bound (a MindSpore error can run to pages)."""
    return text if text is None or len(text) <= limit else text[: limit - 3] + "..."


class _SumAllReduce(nn.Cell):
    """float32 SUM AllReduce over the world group: the vote carrier."""

    def __init__(self):
        super().__init__()
        self.all_reduce = ops.AllReduce()

    def construct(self, x):
        return self.all_reduce(x)


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint set a job resumes from: its global step and this rank's file."""

    global_step: int
    epoch: int | None
    path: Path


@dataclass(frozen=True)
class Served:
    """Stop requests the run directory shows were already served (llnl/scr#13).

    ``request_ids``: every request id stored in a bridge checkpoint (the ranks
    saved for it, so it must not stop a relaunch). ``last_saved_at``: when the
    newest bridge checkpoint was written; a bare ``{"GracefulExit": 1}``
    without an id that is older than it was served too.
    """

    request_ids: frozenset
    last_saved_at: float | None

    def covers(self, flag: runfiles.Flag, flag_mtime: float) -> bool:
        if flag.request_id is not None:
            return flag.request_id in self.request_ids
        return self.last_saved_at is not None and flag_mtime <= self.last_saved_at


def served_requests(index: Index) -> Served:
    files = [f for s in index.sets if s.origin == ORIGIN_BRIDGE for f in s.files if f.ok]
    ids = {f.meta.extras.get("rankwatch_request_id") for f in files}
    return Served(
        frozenset(i for i in ids if isinstance(i, str)), max((f.meta.mtime for f in files), default=None)
    )


def find_resume_point(index: Index, rank: int, step: int | None = None) -> ResumePoint | None:
    """The set to resume from: the newest complete bridge set, or the one pinned at ``step``.

    ``index`` is a ``ckptindex.scan`` of the run directory with the job's
    world size. A pinned step must name a complete set (any layout, the
    bridge's own first); anything else is a ValueError, raised alike on every
    rank before any collective, because all read the same files.
    """
    complete = [s for s in index.sets if s.complete]
    if step is None:
        cset = next((s for s in complete if s.origin == ORIGIN_BRIDGE), None)
    else:
        matches = sorted(
            (s for s in complete if s.global_step == step), key=lambda s: s.origin != ORIGIN_BRIDGE
        )
        if not matches:
            have = sorted({s.global_step for s in complete if s.global_step is not None})
            raise ValueError(
                f"GracefulExitBridge: resume_step={step}, but {index.run_dir} has no "
                f"checkpoint set complete across {index.world_size} ranks at that global step "
                f"(complete sets: {have or 'none'})"
            )
        cset = matches[0]
    if cset is None:
        return None
    return ResumePoint(cset.global_step, cset.epoch, Path(cset.file_for(rank).abspath))


def _world() -> tuple[int, int]:
    """(rank, world size); (0, 1) when the communication layer is not initialised."""
    try:
        from mindspore.communication import get_group_size, get_rank

        return get_rank(), get_group_size()
    except (RuntimeError, ValueError):
        return 0, 1


class GracefulExitBridge(Callback):
    """Reports this rank to Rankwatch and stops it gracefully on request.

    Args:
        run_dir: the run directory shared with the dashboard.
        sync_interval_s: target seconds between stop agreements. It bounds the
            stop latency from the flag being seen to every rank agreeing.
        heartbeat_interval_s: seconds between heartbeat writes.
        poll_interval_s: seconds between ``os.stat`` calls on the flag.
        max_sync_every: the most steps between agreements, whatever the step time.
        max_overhead: the largest share of training time agreements may take;
            above it the interval stretches beyond ``sync_interval_s``.
        resume: load the newest complete checkpoint set at train begin.
        resume_step: pin the set to resume from by its global step instead of
            the newest; ``RANKWATCH_RESUME_STEP`` in the environment does the
            same without editing the script.
        save_checkpoint: save a checkpoint when stopping.
        handle_sigterm: treat SIGTERM as a stop request (ModelArts sends it on
            faults); a second SIGTERM terminates at once.
    """

    def __init__(
        self,
        run_dir,
        *,
        sync_interval_s: float = 0.5,
        heartbeat_interval_s: float = 1.0,
        poll_interval_s: float = 0.2,
        max_sync_every: int = 1000,
        max_overhead: float = 0.003,
        resume: bool = True,
        resume_step: int | None = None,
        save_checkpoint: bool = True,
        handle_sigterm: bool = True,
    ):
        super().__init__()
        for name, value in (
            ("sync_interval_s", sync_interval_s),
            ("heartbeat_interval_s", heartbeat_interval_s),
            ("poll_interval_s", poll_interval_s),
        ):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"GracefulExitBridge: {name} must be a positive number, got {value!r}")
        if not (isinstance(max_overhead, (int, float)) and 0 < max_overhead < 1):
            raise ValueError(
                f"GracefulExitBridge: max_overhead must be a fraction in (0, 1), got {max_overhead!r}"
            )
        if not (isinstance(max_sync_every, int) and max_sync_every >= 1):
            raise ValueError(
                f"GracefulExitBridge: max_sync_every must be an int >= 1, got {max_sync_every!r}"
            )
        env_step = os.environ.get(runfiles.RESUME_STEP_ENV)
        if resume_step is None and env_step:
            resume_step = env_step
            if not resume_step.isdigit():
                raise ValueError(
                    f"GracefulExitBridge: {runfiles.RESUME_STEP_ENV} must be a global step number, "
                    f"got {resume_step!r}"
                )
            resume_step = int(resume_step)
        if resume_step is not None and not (isinstance(resume_step, int) and resume_step >= 1):
            raise ValueError(f"GracefulExitBridge: resume_step must be an int >= 1, got {resume_step!r}")
        self.run_dir = Path(run_dir)
        self.sync_interval_s = float(sync_interval_s)
        self.heartbeat_interval_s = float(heartbeat_interval_s)
        self.poll_interval_s = float(poll_interval_s)
        self.max_sync_every = max_sync_every
        self.max_overhead = float(max_overhead)
        self.resume_enabled = resume
        self.resume_step = resume_step
        self.save_checkpoint = save_checkpoint
        self.handle_sigterm = handle_sigterm
        self._resume_point: ResumePoint | None = None
        self._served = Served(frozenset(), None)
        self._resume_checked = False
        self._data_aligned = False
        self._reporter: _Reporter | None = None

    # ----------------------------------------------------------------- resume
    def resume(self, dataset=None) -> int:
        """Find the set to resume from; return the ``initial_epoch`` for ``Model.train``.

        Pass the training dataset so it starts at the step after the
        checkpoint (``Dataset.set_init_step`` skips the finished part of that
        epoch). Call it before ``model.train(..., initial_epoch=...)``.
        """
        self._find_resume()
        point = self._resume_point
        if point is None or dataset is None:
            return 0
        per_epoch = dataset.get_dataset_size()
        initial_epoch, skip = divmod(point.global_step, per_epoch)
        if skip:
            dataset.set_init_step(skip)
        self._data_aligned = True
        return initial_epoch

    def _find_resume(self) -> None:
        """One scan of the run directory: the set to resume from and the requests already served."""
        if self._resume_checked:
            return
        self._resume_checked = True
        rank, world = _world()
        index = scan(self.run_dir, world_size=world)
        self._served = served_requests(index)
        if self.resume_enabled:
            self._resume_point = find_resume_point(index, rank, self.resume_step)

    # ----------------------------------------------------------------- hooks
    def on_train_begin(self, run_context):
        cb = run_context.original_args()
        self._rank, self._world = _world()
        self._find_resume()
        self._native = (
            os.environ.get("MS_ENABLE_GRACEFUL_EXIT") == "1" and ms.get_context("device_target") == "Ascend"
        )
        self._vote_op = None
        if self._world > 1 and not self._native:
            cell = _SumAllReduce()
            self._vote_op = ms.jit(cell.construct) if ms.get_context("mode") == ms.PYNATIVE_MODE else cell

        self._stop_source: str | None = None  # "flag" or "sigterm" once this rank saw a request
        self._stopping = False
        self._sigterm_count = 0
        self._step_times: collections.deque = collections.deque(maxlen=MAX_STEP_TIMES)
        self._interval_time = 0.0
        self._interval_steps = 0
        self._agree_cost_s = 0.0  # moving average of this rank's agreements, the first excluded
        # Running totals, never reset, so the reporter thread can take deltas
        # without racing the training thread: time inside steps (from begin to
        # end: compute and waiting for peers in the gradient AllReduce) and
        # between them (data loading, other callbacks, host work).
        self._in_total = 0.0
        self._out_total = 0.0
        self._steps_total = 0
        self._step_began = 0.0
        # cb_params is a dict whose missing attributes raise KeyError.
        self._epoch = cb.get("cur_epoch_num") or 1
        self._batch_num = cb.get("batch_num")
        self._global_step = cb.get("cur_step_num") or 0

        point = self._resume_point
        if point is not None:
            self._agree_on_resume(point)
            ms.load_checkpoint(str(point.path), net=cb.train_network)
            cb.cur_step_num = point.global_step
            self._global_step = point.global_step
            if not self._data_aligned:
                log.warning(
                    "rankwatch: resumed weights from global step %d, but the dataset was not "
                    "aligned; call initial_epoch=bridge.resume(dataset) before model.train",
                    point.global_step,
                )
        # Agree after the first step (it includes graph compilation), then every K.
        self._next_sync = self._global_step + 1
        self._sync_every = 1

        dataset = cb.get("train_dataset")
        batch_size = dataset.get_batch_size() if hasattr(dataset, "get_batch_size") else None
        self._last_step_end = time.perf_counter()
        self._reporter = _Reporter(self, batch_size, point)
        self._reporter.start()
        if self.handle_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def on_train_epoch_begin(self, run_context):
        self._epoch = run_context.original_args().cur_epoch_num

    def on_train_step_begin(self, run_context):
        now = time.perf_counter()
        self._out_total += now - self._last_step_end
        self._step_began = now

    def on_train_step_end(self, run_context):
        now = time.perf_counter()
        dt = now - self._last_step_end
        self._last_step_end = now
        self._in_total += now - self._step_began
        self._steps_total += 1
        self._global_step += 1
        self._step_times.append(dt)
        self._interval_time += dt
        self._interval_steps += 1
        if now >= self._reporter.loss_due:
            self._reporter.take_loss(run_context.original_args().net_outputs)
        if self._global_step >= self._next_sync:
            self._agree(run_context)

    def on_train_end(self, run_context):
        self._restore_sigterm()
        reporter = self._reporter
        if reporter is None:
            return
        if self._stopping:
            reporter.set_stage("exited")
            reporter.state = "exited"
        else:
            reporter.state = "finished"
        reporter.close()

    # ------------------------------------------------------------- agreement
    def _agree(self, run_context) -> None:
        """Vote at an agreed step: stop if any rank saw a request; pick the next step."""
        started = time.perf_counter()
        votes, mean_step_s, agree_cost_s = self._vote()
        took = time.perf_counter() - started
        cost = self._reporter.cost
        if cost["agreements"]:
            cost["agree_ms"] += took * 1e3
            # A moving average: one agreement that waited out a peer's hiccup
            # should not stretch the interval for long.
            self._agree_cost_s += 0.3 * (took - self._agree_cost_s) if cost["agreements"] > 1 else took
        else:  # the first one compiles the AllReduce graph: a one-off, kept apart
            cost["first_agree_ms"] = round(took * 1e3, 3)
        cost["agreements"] += 1
        self._sync_every = self._next_interval(mean_step_s, agree_cost_s)
        self._next_sync = self._global_step + self._sync_every
        self._reporter.sync_every = self._sync_every
        if self._reporter.state == "starting":
            self._reporter.state = "training"
        if votes > 0 and not self._stopping:
            self._stop(run_context)

    def _vote(self) -> tuple[float, float, float]:
        """(ranks voting stop, mean step time, mean agreement cost), the same on every rank."""
        if self._reporter.request is not None:
            # Re-read before voting stop: a cancel written since the last
            # poll then wins, unless the vote has already begun elsewhere.
            self._reporter.read_flag_now()
        mine = 1.0 if self._reporter.request is not None or self._sigterm_count else 0.0
        mean = self._interval_time / self._interval_steps if self._interval_steps else 0.0
        self._interval_time, self._interval_steps = 0.0, 0
        if self._vote_op is None:
            return mine, mean, self._agree_cost_s
        out = self._vote_op(Tensor(np.array([mine, mean, self._agree_cost_s], np.float32))).asnumpy()
        return float(out[0]), float(out[1]) / self._world, float(out[2]) / self._world

    def _next_interval(self, mean_step_s: float, agree_cost_s: float = 0.0) -> int:
        if mean_step_s <= 0:
            return 1
        for_latency = int(self.sync_interval_s / mean_step_s)
        for_cost = math.ceil(agree_cost_s / (self.max_overhead * mean_step_s))
        return max(1, min(self.max_sync_every, max(for_latency, for_cost)))

    def _agree_on_resume(self, point: ResumePoint) -> None:
        """Fail fast, on every rank together, if ranks found different resume sets."""
        if self._vote_op is None:
            return
        # The same shape as a vote, so the graph compiled here serves the votes.
        out = self._vote_op(Tensor(np.array([point.global_step, 0.0, 0.0], np.float32))).asnumpy()
        if abs(float(out[0]) - point.global_step * self._world) > 0.5:
            raise RuntimeError(
                f"GracefulExitBridge: rank {self._rank} would resume from global step "
                f"{point.global_step}, but the ranks disagree (sum {out[0]:.0f}); "
                f"check that every rank sees the same {self.run_dir}/checkpoints"
            )

    def _stop(self, run_context) -> None:
        cb = run_context.original_args()
        self._stopping = True
        reporter = self._reporter
        request = reporter.request
        if request is None and not self._sigterm_count:
            # Another rank saw the flag first: read it now for its request id.
            request = reporter.read_flag_now()
        if request is not None:
            request_id, source = request.request_id or "native-flag", "flag"
        else:
            request_id, source = f"sigterm-{int(time.time())}", "sigterm"
        reporter.begin_stop(request_id, source, stop_step=self._global_step)
        if self.save_checkpoint and not self._native:
            self._save(cb, request_id)
        run_context.request_stop()

    def _save(self, cb, request_id: str) -> None:
        per_epoch = self._batch_num or 1
        step_in_epoch = (self._global_step - 1) % per_epoch + 1
        path = runfiles.checkpoint_path(self.run_dir, self._rank, self._epoch, step_in_epoch)
        append = {
            "epoch_num": self._epoch,
            "step_num": self._global_step,
            "batch_num": per_epoch,
            "rankwatch_request_id": request_id,
            "rankwatch_rank": self._rank,
            "rankwatch_world_size": self._world,
        }
        # MindSpore optimizers keep a `global_step` Parameter, saved with the
        # network. Adding the key again (as OnRequestExit does) replaces that
        # shape-(1,) tensor with a scalar, and the file no longer loads.
        if "global_step" not in {p.name for p in cb.train_network.get_parameters()}:
            append["global_step"] = self._global_step
        self._reporter.set_stage("saving")
        self._reporter.state = "saving"
        started = time.perf_counter()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            ms.save_checkpoint(cb.train_network, str(path), append_dict=append)
            seconds = time.perf_counter() - started
            self._reporter.saved(path, path.stat().st_size, seconds)
        except (OSError, RuntimeError, ValueError) as e:
            log.error("rankwatch: rank %d could not save its checkpoint to %s: %s", self._rank, path, e)
            self._reporter.save_failed(f"{type(e).__name__}: {e}")

    # --------------------------------------------------------------- signals
    def _on_sigterm(self, signum, frame):
        self._sigterm_count += 1
        if self._sigterm_count == 1:
            self._reporter.saw_request(None, "sigterm", self._global_step)
            return
        # A second SIGTERM means "now": hand over to the previous behaviour.
        self._restore_sigterm()
        os.kill(os.getpid(), signal.SIGTERM)

    def _restore_sigterm(self):
        previous = getattr(self, "_previous_sigterm", None)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
            self._previous_sigterm = None


class _Reporter:
    """The bridge's one background thread: flag watcher and heartbeat writer.

    The training thread only sets attributes here; this thread turns them
    into files. ``close()`` writes the last heartbeat and is safe to call twice.
    """

    def __init__(self, bridge: GracefulExitBridge, batch_size: int | None, resumed: ResumePoint | None):
        self.bridge = bridge
        self.run_dir = bridge.run_dir
        self.rank, self.world = bridge._rank, bridge._world
        self.batch_size = batch_size
        self.state = "starting"
        self.sync_every = 1
        # What the bridge itself costs this rank (README, heartbeat "bridge_cost").
        self.cost = {"agreements": 0, "agree_ms": 0.0, "first_agree_ms": None, "reporter_cpu_ms": 0.0}
        self.loss: float | None = None
        self.loss_due = 0.0
        self.request: runfiles.Flag | None = None
        self.stop: dict | None = None
        self.error: str | None = None
        self.warnings: list[str] = []
        self.resumed_from = None
        if resumed is not None:
            self.resumed_from = {
                "global_step": resumed.global_step,
                "epoch": resumed.epoch,
                "path": os.path.relpath(resumed.path, self.run_dir),
            }
        self._totals = (0.0, 0.0, 0)  # (in, out, steps) at the previous heartbeat
        self._last_step_ms = None
        self._window = {
            "step_time_mean_ms": None,
            "step_in_ms": None,
            "step_out_ms": None,
            "samples_per_s": None,
        }
        self._flag_sig = None
        self._bad_flag_logged: set = set()
        self._logged: set[str] = set()
        self._seq = 0
        self._started_at = time.time()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()  # one writer at a time: the thread, or close()
        self._flag_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rankwatch-reporter", daemon=True)
        self._device = DeviceProbe()
        self._process = None
        self._host = socket.gethostname()
        # stacks (trainer_bridge/stacks.py): built here, on the training thread, which it marks.
        self.stacks = StackWatcher(self.run_dir, self.rank, self._host)

    # ------------------------------------------------ training-thread side
    def take_loss(self, outputs) -> None:
        """Convert the loss about once a heartbeat; every step would cost a device sync."""
        self.loss_due = time.perf_counter() + self.bridge.heartbeat_interval_s
        try:
            value = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
            self.loss = float(value.asnumpy().reshape(-1)[0])
        except (AttributeError, IndexError, TypeError, ValueError, RuntimeError):
            self.loss = None

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

    def write_now(self) -> None:
        """Write a heartbeat synchronously: stop stages must not wait for the next tick."""
        self._write_heartbeat()

    def read_flag_now(self) -> runfiles.Flag | None:
        self._poll_flag(force=True)
        return self.request

    # ------------------------------------------------------ thread side
    def start(self) -> None:
        try:
            runfiles.state_dir(self.run_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._report_io_error(e)
        if self.rank == 0:
            self._write_job()
        self._write_heartbeat()
        self._thread.start()
        atexit.register(self.close)
        self._chain_excepthook()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        self._write_heartbeat()

    def _run(self) -> None:
        next_beat = 0.0
        while not self._closed.is_set():
            cpu = time.thread_time()
            try:
                self._poll_flag()
                # stacks: answer requests, and capture once when no step ends for too long.
                self.stacks.poll(
                    steps=self.bridge._steps_total,
                    since_step_s=time.perf_counter() - self.bridge._last_step_end,
                    step_s=(self._window["step_time_mean_ms"] or 0.0) / 1e3,
                    global_step=self.bridge._global_step,
                    stepping=self.state in ("training", "stopping"),
                )
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.bridge.heartbeat_interval_s
                    self._write_heartbeat(history=True)
            except Exception as e:  # the reporter must never die: log once per kind
                self._log_once(
                    f"reporter:{type(e).__name__}",
                    "rankwatch: reporter error (training continues): %s",
                    e,
                    exc_info=True,
                )
            self.cost["reporter_cpu_ms"] += (time.thread_time() - cpu) * 1e3
            self._wake.wait(self.bridge.poll_interval_s)
            self._wake.clear()

    def _poll_flag(self, force: bool = False) -> None:
        # The reporter thread polls; the training thread forces a read before
        # it votes with a pending request. One at a time.
        with self._flag_lock:
            self._poll_flag_locked(force)

    def _poll_flag_locked(self, force: bool) -> None:
        path = runfiles.flag_path(self.run_dir)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._flag_sig = None
            self._withdraw("the flag file was removed")
            return
        except OSError as e:
            self._log_once(f"flagstat:{e.errno}", "rankwatch: cannot stat %s: %s", path, e)
            return
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        if sig == self._flag_sig and not force:
            return
        self._flag_sig = sig
        try:
            flag = runfiles.parse_flag(runfiles.read_capped(path))
        except (OSError, runfiles.FlagError, runfiles.FileTooLarge) as e:
            # Garbage or a torn write: log it once per distinct file, keep training.
            if sig not in self._bad_flag_logged:
                self._bad_flag_logged.add(sig)
                log.warning("rankwatch: ignoring unreadable stop flag %s: %s", path, e)
            return
        # A request the ranks already saved for is stale (llnl/scr#13): it
        # must not stop the relaunch.
        if not flag.exit or self.bridge._served.covers(flag, st.st_mtime):
            self._withdraw("the flag no longer says stop (cancelled)")
            return
        if self.request is None:
            self.request = flag
            self.saw_request(flag, "flag", self.bridge._global_step)

    def _withdraw(self, why: str) -> None:
        """Drop a request this rank saw but has not voted through: the operator cancelled it."""
        if self.request is None or self.bridge._stopping:
            return
        log.warning("rankwatch: stop request %s withdrawn: %s", self.request.request_id, why)
        self.request = None
        if self.stop is not None and self.stop.get("source") == "flag":
            self.stop = None
            self.state = "training"
            self._wake.set()

    def _heartbeat(self) -> schema.Heartbeat:
        bridge = self.bridge
        times = []
        while True:
            try:
                times.append(bridge._step_times.popleft())
            except IndexError:
                break
        times_ms = [round(t * 1000.0, 3) for t in times]
        if times_ms:
            self._last_step_ms = times_ms[-1]
        per_epoch = bridge._batch_num or 0
        gstep = bridge._global_step
        cpu, rss = self._process_stats()
        totals = (bridge._in_total, bridge._out_total, bridge._steps_total)
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
            epoch=bridge._epoch,
            step=(gstep - 1) % per_epoch + 1 if per_epoch and gstep else 0,
            global_step=gstep,
            loss=self.loss,
            step_time_ms=self._last_step_ms,
            **self._window,
            step_times_ms=times_ms,
            batch_size=self.batch_size,
            cpu_percent=cpu,
            rss_bytes=rss,
            device=self._device.sample(),
            time=time.time(),
            last_step_at=self._last_step_at(),
            started_at=self._started_at,
            seq=self._seq,
            sync_every=self.sync_every,
            bridge_cost={k: round(v, 3) if isinstance(v, float) else v for k, v in self.cost.items()},
            stop=self.stop,
            resumed_from=self.resumed_from,
            error=_clip(self.error, schema.MAX_ERROR),
            warnings=[_clip(w, schema.MAX_WARNING) for w in self.warnings[-schema.MAX_WARNINGS :]],
        )

    def _last_step_at(self) -> float | None:
        """Wall time of the last step end, from the perf_counter the step hook already read."""
        if not self.bridge._global_step:
            return None
        return time.time() - (time.perf_counter() - self.bridge._last_step_end)

    def _process_stats(self):
        import psutil

        try:
            if self._process is None:
                self._process = psutil.Process()
                self._process.cpu_percent(None)  # the first call only primes the counter
            return self._process.cpu_percent(None), self._process.memory_info().rss
        except psutil.Error:
            return None, None

    def _write_heartbeat(self, history: bool = False) -> None:
        with self._lock:
            try:
                beat = self._heartbeat()
            except schema.SchemaError as e:  # a bridge bug must not reach the training thread
                self._log_once("schema", "rankwatch: heartbeat not written (training continues): %s", e)
                return
            try:
                # No fsync: os.replace already keeps readers from torn files,
                # and a heartbeat lost to a power cut is replaced a second later.
                runfiles.atomic_write_bytes(
                    runfiles.heartbeat_path(self.run_dir, self.rank), beat.to_json(), fsync=False
                )
                if history:
                    self._append_history(beat)
            except OSError as e:
                self._report_io_error(e)

    def _append_history(self, beat: schema.Heartbeat) -> None:
        path = runfiles.history_path(self.run_dir, self.rank)
        line = schema.HistoryLine.of(beat).to_json() + b"\n"
        try:
            if path.stat().st_size + len(line) > runfiles.HISTORY_SEGMENT_BYTES:
                os.replace(path, f"{path}.1")
        except FileNotFoundError:
            pass
        with open(path, "ab") as f:
            f.write(line)

    def _report_io_error(self, e: OSError) -> None:
        message = f"cannot write to {runfiles.state_dir(self.run_dir)}: {e.strerror or e}"
        if message not in self.warnings:
            self.warnings.append(message)
        self._log_once(f"io:{e.errno}", "rankwatch: %s (training continues)", message)

    def _write_job(self) -> None:
        try:
            job = schema.build(
                schema.Job,
                world_size=self.world,
                started_at=self._started_at,
                host=self._host,
                pid=os.getpid(),
                argv=[_clip(a, schema.MAX_PATH) for a in sys.argv[:256]],
                checkpoint_dir=runfiles.CHECKPOINT_DIR,
                sync_interval_s=self.bridge.sync_interval_s,
            )
            runfiles.atomic_write_bytes(runfiles.job_path(self.run_dir), job.to_json())
        except OSError as e:
            self._report_io_error(e)
        except schema.SchemaError as e:
            self._log_once("schema-job", "rankwatch: job.json not written (training continues): %s", e)

    def _chain_excepthook(self) -> None:
        """Mark the rank failed if the script dies of an exception, then defer to the old hook."""
        previous = sys.excepthook

        def hook(kind, value, tb):
            if not self._closed.is_set():
                self.state = "failed"
                self.error = f"{kind.__name__}: {value}"
                self.close()
            previous(kind, value, tb)

        sys.excepthook = hook

    def _log_once(self, key: str, msg: str, *args, **kwargs) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args, **kwargs)
