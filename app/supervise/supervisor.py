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

from app.supervise import gaspask, lock, nodes, policy, procs, rollback, slurm
from app.supervise.attempt import Attempt, Outcome
from app.supervise.cause import crash_cause, describe
from app.supervise.command import Msrun, free_port
from app.supervise.hang import HangWatch, hang_cause
from app.supervise.keeper import start_keeper, stop_keeper
from trainer_bridge.rundir import attempts, launchguard, runfiles, schema

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


@dataclass
class Ended:
    """What this node knows of an attempt that ended, from its ranks' heartbeats, and why it ended here."""

    last_step: int | None
    launch: str | None
    trained: bool
    cause: dict


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
        self.nodes = nodes.Nodes.of(opts.command, self.run_dir)  # None on one node
        self.mark = procs.run_mark(self.run_dir, self.nodes.node if self.nodes else None)
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
            fd = lock.acquire(self.run_dir, self.nodes.node if self.nodes else None)
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
        if not self.nodes or self.nodes.leader:
            rollback.publish(self.run_dir, self.opts.rollback, self.say)
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
        number, port = max((r["attempt"] for r in self._records()), default=0) + 1, None
        if number > 1 and runfiles.RESUME_STEP_ENV not in env:
            # Started again (after a kill or a stop): go on as the last supervisor would have.
            code, found = rollback.restart(
                self.run_dir,
                self.opts.command.worker_num,
                self.opts.rollback,
                number,
                self.say,
                not self.nodes,
            )
            if code is not None:
                return code
            env = rollback.environment(env, None) | found
        first_step = rollback.data_step(env) + 1
        several = self.nodes if not record_only else None
        while True:
            history = policy.History.of(self._records())
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
                port,
            )
            try:
                outcome = attempt.run(
                    self._first_interrupt,
                    lambda argv, n=number: self.say(f"attempt {n}: {argv}"),
                    self._gasp if self.opts.gasp_s > 0 else None,
                    self._hang_poll() if self.hang is not None and not record_only else None,
                    several.peer_failed(number) if several else None,
                )
            except OSError as e:  # msrun itself could not be started (not on PATH, not executable)
                self.say(f"cannot start {self.opts.command.head[0]}: {e}")
                return policy.FAILED
            self._forget_gasp()
            ended = self._ended(outcome, first_step)
            ends = None
            if several:
                several.tell(number, outcome, ended.cause, ended.last_step, self.host, self.say)
                if not several.leader:
                    plan = several.follow(number, ended.cause, self.signals, self.say)
                    if plan.get("action") != "relaunch":
                        return plan["exit_code"]
                    env = several.environment(plan, self.mark)
                    number, port = plan["next_attempt"], plan["master_port"]
                    first_step = rollback.data_step(env) + 1
                    continue
                ends = several.wait_ends(number, self.signals, self.say)
                outcome.gasp = nodes.gasp_words(outcome.gasp, {k: e for k, e in ends.items() if k != 0})
            code, relaunch_env = self._judge(outcome, ended, history, first_step, record_only, ends)
            if relaunch_env is not None and several:
                relaunch_env.update(nodes.ended_env(ended.launch))
            previous, number = number, max([number, *(r["attempt"] for r in self._records())]) + 1
            if several:
                port = free_port() if relaunch_env is not None else None  # the same on every node
                try:
                    several.plan(previous, code, relaunch_env, number, port)
                except OSError as e:
                    self.say(f"WARNING: the plan for the other nodes not written ({e}): they will time out")
            if relaunch_env is None:
                return code
            env = relaunch_env
            first_step = rollback.data_step(env) + 1

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
        world = self.opts.command.worker_num if self.nodes else None  # several nodes: ask theirs too
        ask = (self.run_dir, attempt, failed, self.opts.gasp_s, self.signals.wake, self.say, world)
        return gaspask.ask(*ask)

    def _forget_gasp(self) -> None:
        gaspask.forget(self.run_dir, self.opts.command.worker_num)

    # ------------------------------------------------------------------ keeper

    def _start_keeper(self) -> None:
        self.keeper, self._keeper_pipe = start_keeper(self.mark, self.opts.grace_s)
        if self.nodes:
            self.nodes.start(self.say)  # where they meet; node 0's sign of life for the other nodes

    def _stop_keeper(self) -> None:
        stop_keeper(self.keeper, self._keeper_pipe)
        self.keeper = self._keeper_pipe = None
        if self.nodes:
            self.nodes.stop_lease()

    # ------------------------------------------------------------------ judging

    def _attempt_beats(self, outcome: Outcome) -> list[dict]:
        pids = {w.pid for w in outcome.workers}
        return [
            hb
            for _, hb in launchguard.read_heartbeats(self.run_dir)
            if hb.get("pid") in pids and hb.get("host") == self.host
        ]

    def _ended(self, outcome: Outcome, first_step: int) -> Ended:
        beats = self._attempt_beats(outcome)
        steps = [hb["global_step"] for hb in beats if hb.get("global_step") is not None]
        last_step = max(steps) if steps else None
        launch = next((hb["launch"] for hb in beats if hb.get("launch")), None)
        trained = last_step is not None and last_step >= first_step
        return Ended(last_step, launch, trained, self._cause(outcome, beats, trained))

    def _judge(
        self,
        outcome: Outcome,
        ended: Ended,
        history: policy.History,
        first_step: int,
        record_only: bool,
        ends: dict[int, dict] | None = None,
    ) -> tuple[int, dict | None]:
        """Write the attempt's supervised line; return (exit status, the next attempt's env or None).

        ``ends``: every node's end of the attempt (several nodes, on node 0):
        the first failure among them is the attempt's cause, and its times.
        """
        last_step, launch, trained, cause = ended.last_step, ended.launch, ended.trained, ended.cause
        rows = attempts.fold(self._records())
        row = next((r for r in rows if launch is not None and r["launch"] == launch), None)
        number = row["attempt"] if row else max((r["attempt"] for r in rows), default=0) + 1
        times = {k: getattr(outcome, k) for k in ("fault_at", "detected_at", "ended_at")}
        first = nodes.first_cause(ends) if ends else None
        if first is not None:
            cause = first["cause"]
            times.update({k: first.get(k) for k in ("fault_at", "detected_at")})
            times["ended_at"] = max((e.get("ended_at") or 0 for e in ends.values()), default=None)
            last_step = max(
                (e["last_step"] for e in ends.values() if e.get("last_step") is not None), default=None
            )
            trained = last_step is not None and last_step >= first_step
        if cause["kind"] == "peer":  # the node that failed never said how (its end file is unreadable)
            cause = {
                "kind": "crash",
                "error": "another node ended the attempt",
                "before_first_step": not trained,
            }
        progressed = trained and policy.advanced(last_step, history.best_step)
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
            **times,
            last_step=last_step,
            progressed=progressed,
            scheduler=slurm.scheduler_record(),
            nodes=nodes.summary(ends) if ends else None,
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
        if outcome.kind == "peer":  # another node ended the attempt: its cause is the attempt's (nodes.py)
            return {"kind": "peer", "node": outcome.peer.get("node"), "before_first_step": not trained}
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
