"""The engine both front ends drive: one run of training seen from one rank.

``GracefulExitBridge`` (the ``Model.train`` callback) and ``bridge.loop``
(the functional loop) are thin: each tells the engine when training begins,
when a step begins and ends, and what state to save and load; the engine
does the rest. It is built around three rules:

* **The step hooks are cheap.** ``step_begin`` and ``step_end`` read the
  clock, add to running totals (``reporter.Counters``), append to a deque and
  compare two integers. Files and the flag are the reporter's
  (``reporter.Reporter``): at agreement steps once a heartbeat is due, and on
  a thread of its own only while agreements do not come.
* **Agreement is amortised** (``agreement.py``): one float32 SUM AllReduce
  every *K* steps, at global steps every rank computes alike.
* **Nothing the dashboard does can hurt training.** A bad flag is logged once
  and ignored, a full disk is logged once and reported, a reporter bug is
  logged and the reporter carries on. Only a stop request stops training.

On Ascend with ``MS_ENABLE_GRACEFUL_EXIT=1`` MindSpore's in-graph exit works,
so the engine only reports there and leaves stopping to ``OnRequestExit``.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from pathlib import Path

import mindspore as ms

from trainer_bridge import saving
from trainer_bridge.agreement import Agreement
from trainer_bridge.collective import sum_all_reduce, world
from trainer_bridge.counters import Counters
from trainer_bridge.gasp import Gasp
from trainer_bridge.launcher_tty import tell_launcher
from trainer_bridge.reporter import Reporter
from trainer_bridge.rundir import attempts, ckpthealth, launchguard, rollbacks
from trainer_bridge.rundir.ckptindex import scan
from trainer_bridge.saving import NOTHING_SERVED, ResumePoint
from trainer_bridge.settings import Settings

log = logging.getLogger("trainer_bridge")
# How long a rank that joins a stop it did not see waits for the flag to reach its own run directory.
PEER_FLAG_WAIT_S = 3.0


class LaunchRefused(RuntimeError):
    """Another launch's ranks are alive in this run directory: this one does not start."""


