"""``GracefulExitBridge``: connects a trainer to Rankwatch, from ``Model.train`` or a functional loop.

The class has two thin front ends on one engine (``trainer_bridge/engine.py``):

* as a ``Model.train`` callback: ``model.train(..., callbacks=[bridge])``;
* as an iterator for functional loops: ``for x, y in bridge.loop(dataset,
  network=net, optimizer=opt, epochs=N)``, with ``bridge.report(loss=...)``.

Either way the engine reports the rank (``reporter.py``), agrees with the
other ranks on a stop (``agreement.py``), saves and resumes (``saving.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from mindspore.train import Callback

from trainer_bridge import loop as _loop
from trainer_bridge.engine import Engine, LaunchRefused
from trainer_bridge.saving import ResumePoint, Served, find_resume_point, served_requests
from trainer_bridge.settings import Settings

__all__ = [
    "GracefulExitBridge",
    "LaunchRefused",
    "ResumePoint",
    "Served",
    "find_resume_point",
    "served_requests",
]

log = logging.getLogger("trainer_bridge")


class GracefulExitBridge(Callback):
    """Reports this rank to Rankwatch and stops it gracefully on request.

    Args:
        run_dir: the run directory shared with the dashboard; made (with its
            parents) when it is missing.
        sync_interval_s: target seconds between stop agreements. It bounds the
            stop latency from the flag being seen to every rank agreeing.
        heartbeat_interval_s: seconds between heartbeat writes.
        poll_interval_s: seconds between the reporter's looks at the flag and the
            stack requests (at agreement steps while they come, else on its
            thread); a stop waits up to this long, plus an agreement, for the
            flag to be seen. The default looks once a second, with the heartbeat.
        max_sync_every: the most steps between agreements, whatever the step time.
        max_overhead: the largest share of training time agreements may take;
            above it the interval stretches beyond ``sync_interval_s``.
        resume: load the newest complete checkpoint set when training begins.
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
        poll_interval_s: float = 1.0,
        max_sync_every: int = 1000,
        max_overhead: float = 0.003,
        resume: bool = True,
        resume_step: int | None = None,
        save_checkpoint: bool = True,
        handle_sigterm: bool = True,
    ):
        super().__init__()
        self.run_dir = Path(run_dir)
        self.settings = Settings(
            sync_interval_s=sync_interval_s,
            heartbeat_interval_s=heartbeat_interval_s,
            poll_interval_s=poll_interval_s,
            max_sync_every=max_sync_every,
            max_overhead=max_overhead,
            resume=resume,
            resume_step=resume_step,
            save_checkpoint=save_checkpoint,
            handle_sigterm=handle_sigterm,
        )
        self._engine = Engine(self.run_dir, self.settings)
        self._data_aligned = False
        self._finished = False

    @property
    def stopped(self) -> bool:
        """True once training ended (or is ending) on an agreed stop request or SIGTERM."""
        return self._engine.stopped

    @property
    def global_step(self) -> int:
        """The global step: inside a step, its number (from 1); between steps, the last one trained.

        Steps count from the checkpoint resumed from, so a run resumed at G sees G+1 first.
        """
        engine = self._engine
        if engine.counters is None:
            return 0
        return engine.counters.global_step + engine.in_step

    @property
    def epoch(self) -> int:
        """The epoch (from 1) ``global_step`` is in, as ``LossMonitor`` prints it; 0 before training."""
        return self._position()[0]

    @property
    def step_in_epoch(self) -> int:
        """``global_step``'s step within its epoch (from 1), as ``LossMonitor`` prints it; 0 before training."""
        return self._position()[1]

    def _position(self) -> tuple[int, int]:
        engine = self._engine
        step = self.global_step
        per_epoch = engine.counters.per_epoch if engine.counters is not None else None
        if step <= 0:
            return 0, 0
        if not per_epoch:
            return engine.counters.epoch, step
        done, within = divmod(step - 1, per_epoch)
        return done + 1, within + 1

    # ---------------------------------------------------------- functional loop
    def loop(self, dataset, *, network, optimizer, epochs: int = 1):
        """Iterate ``dataset``'s rows (as ``create_tuple_iterator()``) for ``epochs`` epochs, as steps.

        Each row is one step, ended when the next row is asked for. On an
        agreed stop every rank saves ``network`` and ``optimizer`` at the same
        global step and the loop ends (``bridge.stopped`` is then True). On
        start it resumes both from the newest complete set (or the pinned
        one) and skips the rows that set already trained. Leaving the loop
        early (``break``) ends the rank as finished.
        """
        return _loop.rows(self._engine, dataset, network, optimizer, epochs)

    def report(self, *, loss=None, grad_norm=None) -> None:
        """The step's loss (a Tensor or a float) for the heartbeat; converted about once a second.

        ``grad_norm``: the step's global gradient norm, if the script computes
        it (e.g. ``ops.clip_by_global_norm``'s input norm); the dashboard's
        spike detector judges it beside the loss. Never computed here: that
        would be a collective the script did not ask for.
        """
        self._engine.reported_loss = loss
        self._engine.reported_grad_norm = grad_norm

    # ----------------------------------------------------------------- Model.train
    def resume(self, dataset=None, epochs: int | None = None) -> int:
        """Find the set to resume from; return the ``initial_epoch`` for ``Model.train``.

        Pass the training dataset so it starts at the step after the
        checkpoint (``Dataset.set_init_step`` skips the finished part of that
        epoch). Call it before ``model.train(..., initial_epoch=...)``, on every
        rank: the ranks agree on the set (each node may hold only its own ranks' files).

        Pass ``epochs`` (``Model.train``'s) too: if the set already covers
        them, it logs why, reports the rank finished and sets ``finished``;
        skip ``model.train`` then, which refuses such an ``initial_epoch``.
        """
        if dataset is None or self._engine.find_resume() is None:
            return 0
        size = dataset.get_dataset_size()
        initial_epoch, skip, nothing_left = self._engine.resume_position(size, epochs)
        if nothing_left:
            batch = dataset.get_batch_size() if hasattr(dataset, "get_batch_size") else None
            # Reported like a loop with nothing left: begun and ended at once, as finished.
            self._engine.begin([], epoch=initial_epoch + 1, per_epoch=size, global_step=0, batch_size=batch)
            self._engine.end()
            self._finished = True
            return initial_epoch
        if skip:
            dataset.set_init_step(skip)
        self._data_aligned = True
        return initial_epoch

    @property
    def finished(self) -> bool:
        """True when ``resume(dataset, epochs=N)`` found nothing left to train: skip ``model.train``."""
        return self._finished

    def on_train_begin(self, run_context):
        # cb_params is a dict whose missing attributes raise KeyError.
        cb = run_context.original_args()
        dataset = cb.get("train_dataset")
        point = self._engine.find_resume()
        step = self._engine.begin(
            [cb.train_network],
            epoch=cb.get("cur_epoch_num") or 1,
            per_epoch=cb.get("batch_num"),
            global_step=cb.get("cur_step_num") or 0,
            batch_size=dataset.get_batch_size() if hasattr(dataset, "get_batch_size") else None,
        )
        if point is not None:
            cb.cur_step_num = step
            if not self._data_aligned:
                log.warning(
                    "rankwatch: resumed weights from global step %d, but the dataset was not "
                    "aligned; call initial_epoch=bridge.resume(dataset) before model.train",
                    step,
                )

    def on_train_epoch_begin(self, run_context):
        self._engine.counters.epoch = run_context.original_args().cur_epoch_num

    def on_train_step_begin(self, run_context):
        self._engine.step_begin()

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        # Steps count from cur_step_num: in sink mode (Ascend) this hook runs
        # once per sink of sink_size steps.
        if self._engine.step_end(cb.get("net_outputs"), cb.get("cur_step_num")):
            run_context.request_stop()

    def on_train_end(self, run_context):
        self._engine.end()
