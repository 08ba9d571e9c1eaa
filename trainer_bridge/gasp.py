"""The dying gasp: when ``rankwatch launch`` says a peer died or hung, one survivor saves its data-parallel replica.

In a data-parallel job every rank holds the whole model and optimizer
state. A survivor whose peer died (or hangs: the request then names the hung
rank among the dead, and it never answers) is blocked in the gradient AllReduce
(up to ``MS_CPU_COMM_OP_TIMEOUT``, then MindSpore ends it), before its
optimizer update, so its parameters are still those of its last finished
step. The supervisor (``app/supervise``) writes ``RUN/rankwatch/gasp.json``
naming the launch and the dead ranks and holds off its SIGTERM for a short
window; the reporter's thread, which comes back when agreements stop
(``wakeup.py``), sees the file at its next poll and the lowest surviving
rank saves, from that thread, while the training thread stays blocked:

* what: the cells a graceful stop saves (the train network: weights,
  optimizer moments, ``global_step``), per rank, with no collective;
* where: MindIO TTP's layout,
  ``RUN/ttp_checkpoints/ttp_saved_checkpoints-step_{G}/rank_{r}/ttp_rank_{r}-{E}_{S}.ckpt``,
  one copy of the replica for every rank of the job (a set is complete when
  every rank can load its file, and in pure data parallel they are the same
  file), written under ``..._tmp`` and renamed when whole: the index skips
  ``_tmp`` directories, so a save cut short (a full disk) is never a set;
* when not: the job is not pure data parallel, the training thread is not
  blocked (it might be inside an optimizer update), or the step moved while
  saving or within a settling time after it (``SETTLE_MAX_S``: a blocked
  thread stays blocked, a slow one finishes). Then nothing is kept, and the
  answer says why.

Each rank answers in ``RUN/rankwatch/gasp_rank_{r}.json`` (saved, with the
step and the path, or why not), which the supervisor waits for.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from trainer_bridge import saving
from trainer_bridge.rundir import runfiles
from trainer_bridge.rundir.gaspfiles import MAX_REQUEST_BYTES, answer_path, request_path, set_dir

log = logging.getLogger("trainer_bridge")

# The training thread counts as blocked in a collective once its step has run this long (and
# longer than a few of its usual steps): a step that still computes might be updating weights.
BLOCKED_MIN_S = 1.0
# After the save, the step must stay unfinished this long again (at most SETTLE_MAX_S, within the
# supervisor's 5 s window): a thread blocked in a collective stays there until its timeout, one that
# was only slow (a loaded machine) finishes its step and its save is dropped. A CI run under
# stress-ng saved a replica mid-update once without this.
SETTLE_MAX_S = 2.0


class Gasp:
    """Polled from the reporter's tick; saves once per launch at most."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world: int,
        launch: str | None,
        cells,
        counters,
        step_running_s: Callable[[], float | None],
        loss: Callable[[], float | None],
    ):
        self.run_dir = run_dir
        self.rank, self.world, self.launch = rank, world, launch
        self.cells = cells
        self.counters = counters
        self.step_running_s = step_running_s  # seconds the current step has run, None between steps
        self.loss = loss
        self.done = False
        self._sig = None

    def poll(self) -> None:
        if self.done or self.launch is None or self.world < 2:
            return
        path = request_path(self.run_dir)
        try:
            st = os.stat(path)
        except OSError:
            return
        if (st.st_mtime_ns, st.st_size) == self._sig:
            return
        self._sig = (st.st_mtime_ns, st.st_size)
        try:
            req = json.loads(runfiles.read_capped(path, MAX_REQUEST_BYTES))
            dead = {int(r) for r in req["dead"]}
            for_launch = req["launch"]
        except (OSError, ValueError, KeyError, TypeError, runfiles.FileTooLarge):
            return
        if for_launch != self.launch or self.rank in dead:
            return
        why = self._why_not()
        if why == "busy":
            self._sig = None  # asked again at the next poll, within the supervisor's window
            return
        self.done = True
        survivors = [r for r in range(self.world) if r not in dead]
        if why is None and survivors and self.rank != min(survivors):
            why = f"rank {min(survivors)} saves the replica"
        if why is not None:
            self._answer({"status": "nothing", "why": why})
            return
        self._save()

    def _why_not(self) -> str | None:
        try:
            import mindspore as ms

            mode = str(ms.get_auto_parallel_context("parallel_mode"))
        except Exception as e:  # noqa: BLE001 - no answer: no proof of consistency
            return f"the parallel mode cannot be read ({e})"
        if mode != "data_parallel":
            return f"not pure data parallel (parallel_mode {mode}): one rank's replica is not the model"
        running = self.step_running_s()
        if running is not None and running < self._blocked_after():
            return "busy"
        return None

    def _blocked_after(self) -> float:
        times = sorted(self.counters.step_times)
        usual = times[len(times) // 2] if times else 0.0
        return max(BLOCKED_MIN_S, 5 * usual)

    def _save(self) -> None:
        c = self.counters
        step, epoch, per_epoch = c.global_step, c.epoch, c.per_epoch
        if step < 1:
            self._answer({"status": "nothing", "why": "no step finished yet"})
            return
        started = time.perf_counter()
        in_epoch = (step - 1) % (per_epoch or 1) + 1
        tmp, final = set_dir(self.run_dir, step, tmp=True), set_dir(self.run_dir, step)
        try:
            if final.exists():
                self._answer({"status": "nothing", "why": f"{final.name} exists already"})
                return
            shutil.rmtree(tmp, ignore_errors=True)
            append = saving.append_fields(
                epoch=epoch,
                global_step=step,
                per_epoch=per_epoch,
                request_id=f"gasp-{self.launch}",
                rank=self.rank,
                world=self.world,
                param_names=saving.param_names(self.cells),
                loss=self.loss(),
            )
            append["rankwatch_gasp_by"] = self.rank
            first = tmp / f"rank_{self.rank}" / f"ttp_rank_{self.rank}-{epoch}_{in_epoch}.ckpt"
            running = self.step_running_s()
            saving.save_state(self.cells, first, append, global_step=step)
            after = self.step_running_s()
            if c.global_step != step or (running is not None and (after is None or after < running)):
                raise RuntimeError("the training thread finished a step while the replica was saved")
            if running is not None:
                time.sleep(min(SETTLE_MAX_S, self._blocked_after()))
                later = self.step_running_s()
                if c.global_step != step or later is None or later < after:
                    raise RuntimeError(
                        "the training thread finished its step just after the replica was saved: it was "
                        "slow, not blocked in a collective, so the replica may be mid-update"
                    )
            for r in range(self.world):
                if r != self.rank:
                    dest = tmp / f"rank_{r}" / f"ttp_rank_{r}-{epoch}_{in_epoch}.ckpt"
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(first, dest)
            os.rename(tmp, final)
        except (OSError, RuntimeError, ValueError, TypeError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            log.error("rankwatch: rank %d: the dying-gasp save failed: %s", self.rank, e)
            self._answer({"status": "failed", "why": f"{type(e).__name__}: {e}"})
            return
        seconds = time.perf_counter() - started
        log.warning(
            "rankwatch: rank %d saved its replica at global step %d (dying gasp, %.2f s)",
            self.rank,
            step,
            seconds,
        )
        self._answer(
            {
                "status": "saved",
                "global_step": step,
                "path": os.path.relpath(final, self.run_dir),
                "seconds": seconds,
            }
        )

    def _answer(self, body: dict) -> None:
        try:
            runfiles.atomic_write_json(
                answer_path(self.run_dir, self.rank),
                {"rank": self.rank, "launch": self.launch, "at": time.time(), **body},
                root=self.run_dir,
            )
        except OSError as e:
            log.warning("rankwatch: rank %d: dying-gasp answer not written: %s", self.rank, e)