class Engine:
    """One rank's run: resume, step accounting, agreement, stop, save, signals.

    Call order: ``find_resume()`` (any time before; with several ranks its
    first call is a collective, made at the same point on every rank as the
    front ends do), ``begin()``, then per
    step ``step_begin()`` and ``step_end()``, then ``end()``. ``step_end``
    returns True once the ranks agreed to stop and this rank saved: the
    front end then ends training.
    """

    def __init__(self, run_dir: Path, settings: Settings):
        self.run_dir = run_dir
        self.settings = settings
        self.resume_point: ResumePoint | None = None
        self.served = NOTHING_SERVED
        self.stopped = False
        self.reported_loss = None  # the functional loop's bridge.report(loss=...)
        self.reported_grad_norm = None  # and its grad_norm=...
        self.in_step = False
        self.reporter: Reporter | None = None
        self.counters: Counters | None = None
        self._resume_checked = False
        self._resume_agreed = False
        self._carrier = None
        self._stopping = False
        self._sigterm_count = 0
        self._previous_sigterm = None
        self.launch: str | None = None
        self.attempts: attempts.AttemptLog | None = None

    # ----------------------------------------------------------------- resume
    def find_resume(self) -> ResumePoint | None:
        """One scan of the run directory: the set to resume from and the requests already served."""
        if not self._resume_checked:
            self._resume_checked = True
            rank, size = world()
            index = scan(self.run_dir, world_size=size)
            self.served = saving.served_requests(index)
            if self.settings.resume:
                unhealthy = ckpthealth.unhealthy(self.run_dir, index)
                if size > 1 and self.settings.resume_step is None:
                    # Agreed, not read: without a shared filesystem no node sees a whole set.
                    points = saving.own_resume_points(index, rank, unhealthy)
                    self.resume_point = saving.agree_resume(self._vote_carrier(size), rank, size, points)
                    self._resume_agreed = True
                else:
                    self.resume_point = saving.find_resume_point(
                        index, rank, self.settings.resume_step, unhealthy
                    )
        return self.resume_point

    def _vote_carrier(self, world: int):
        """The one compiled SUM AllReduce (``sum_all_reduce``) every collective here uses; None alone."""
        if world <= 1:
            return None
        if self._carrier is None:
            self._carrier = sum_all_reduce()
        return self._carrier

    def resume_position(self, per_epoch: int, epochs: int | None) -> tuple[int, int, bool]:
        """(first epoch, 0-based; batches of it already trained; nothing left to train).

        Nothing is left when the set resumed from already covers the
        ``epochs`` asked for (a relaunch with fewer epochs than the stop was
        in): ``Model.train`` would refuse an ``initial_epoch`` at or past its
        ``epoch``, so both front ends say so here and train nothing.
        """
        point = self.find_resume()
        if point is None:
            return 0, 0, False
        first, skip = saving.data_position(self.data_step(point), per_epoch)
        over = epochs is not None and first >= epochs
        if over:
            log.warning(
                "rankwatch: resumed at global step %d, past the %d epochs asked for: nothing to train",
                point.global_step,
                epochs,
            )
        return first, skip, over

    def data_step(self, point: ResumePoint) -> int:
        """Where the data and the step count go on from: ``point``'s step, or past a rollback's skip.

        A loss-spike rollback (``rankwatch launch``) pins the set and sets
        ``RANKWATCH_SKIP_FROM``/``RANKWATCH_SKIP_BATCHES``: the weights are the
        set's, the data resumes ``rollbacks.data_step`` batches in, through the
        same ``Dataset.set_init_step`` as any resume (both front ends). The
        skipped batches keep their step numbers, untrained, so a global step
        stays a data position and a later resume lines the data up as ever.
        """
        if self.settings.resume_step is None:
            return point.global_step  # only a pinned relaunch carries a rollback's skip
        return rollbacks.data_step(point.global_step, os.environ)

    # -------------------------------------------------------------- lifecycle
    def begin(
        self,
        cells,
        *,
        epoch: int,
        per_epoch: int | None,
        global_step: int,
        batch_size,
        front_end: str = "callback",
    ) -> int:
        """Start reporting; resume ``cells`` (what a stop saves) if a set is found.

        Returns the global step training continues after (the resumed set's, or ``global_step``).
        """
        s = self.settings
        self.rank, self.world = world()
        self.cells = list(cells)
        try:
            # The run directory is the user's own path (a symlink in it is
            # theirs to make); below it the bridge follows none.
            os.makedirs(self.run_dir, exist_ok=True)
        except OSError as e:  # reported by every write that then fails; training continues
            log.warning("rankwatch: cannot make the run directory %s: %s", self.run_dir, e)
        self.stopped = False
        self._stopping = False
        self._sigterm_count = 0
        point = self.find_resume()
        self.native = (
            os.environ.get("MS_ENABLE_GRACEFUL_EXIT") == "1" and ms.get_context("device_target") == "Ascend"
        )
        vote_sum = None if self.native else self._vote_carrier(self.world)
        beats = self._guard_launch(vote_sum)
        if point is not None:
            if not self._resume_agreed:  # a pinned set is read, not agreed: check that all read the same
                self._agree_on_resume(vote_sum, point)
            missing = saving.load_state(point.path, self.cells)
            if missing:
                log.warning(
                    "rankwatch: %s had no value for %d parameters (%s...); they keep their initial values",
                    point.path,
                    len(missing),
                    ", ".join(missing[:3]),
                )
            global_step = self.data_step(point)
            if global_step > point.global_step:
                log.warning(
                    "rankwatch: loss-spike rollback: the weights of global step %d, the data from global step "
                    "%d on (%d batches skipped, untrained)",
                    point.global_step,
                    global_step + 1,
                    global_step - point.global_step,
                )
            # Loaded once: a second run on the same bridge goes on from its own weights.
            self.resume_point = None
        self.counters = Counters(epoch, per_epoch, global_step)
        self.agreement = Agreement(
            vote_sum,
            self.world,
            global_step,
            sync_interval_s=s.sync_interval_s,
            max_overhead=s.max_overhead,
            max_sync_every=s.max_sync_every,
        )
        self._step_began = 0.0
        self.in_step = False
        self.reporter = Reporter(
            self.run_dir,
            self.rank,
            self.world,
            self.counters,
            served=self.served,
            heartbeat_interval_s=s.heartbeat_interval_s,
            poll_interval_s=s.poll_interval_s,
            sync_interval_s=s.sync_interval_s,
            batch_size=batch_size,
            resumed=point,
            front_end=front_end,
            launch=self.launch,
            attempts=self.attempts,
        )
        self._begin_attempt(point, global_step, beats)
        self.reporter.gasp = Gasp(
            self.run_dir,
            self.rank,
            self.world,
            self.launch,
            self.cells,
            self.counters,
            lambda: time.perf_counter() - self._step_began if self.in_step else None,
            lambda: self.reporter.loss,
        )
        self.reporter.start()
        if s.handle_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.counters.last_step_end = time.perf_counter()
        return global_step

    def _guard_launch(self, vote_sum) -> list[tuple[int, dict]]:
        """Refuse to start beside a live launch of another job; agree on this launch's id.

        Rank 0 reads the heartbeats before any rank of this launch writes one
        (every rank waits in the AllReduce below until rank 0 has looked), so
        whatever is alive there belongs to another launch. The same
        AllReduce carries rank 0's verdict and its random launch id (two
        24-bit halves, exact in float32) to every rank: all refuse together,
        and all heartbeats of this launch carry one id. Returns rank 0's
        heartbeats (the previous launch's), for its start line.
        """
        if self.launch is not None:
            return []  # a second run on the same bridge: the same launch
        beats: list[tuple[int, dict]] = []
        live: list[launchguard.LiveRank] = []
        halves = (0, 0)
        if self.rank == 0:
            halves = (secrets.randbelow(1 << 24), secrets.randbelow(1 << 24))
            try:
                beats, live = launchguard.live_others(
                    self.run_dir,
                    host=socket.gethostname(),
                    now=time.time(),
                    own_pid=os.getpid(),
                    ended=os.environ.get(launchguard.ENDED_ENV) or None,
                )
            except Exception as e:  # noqa: BLE001 - a bad run directory must not stop training here
                log.warning("rankwatch: could not check for another launch (training continues): %s", e)
                beats, live = [], []
        # Native mode keeps the step votes in MindSpore's graph, but the launch check needs one collective too.
        carrier = self._vote_carrier(self.world)
        refused = float(bool(live))
        if carrier is not None:
            refused, a, b = carrier(refused, float(halves[0]), float(halves[1]))
            halves = (int(a), int(b))
        if refused > 0.5:
            message = (
                launchguard.refusal(self.run_dir, live)
                if live
                else f"rankwatch: refusing to start: rank 0 found another launch's ranks alive in "
                f"{self.run_dir} (rank 0's log names them)"
            )
            log.error("%s", message)
            if self.rank == 0:
                # The page and msrun's terminal: the worker log alone is read by nobody.
                here = launchguard.refusal("this run directory", live) if live else message
                attempts.note_refusal(self.run_dir, here, self.world, socket.gethostname(), os.getpid())
                tell_launcher(message)
            raise LaunchRefused(message)
        self.launch = f"{halves[0]:06x}{halves[1]:06x}"
        if self.rank == 0:
            self.attempts = attempts.AttemptLog(
                self.run_dir, self.launch, self.world, socket.gethostname(), os.getpid()
            )
        return beats

    def _begin_attempt(self, point: ResumePoint | None, global_step: int, beats) -> None:
        """Rank 0: this launch's start line in attempts.jsonl, and one line on the terminal."""
        log_ = self.attempts
        if log_ is None or log_.number is not None:
            return
        skipped = (
            [point.global_step + 1, global_step]
            if point is not None and global_step > point.global_step
            else None
        )
        log_.begin(
            started_at=self.reporter.started_at,
            resumed=point,
            first_step=global_step + 1,
            beats=beats,
            skipped=skipped,
        )
        what = "a fresh start" if point is None else attempts.resumed_text(point.global_step, point.set_id)
        again = (
            f"; it trains global steps {log_.replayed[0]}-{log_.replayed[1]} again" if log_.replayed else ""
        )
        number = f"attempt {log_.number} of this run, " if log_.number else ""
        log.warning("rankwatch: %s%s%s", number, what, again)

    def step_begin(self) -> None:
        now = time.perf_counter()
        self.counters.out_total += now - self.counters.last_step_end
        self._step_began = now
        self.in_step = True

    def step_end(self, outputs=None, step_num: int | None = None, grad_norm=None) -> bool:
        """Account one step (or, in sink mode, the steps up to ``step_num``); True: stop now.

        ``outputs``: the step's loss (a Tensor, a float, or a tuple starting
        with it), converted about once a heartbeat, as is ``grad_norm`` (the
        functional loop's ``bridge.report(grad_norm=...)``; ``Model.train``
        has no norm to give).
        """
        now = time.perf_counter()
        c = self.counters
        dt = now - c.last_step_end
        c.last_step_end = now
        steps = step_num - c.global_step if step_num is not None and step_num > c.global_step else 1
        c.in_total += now - self._step_began
        self.in_step = False
        c.steps_total += steps
        c.global_step += steps
        c.step_times.append(dt / steps)
        if now >= self.reporter.loss_due and outputs is not None:
            self.reporter.take_loss(outputs, grad_norm, c.global_step)
        if self.agreement.due(c.global_step, dt, steps):
            return self._agree()
        return False

    def end(self) -> None:
        self._restore_sigterm()
        reporter = self.reporter
        if reporter is None:
            return
        if self._stopping:
            reporter.set_stage("exited")
            reporter.state = "exited"
        else:
            reporter.state = "finished"
        reporter.close()

    # ------------------------------------------------------------- agreement
    def _agree(self) -> bool:
        """Vote at an agreed step: stop if any rank saw a request; pick the next step."""
        reporter, c = self.reporter, self.counters
        reporter.on_agreement()  # its flag poll first: a request it finds is voted now
        if reporter.request is not None:
            # Re-read before voting stop: a cancel written since the last
            # poll then wins, unless the vote has already begun elsewhere.
            reporter.read_flag_now()
        mine = reporter.request is not None or self._sigterm_count > 0
        votes = self.agreement.vote(mine, c.global_step)
        a = self.agreement
        c.sync_every, c.agreements, c.agree_ms, c.first_agree_ms = (
            a.sync_every,
            a.agreements,
            a.agree_ms,
            a.first_agree_ms,
        )
        if reporter.state == "starting":
            reporter.state = "training"
        if votes > 0 and not self._stopping:
            self._stop()
            return True
        return False

    def _agree_on_resume(self, vote_sum, point: ResumePoint) -> None:
        """Fail fast, on every rank together, if ranks found different resume sets."""
        if vote_sum is None:
            return
        # The same shape as a vote, so the graph compiled here serves the votes.
        total = vote_sum(float(point.global_step), 0.0, 0.0)[0]
        if abs(total - point.global_step * self.world) > 0.5:
            raise RuntimeError(
                f"GracefulExitBridge: rank {self.rank} would resume from global step "
                f"{point.global_step}, but the ranks disagree (sum {total:.0f}); "
                f"check that every rank sees the same {self.run_dir}/checkpoints"
            )

    def _stop(self) -> None:
        self._stopping = True
        self.stopped = True
        reporter = self.reporter
        request = reporter.request
        if request is None and not self._sigterm_count:
            # Another rank saw the flag first: read it now for its request id. Where each node
            # keeps its own run directory, its agent writes the flag up to a tick later than
            # another node's saw it: wait for it a little (the ranks have agreed to stop; a
            # peer's SIGTERM, whose flag never comes, costs this rank PEER_FLAG_WAIT_S).
            deadline = time.monotonic() + PEER_FLAG_WAIT_S
            request = reporter.read_flag_now()
            while request is None and time.monotonic() < deadline:
                time.sleep(0.05)
                request = reporter.read_flag_now()
        if request is not None:
            request_id, source = request.request_id or "native-flag", "flag"
        else:
            request_id, source = f"sigterm-{int(time.time())}", "sigterm"
        reporter.begin_stop(request_id, source, stop_step=self.counters.global_step)
        if self.settings.save_checkpoint and not self.native:
            self._save(request_id)

    def _save(self, request_id: str) -> None:
        c = self.counters
        path = saving.checkpoint_file(self.run_dir, self.rank, c.epoch, c.global_step, c.per_epoch)
        reporter = self.reporter
        reporter.set_stage("saving")
        reporter.state = "saving"
        started = time.perf_counter()
        try:
            append = saving.append_fields(
                epoch=c.epoch,
                global_step=c.global_step,
                per_epoch=c.per_epoch,
                request_id=request_id,
                rank=self.rank,
                world=self.world,
                param_names=saving.param_names(self.cells),
                loss=self.reporter.loss,
            )
            saving.save_state(self.cells, path, append)
            seconds = time.perf_counter() - started
            reporter.saved(path, path.stat().st_size, seconds)
        except (OSError, RuntimeError, ValueError, TypeError) as e:
            log.error("rankwatch: rank %d could not save its checkpoint to %s: %s", self.rank, path, e)
            reporter.save_failed(f"{type(e).__name__}: {e}")

    # --------------------------------------------------------------- signals
    def _on_sigterm(self, signum, frame):
        self._sigterm_count += 1
        if self._sigterm_count == 1:
            self.reporter.saw_request(None, "sigterm", self.counters.global_step)
            return
        # A second SIGTERM means "now": hand over to the previous behaviour.
        self._restore_sigterm()
        os.kill(os.getpid(), signal.SIGTERM)

    def _restore_sigterm(self):
        previous = self._previous_sigterm
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
            self._previous_sigterm = None
