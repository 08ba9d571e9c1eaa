"""``rankwatch launch``'s loop: lock the run, start an attempt, judge it, relaunch or end.

See the package docstring for the design and docs/cli.md ("launch") for
what a user sees. Everything the supervisor decides is written to
``attempts.jsonl`` as one supervised line per attempt
(``schema.AttemptSupervised``), which is also what a later supervisor on
the same run directory reads to continue the budget and the rules.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app.supervise import lock, policy, procs, rollback, slurm
from app.supervise.attempt import Attempt, Outcome
from app.supervise.cause import crash_cause, describe
from app.supervise.command import Msrun
from app.supervise.hang import HangWatch, hang_cause
from trainer_bridge.rundir import attempts, gaspfiles, launchguard, runfiles, schema

# Where MindIO TTP or MindCluster own recovery (they relaunch processes themselves).
EXTERNAL_RECOVERY_ENV = ("MS_ENABLE_TFT", "MINDX_TASK_ID")


@dataclass
class Options:
    run_dir: str
    command: Msrun
    max_restarts: int = 3
    backoff_s: float = 5.0
    grace_s: float = 10.0
    no_progress: int = 3
    poll_s: float = 0.2
    gasp_s: float = 5.0
    hang_restart_s: float = 0.0  # 0: the hang rule is off
    hang_mode: str = "dry-run"
    rollback: rollback.Settings = field(default_factory=rollback.Settings)


class Signals:
    """Ctrl-C and SIGTERM, counted; SIGCHLD and both wake the loop at once."""

    def __init__(self):
        self.count = 0
        self.wake = threading.Event()

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGCHLD, lambda *_: self.wake.set())

    def _stop(self, *_):
        self.count += 1
        self.wake.set()


class Supervisor:
    def __init__(
        self, opts: Options, request_stop: Callable[[], str], say: Callable[[str], None] | None = None
    ):
        self.opts = opts
        self.run_dir = opts.run_dir
        self.request_stop = request_stop  # writes the graceful-stop flag; returns what to print
        self.say = say or (lambda text: print(f"rankwatch launch: {text}", file=sys.stderr, flush=True))
        self.host = socket.gethostname()
        self.mark = procs.run_mark(self.run_dir)
        self.signals = Signals()
        self.keeper: subprocess.Popen | None = None
        self.hang = (
            HangWatch(self.run_dir, opts.hang_restart_s, opts.hang_mode, self.say)
            if opts.hang_restart_s
            else None
        )
        self._keeper_pipe: int | None = None

    # ------------------------------------------------------------------ start

    def run(self) -> int:
        try:
            fd = lock.acquire(self.run_dir)
        except lock.Held as e:
            self.say(f"refusing to start: {e}")
            return policy.REFUSED
        try:
            return self._run_locked()
        finally:
            self._stop_keeper()
            os.close(fd)

    def _run_locked(self) -> int:
        left = procs.marked(self.mark)
        if left:
            # A supervisor of this run was killed and its keeper too: end what they left.
            self.say(f"ending {len(left)} process(es) left by an earlier supervisor of this run directory")
            procs.end_all(lambda: procs.marked(self.mark), self.opts.grace_s)
        _, live = launchguard.live_others(self.run_dir, host=self.host, now=time.time())
        if live:
            self.say(launchguard.refusal(self.run_dir, live))
            return policy.REFUSED
        procs.become_subreaper()
        self.signals.install()
        self._start_keeper()
        record_only = any(os.environ.get(v) for v in EXTERNAL_RECOVERY_ENV)
        if record_only:
            self.say(
                "MS_ENABLE_TFT or MINDX_TASK_ID is set: MindIO TTP or MindCluster own recovery here; this "
                "supervisor records the attempt and neither kills nor relaunches"
            )
        env = {**os.environ, procs.MARK_ENV: self.mark}
        if self._records() and runfiles.RESUME_STEP_ENV not in env:
            # The run has attempts already (this supervisor was started again, after a kill or a stop):
            # go on from the newest healthy set, as a relaunch would.
            choice = policy.choose_resume(self.run_dir, self.opts.command.worker_num)
            if choice.global_step is not None:
                env[runfiles.RESUME_STEP_ENV] = str(choice.global_step)
                env.update(rollback.carry(self.run_dir, choice.global_step))
                self.say(f"resuming from set {choice.set_id} (global step {choice.global_step})")
            if choice.note:
                self.say(choice.note)
        first_step = self._pinned_step(env)
        while True:
            records = self._records()
            history = policy.History.of(records)
            number = max((r["attempt"] for r in records), default=0) + 1
            env[procs.ATTEMPT_ENV] = str(number)
            attempt = Attempt(
                self.opts.command,
                env,
                self.mark,
                self.keeper.pid if self.keeper else None,
                self.opts.grace_s,
                self.opts.poll_s,
                self.signals,
                record_only,
            )
            try:
                outcome = attempt.run(
                    self._first_interrupt,
                    lambda argv, n=number: self.say(f"attempt {n}: {argv}"),
                    self._gasp if self.opts.gasp_s > 0 else None,
                    self._hang_poll() if self.hang is not None and not record_only else None,
                )
            except OSError as e:  # msrun itself could not be started (not on PATH, not executable)
                self.say(f"cannot start {self.opts.command.head[0]}: {e}")
                return policy.FAILED
            self._forget_gasp()
            code, relaunch_env = self._judge(outcome, history, first_step, record_only)
            if relaunch_env is None:
                return code
            env = relaunch_env
            first_step = rollback.data_step(env) + 1

    def _pinned_step(self, env: dict) -> int:
        step = env.get(runfiles.RESUME_STEP_ENV, "")
        return int(step) + 1 if step.isdigit() else 1

    def _records(self) -> list[dict]:
        try:
            return attempts.read_lines(self.run_dir)[0]
        except OSError as e:
            self.say(f"cannot read attempts.jsonl ({e}); counting from nothing")
            return []

    def _first_interrupt(self) -> None:
        try:
            told = self.request_stop()
        except Exception as e:  # noqa: BLE001 - the flag could not be written: say so, a second Ctrl-C ends it
            told = f"the graceful stop could not be requested ({e}); Ctrl-C again ends the job at once"
        self.say(f"{told}; waiting for the job to stop (Ctrl-C again ends it at once)")

    def _hang_poll(self):
        """The hang rule's check for one attempt (app/supervise/hang.py)."""
        self.hang.begin()
        return lambda attempt: self.hang.check(
            p.pid for p in attempt.procs.values() if p.role == "worker" and p.status is None
        )

    # ------------------------------------------------------------------ dying gasp

    def _gasp(self, attempt: Attempt, failed: procs.Proc) -> str | None:
        """Ask the survivors to save their replica (``trainer_bridge/gasp.py``); wait at most ``gasp_s``.

        Returns what came of it, in words, or None when there was no one to ask
        (no survivor, or a job without the bridge).
        """
        workers = [p for p in attempt.procs.values() if p.role == "worker"]
        survivors = {p.rank: p for p in workers if p.status is None and not p.vanished and p.rank is not None}
        dead = sorted({p.rank for p in workers if p.rank is not None and p.rank not in survivors})
        pids = {p.pid for p in workers}
        beats = launchguard.read_heartbeats(self.run_dir)
        launch = next((hb["launch"] for _, hb in beats if hb.get("pid") in pids and hb.get("launch")), None)
        if not survivors or launch is None:
            return None
        try:
            runfiles.atomic_write_json(
                gaspfiles.request_path(self.run_dir),
                {"launch": launch, "dead": dead, "at": time.time()},
                root=self.run_dir,
            )
        except OSError as e:
            return f"dying gasp not asked: {e}"
        self.say(f"asked rank(s) {', '.join(map(str, sorted(survivors)))} to save their replica (dying gasp)")
        deadline = time.monotonic() + self.opts.gasp_s
        answers: dict[int, dict] = {}
        while time.monotonic() < deadline:
            for rank in survivors:
                got = runfiles.read_json_or_none(gaspfiles.answer_path(self.run_dir, rank))
                if isinstance(got, dict) and got.get("launch") == launch:
                    answers[rank] = got
            if any(a.get("status") == "saved" for a in answers.values()) or len(answers) == len(survivors):
                break
            self.signals.wake.wait(0.05)
            self.signals.wake.clear()
        saved = next((a for a in answers.values() if a.get("status") == "saved"), None)
        if saved is not None:
            told = (
                f"dying gasp: rank {saved.get('rank')} saved its replica at global step "
                f"{saved.get('global_step')} in {float(saved.get('seconds') or 0) * 1e3:.0f} ms"
            )
        elif answers:
            told = "dying gasp: nothing saved: " + "; ".join(
                f"rank {r}: {str(a.get('why'))[:200]}" for r, a in sorted(answers.items())
            )
        else:
            told = f"dying gasp: no survivor answered within {self.opts.gasp_s:g} s"
        self.say(told)
        return told

    def _forget_gasp(self) -> None:
        """The request and the answers are for one attempt only."""
        paths = [gaspfiles.request_path(self.run_dir)]
        paths += [gaspfiles.answer_path(self.run_dir, r) for r in range(self.opts.command.worker_num)]
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass

    # ------------------------------------------------------------------ keeper

    def _start_keeper(self) -> None:
        read, write = os.pipe()
        try:
            self.keeper = subprocess.Popen(
                [sys.executable, "-m", "app.supervise.keeper", self.mark, str(self.opts.grace_s)],
                stdin=read,
                start_new_session=True,
                env={k: v for k, v in os.environ.items() if k != procs.MARK_ENV},
            )
        finally:
            os.close(read)
        self._keeper_pipe = write

    def _stop_keeper(self) -> None:
        if self._keeper_pipe is not None:
            os.close(self._keeper_pipe)  # its end of file: it sweeps (nothing is left) and exits
            self._keeper_pipe = None
        if self.keeper is not None:
            try:
                os.waitpid(self.keeper.pid, 0)
            except ChildProcessError:
                pass
            self.keeper.returncode = 0
            self.keeper = None

    # ------------------------------------------------------------------ judging

    def _attempt_beats(self, outcome: Outcome) -> list[dict]:
        pids = {w.pid for w in outcome.workers}
        return [
            hb
            for _, hb in launchguard.read_heartbeats(self.run_dir)
            if hb.get("pid") in pids and hb.get("host") == self.host
        ]

    def _judge(
        self, outcome: Outcome, history: policy.History, first_step: int, record_only: bool
    ) -> tuple[int, dict | None]:
        """Write the attempt's supervised line; return (exit status, the next attempt's env or None)."""
        beats = self._attempt_beats(outcome)
        steps = [hb["global_step"] for hb in beats if hb.get("global_step") is not None]
        last_step = max(steps) if steps else None
        launch = next((hb["launch"] for hb in beats if hb.get("launch")), None)
        rows = attempts.fold(self._records())
        row = next((r for r in rows if launch is not None and r["launch"] == launch), None)
        number = row["attempt"] if row else max((r["attempt"] for r in rows), default=0) + 1
        trained = last_step is not None and last_step >= first_step
        progressed = trained and policy.advanced(last_step, history.best_step)
        cause = self._cause(outcome, beats, trained)
        base = dict(
            kind="supervised",
            attempt=number,
            launch=launch,
            supervisor_pid=os.getpid(),
            host=self.host,
            world_size=self.opts.command.worker_num,
            spawned_at=outcome.spawned_at,
            first_step=first_step,
            cause=cause,
            fault_at=outcome.fault_at,
            detected_at=outcome.detected_at,
            ended_at=outcome.ended_at,
            last_step=last_step,
            progressed=progressed,
            scheduler=slurm.scheduler_record(),
        )
        if not outcome.clean:
            self.say("WARNING: a process of the attempt survived SIGKILL (uninterruptible sleep?)")
        if cause["kind"] == "stop":
            rolled = self._rollback(outcome, base, number)
            if rolled is not None:
                return rolled
        if cause["kind"] not in policy.FAILURES:
            code = policy.INTERRUPTED if cause["kind"] == "interrupted" else policy.OK
            self._write(base, action="end", exit_code=code)
            self.say(f"attempt {number} ended: {cause['kind']}; not relaunched")
            return code, None
        self._seal(row, outcome, cause, last_step)
        said = describe(cause)
        self.say(f"attempt {number} failed: {said}")
        history.add({**base, "restarted_by": None})
        ending = self._ending(history, cause, record_only, outcome.spawned_at)
        if ending is not None:
            code, why = ending
            # What the dying gasp saved (or why not) stays on the row: a person may relaunch from it.
            note = "; ".join(n for n in (why, outcome.gasp) if n)[: schema.MAX_ERROR]
            self._write(base, action="record_only" if record_only else "end", exit_code=code, note=note)
            self.say(why)
            return code, None
        choice = policy.choose_resume(self.run_dir, self.opts.command.worker_num)
        wait = (
            0.0
            if cause["before_first_step"]
            else policy.backoff(self.opts.backoff_s, history.restart_streak + 1)
        )
        if wait:
            self.say(
                f"relaunching in {wait:g} s (restart {history.restarts + 1} of {self.opts.max_restarts})"
            )
            if self._sleep(wait):
                self._write(base, action="end", exit_code=policy.OK, note="stopped during the backoff")
                return policy.OK, None
        env = rollback.environment(dict(os.environ), None)
        env[procs.MARK_ENV] = self.mark
        resume = None
        if choice.global_step is not None:
            env[runfiles.RESUME_STEP_ENV] = str(choice.global_step)
            env.update(rollback.carry(self.run_dir, choice.global_step))
            resume = {"set": choice.set_id, "global_step": choice.global_step}
            self.say(f"resuming from set {choice.set_id} (global step {choice.global_step})")
        else:
            self.say("no complete healthy checkpoint set: the next attempt starts afresh")
        if choice.note:
            self.say(choice.note)
        notes = [n for n in (outcome.gasp, choice.note) if n]
        self._write(
            base,
            action="relaunch",
            restarted_by="launch",
            relaunched_at=time.time(),
            resume=resume,
            note="; ".join(notes)[: schema.MAX_ERROR] if notes else None,
        )
        return policy.OK, env

    def _rollback(self, outcome: Outcome, base: dict, number: int) -> tuple[int, dict | None] | None:
        """A stop the loss-spike detector asked for (``rollback.py``): roll back, or end needing attention."""
        by = "Ctrl-C or SIGTERM to rankwatch launch" if self.signals.count else None
        req = rollback.pending(self.run_dir, outcome.spawned_at, self.say, by)
        if req is None:
            return None
        world, settings = self.opts.command.worker_num, self.opts.rollback
        d = rollback.decide(self.run_dir, world, req, settings, self.say)
        if d.code is None:
            rollback.confirm(self.run_dir, world, d, settings, req, self.say)
        base = {**base, "cause": {**d.cause, "before_first_step": base["cause"]["before_first_step"]}}
        self.say(d.said)
        note = d.said[: schema.MAX_ERROR]
        if d.code is not None:
            self._write(base, action="end", exit_code=d.code, note=note)
            return d.code, None
        env = rollback.environment({**os.environ, procs.MARK_ENV: self.mark}, d)
        self._write(
            base,
            action="relaunch",
            restarted_by="launch",
            relaunched_at=time.time(),
            resume=d.resume,
            note=note,
        )
        rollback.committed(self.run_dir, d, number + 1, self.say)
        return policy.OK, env

    def _stop_asked_since(self, since: float) -> bool:
        """A stop flag set for this attempt (an older armed flag was served by an earlier one)."""
        try:
            flag = runfiles.read_flag(self.run_dir)
            changed = os.stat(runfiles.flag_path(self.run_dir)).st_mtime
        except (OSError, runfiles.FlagError):
            return False
        return flag is not None and flag.exit and changed >= since

    def _ending(
        self, history: policy.History, cause: dict, record_only: bool, spawned_at: float
    ) -> tuple[int, str] | None:
        """(exit status, why) when the run ends here, or None to relaunch."""
        if record_only:
            return policy.FAILED, "not relaunched: MindIO TTP or MindCluster own recovery (recorded only)"
        if self.signals.count:
            return policy.FAILED, "not relaunched: a stop was asked (Ctrl-C or SIGTERM to rankwatch launch)"
        if self._stop_asked_since(spawned_at):
            return policy.FAILED, "not relaunched: a graceful stop was requested during it (the flag is set)"
        if history.startup_streak and history.startup_streak[1] >= 2:
            return policy.STARTUP, (
                f"the same failure twice in a row before the first step; ending the run: {describe(cause)}"
            )
        if history.stalled >= self.opts.no_progress:
            return policy.NO_PROGRESS, (
                f"{history.stalled} attempt(s) in a row without training past global step "
                f"{history.best_step}; ending the run (no progress)"
            )
        if history.restarts >= self.opts.max_restarts:
            return policy.BUDGET, (
                f"the restart budget is used up ({history.restarts} of {self.opts.max_restarts} in this run "
                "directory); ending the run"
            )
        return None

    def _sleep(self, seconds: float) -> bool:
        """Wait out a backoff; True if Ctrl-C or SIGTERM came meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.signals.count:
            self.signals.wake.wait(min(0.5, max(0.0, deadline - time.monotonic())))
            self.signals.wake.clear()
            procs.reap()
        return bool(self.signals.count)

    def _cause(self, outcome: Outcome, beats: list[dict], trained: bool) -> dict:
        if outcome.kind == "interrupted":
            return {"kind": "interrupted", "before_first_step": not trained}
        if outcome.kind == "done":
            stopped = any(hb["state"] == "exited" for hb in beats) or self._stop_asked_since(
                outcome.spawned_at
            )
            kind = "stop" if stopped else "finished"
            return slurm.preempted(
                {"kind": kind, "before_first_step": not trained}, self.run_dir, outcome.spawned_at
            )
        if outcome.kind == "hang":
            return hang_cause(outcome, self.host, trained, self.opts.hang_restart_s)
        p = outcome.first
        if p is not None and p.status is not None and procs.signal_name(p.status) == "SIGTERM":
            # scontrol requeue and PreemptMode=REQUEUE signal every process of the job step, msrun's
            # scheduler too: after Slurm's signal that is the preemption (the ranks saved on their
            # SIGTERM), not a crash, and Slurm requeues the job itself.
            pre = slurm.preempted(
                {"kind": "stop", "before_first_step": not trained}, self.run_dir, outcome.spawned_at
            )
            if pre["kind"] == "preempted":
                return pre
        return crash_cause(outcome, beats, self.host, trained)

    def _write(self, base: dict, **more) -> None:
        try:
            attempts.append_record(self.run_dir, schema.build(schema.AttemptSupervised, **{**base, **more}))
        except (OSError, schema.SchemaError) as e:
            self.say(f"WARNING: attempts.jsonl not written ({e}): the budget cannot count this attempt")

    def _seal(self, row: dict | None, outcome: Outcome, cause: dict, last_step: int | None) -> None:
        """An end line for a bridge attempt that wrote none (its ranks were killed): failed, with the cause."""
        if row is None or row["end"] is not None:
            return
        try:
            attempts.append_record(
                self.run_dir,
                schema.build(
                    schema.AttemptEnd,
                    kind="end",
                    attempt=row["attempt"],
                    launch=row["launch"],
                    ended_at=outcome.ended_at,
                    end="failed",
                    last_step=last_step,
                    error=describe(cause)[: schema.MAX_ERROR],
                ),
            )
        except (OSError, schema.SchemaError) as e:
            self.say(f"WARNING: attempts.jsonl end line not written ({e})")
