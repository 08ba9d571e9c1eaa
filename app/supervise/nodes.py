"""Several nodes, one ``rankwatch launch`` each: they end every attempt together and relaunch together.

Each node's supervisor wraps its own node's msrun; the node's rank and the
node count come from that msrun line (``--node_rank``, ``--worker_num`` /
``--local_worker_num``). Node 0, where msrun's scheduler runs, leads. They
coordinate through a board (``board.py``): the run directory they already
share (``RUN/rankwatch/nodes/``, one file per record, each written
atomically), or Redis with ``RANKWATCH_REDIS_URL``. Three kinds of record:

* ``end_{N}_{k}.json``: node ``k`` ended attempt ``N`` (its cause, its
  timings, its last step), written once none of the node's processes is
  left. Every other node's attempt loop looks for one at each poll; a
  failure there (or a second Ctrl-C) ends its own attempt at once, with the
  cause ``peer``. Written after the node's own dying gasp, never before: a
  peer that ended at the first sign would kill the survivors that save.
* ``plan_{N}.json``: node 0's decision after attempt ``N``, once every node
  has ended it (or ``END_WAIT_S`` passed: a node that never says is named).
  Either a relaunch (the next attempt's number, a fresh master port, the
  environment the resume set and any rollback need) or an end with node 0's
  exit status. The budget, the rules and the resume set are node 0's alone;
  the other nodes wait for the plan (``PLAN_WAIT_S`` at most: past it they
  exit 1 and say node 0 wrote none) and follow it. Node 0 alone writes the
  attempt's supervised line in ``attempts.jsonl``, with every node's end in it.
* ``leader.json``: node 0's supervisor's sign of life, a counter it raises
  every ``LEASE_EVERY_S`` from a thread for as long as it runs. A node
  waiting for a plan that sees the counter stand still for
  ``LEADER_SILENT_S`` of its own clock (so the hosts' clocks need not
  agree) stops waiting: node 0's node was lost or its supervisor killed,
  and no plan will come. Without it such a node waited ``PLAN_WAIT_S``
  (9 minutes) before it exited, and a scheduler's requeue waited with it.

No protocol of its own beyond that: one writer per record, read until seen.
The nodes still share the run directory for the flag and the checkpoints.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app.supervise import board as boards
from app.supervise import policy, procs
from app.supervise.cause import describe
from app.supervise.command import Msrun, NotMsrun
from trainer_bridge.rundir import launchguard, schema

END_NAME = re.compile(r"end_(\d{1,7})_(\d{1,6})\.json")
# A peer's end that ends this node's attempt: failures, and a second Ctrl-C that ended one node at once.
# A finish or a graceful stop ends every node by itself (the flag and the data are shared).
REACT_TO = (*policy.FAILURES, "interrupted")
# How long node 0 waits for every node to end an attempt after its own end (past the other nodes'
# grace, dying gasp and one poll), and how long another node waits for node 0's plan after its end
# (node 0's wait, its longest backoff, and the time to choose a set).
END_WAIT_S = 120.0
PLAN_WAIT_S = END_WAIT_S + policy.MAX_BACKOFF_S + 120.0
LEASE_NAME = "leader.json"
LEASE_EVERY_S = 5.0
LEASE_READ_S = 1.0
# Twelve of node 0's beats: more than a loaded shared file system delays a small write.
LEADER_SILENT_S = 60.0


@dataclass
class Nodes:
    run_dir: str
    node: int
    count: int
    board: boards.Board | None = None  # None: the run directory's (FileBoard)
    _lease_stop: threading.Event | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.board is None:
            self.board = boards.FileBoard(self.run_dir)

    @property
    def leader(self) -> bool:
        return self.node == 0

    @classmethod
    def of(cls, cmd: Msrun, run_dir: str) -> Nodes | None:
        """The node of a multi-node msrun line; None on one node. NotMsrun without a usable --node_rank,
        or with ``RANKWATCH_REDIS_URL`` and a key that cannot sign the nodes' records (``board.for_run``)."""
        if cmd.single_node:
            return None
        count = -(-cmd.worker_num // max(1, cmd.local_worker_num))
        node = cmd.int_option("--node_rank", -1)
        if not 0 <= node < count:
            raise NotMsrun(
                f"with several nodes ({cmd.worker_num} workers, {cmd.local_worker_num} on each) rankwatch "
                f"launch needs msrun's --node_rank, from 0 to {count - 1}: node 0 leads the relaunches"
            )
        try:
            board = boards.for_run(run_dir)
        except ValueError as e:
            raise NotMsrun(str(e)) from None
        return cls(run_dir, node, count, board)

    # ------------------------------------------------------------------ records

    def _write(self, name: str, body: dict) -> None:
        self.board.put(name, body)

    def _read(self, name: str) -> dict | None:
        return self.board.get(name)

    def ends(self, attempt: int) -> dict[int, dict]:
        """node -> its end record of ``attempt`` (this node's too), from one bounded listing."""
        wanted = []
        for name in self.board.names():
            m = END_NAME.fullmatch(name)
            if m and int(m.group(1)) == attempt and int(m.group(2)) < self.count:
                wanted.append(name)
        out = {}
        for name, got in self.board.read(wanted).items():
            if _valid(got):
                out[int(END_NAME.fullmatch(name).group(2))] = got
        return out

    # ------------------------------------------------------------------ every node

    def ended(self, attempt: int, record: dict) -> None:
        """This node's end of ``attempt`` (``record``: cause, host, fault_at, detected_at, ended_at, last_step)."""
        self._write(f"end_{attempt}_{self.node}.json", {**record, "attempt": attempt, "node": self.node})

    def tell(self, attempt: int, outcome, cause: dict, last_step: int | None, host: str, say) -> None:
        """This node's end of ``attempt`` for the others (``outcome``: ``attempt.Outcome``)."""
        times = {k: getattr(outcome, k) for k in ("spawned_at", "fault_at", "detected_at", "ended_at")}
        try:
            gasp = (outcome.gasp or "")[: schema.MAX_ERROR] or None  # what this node's dying gasp gave
            self.ended(attempt, {"cause": cause, "host": host, "last_step": last_step, "gasp": gasp, **times})
        except OSError as e:
            say(f"WARNING: this node's end of attempt {attempt} not written for the other nodes ({e})")

    def peer_failed(self, attempt: int) -> Callable[[], dict | None]:
        """For the attempt's poll: another node's end of ``attempt`` that must end this node's too."""

        def poll() -> dict | None:
            for node, rec in sorted(self.ends(attempt).items()):
                if node != self.node and rec["cause"].get("kind") in REACT_TO:
                    return rec
            return None

        return poll

    # ------------------------------------------------------------------ node 0

    def wait_ends(self, attempt: int, signals, say) -> dict[int, dict]:
        """Every node's end of ``attempt``, or what came within ``END_WAIT_S`` (the missing ones named).

        After a second Ctrl-C it does not wait: the plan (an end) goes out at
        once, and the other nodes end their attempts on this node's end file.
        """
        deadline = time.monotonic() + END_WAIT_S
        while True:
            got = self.ends(attempt)
            if len(got) >= self.count or time.monotonic() >= deadline or signals.count >= 2:
                break
            signals.wake.wait(0.2)
            signals.wake.clear()
            procs.reap()
        missing = sorted(set(range(self.count)) - set(got))
        if missing and signals.count < 2:
            say(
                f"node(s) {', '.join(map(str, missing))} did not report the end of attempt {attempt} within "
                f"{END_WAIT_S:g} s (a lost node, or its supervisor is gone)"
            )
        return got

    def plan(self, attempt: int, code: int, env: dict | None, next_attempt: int, port: int | None) -> None:
        """Write node 0's decision after ``attempt``: relaunch with ``env`` on ``port``, or end with ``code``."""
        body: dict = {"attempt": attempt, "at": time.time(), "exit_code": code, "action": "end"}
        if env is not None:
            base = {k: v for k, v in os.environ.items() if _carried(k)}
            body.update(
                action="relaunch",
                next_attempt=next_attempt,
                master_port=port,
                set={k: v for k, v in env.items() if _carried(k) and base.get(k) != v},
                unset=sorted(k for k in base if k not in env),
            )
        self._write(f"plan_{attempt}.json", body)
        self._tidy(attempt)

    def _tidy(self, attempt: int) -> None:
        """The files of the attempt before: every node has followed that plan, since it ended this one."""
        self.board.drop(
            [f"plan_{attempt - 1}.json", *(f"end_{attempt - 1}_{k}.json" for k in range(self.count))]
        )

    def start(self, say) -> None:
        """Say which node this is and where the nodes meet; on node 0, start the lease."""
        say(f"node {self.node} of {self.count}; the nodes meet in {self.board.where}")
        self.start_lease()

    def start_lease(self) -> None:
        """On node 0: raise the counter in ``leader.json`` every ``LEASE_EVERY_S`` until ``stop_lease``."""
        if not self.leader or self._lease_stop is not None:
            return
        stop = self._lease_stop = threading.Event()
        body = {"pid": os.getpid(), "host": os.uname().nodename, "beat": 0}

        def beat() -> None:
            while True:
                body["beat"] += 1
                try:
                    self._write(LEASE_NAME, body)
                except OSError:
                    pass  # a full disk or Redis down: the other nodes fall back to PLAN_WAIT_S
                if stop.wait(LEASE_EVERY_S):
                    return

        threading.Thread(target=beat, name="rankwatch-lease", daemon=True).start()

    def stop_lease(self) -> None:
        if self._lease_stop is not None:
            self._lease_stop.set()
            self._lease_stop = None

    # ------------------------------------------------------------------ the other nodes

    def leader_beat(self) -> int | None:
        """Node 0's counter, or None without a valid ``leader.json``."""
        got = self._read(LEASE_NAME)
        beat = got.get("beat") if got else None
        return beat if isinstance(beat, int) and not isinstance(beat, bool) else None

    def wait_plan(self, attempt: int, signals) -> dict | str:
        """Node 0's plan after ``attempt``, or why none will come: past ``PLAN_WAIT_S``, node 0 silent
        for ``LEADER_SILENT_S`` (``leader.json``), or a second Ctrl-C."""
        now = time.monotonic()
        deadline, beat, heard, checked = now + PLAN_WAIT_S, self.leader_beat(), now, now
        while signals.count < 2:
            got = self._read(f"plan_{attempt}.json")
            if got is not None and got.get("attempt") == attempt and _valid_plan(got):
                return got
            now = time.monotonic()
            if now >= deadline:
                return f"waited {PLAN_WAIT_S:g} s"
            if now - checked >= LEASE_READ_S:  # every node reads the board: once a second
                checked, latest = now, self.leader_beat()
                if latest != beat:
                    beat, heard = latest, now
                elif beat is not None and now - heard >= LEADER_SILENT_S:
                    return (
                        f"node 0's supervisor has been silent for {LEADER_SILENT_S:g} s (its node lost, or "
                        "the supervisor killed)"
                    )
            signals.wake.wait(0.2)
            signals.wake.clear()
            procs.reap()
        return "a second Ctrl-C"

    def follow(self, attempt: int, cause: dict, signals, say) -> dict:
        """Node 0's plan after ``attempt`` (relaunch or end), or an end with status 1 if none came."""
        how = describe(cause) if cause["kind"] in policy.FAILURES else cause["kind"]
        say(f"attempt {attempt} ended on node {self.node} ({how}); waiting for node 0's plan")
        if cause["kind"] == "interrupted":  # a second Ctrl-C here: node 0 ends the others on this node's end
            return {"action": "end", "exit_code": policy.INTERRUPTED}
        plan = self.wait_plan(attempt, signals)
        if isinstance(plan, str):
            say(f"node 0 wrote no plan after attempt {attempt} ({plan}); ending this node")
            return {"action": "end", "exit_code": policy.FAILED}
        if plan["action"] == "relaunch":
            say(f"node 0's plan: attempt {plan.get('next_attempt')} on master port {plan.get('master_port')}")
        else:
            say(f"node 0 ended the run (exit {plan.get('exit_code')}); so does node {self.node}")
        return plan

    def environment(self, plan: dict, mark: str) -> dict:
        """This node's environment for the plan's attempt: its own, changed as node 0's was."""
        unset = {k for k in plan.get("unset") or [] if isinstance(k, str) and _carried(k)}
        env = {k: v for k, v in os.environ.items() if k not in unset}
        env.update({k: v for k, v in (plan.get("set") or {}).items() if _carried(k) and isinstance(v, str)})
        env[procs.MARK_ENV] = mark
        return env


def _carried(key) -> bool:
    """A variable a plan may set or unset: Rankwatch's own (the resume step, the skip, the learning-rate
    scale, the ended launch), never the node's mark. The plan is a file in the run directory: a
    variable such as LD_PRELOAD from it would run whatever its writer chose on every node."""
    return isinstance(key, str) and key.startswith("RANKWATCH_") and key != procs.MARK_ENV


def _valid(rec: dict) -> bool:
    """An end record as ``ended`` writes it (another writer's junk is ignored, never trusted)."""
    times = ("spawned_at", "fault_at", "detected_at", "ended_at")
    return (
        isinstance(rec.get("cause"), dict)
        and all(isinstance(rec.get(k), (int, float, type(None))) for k in times)
        and isinstance(rec.get("last_step"), (int, type(None)))
        and isinstance(rec.get("node"), int)
        and isinstance(rec.get("gasp"), (str, type(None)))
    )


def _valid_plan(plan: dict) -> bool:
    def whole(v, top):
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= top

    if not whole(plan.get("exit_code"), 255):
        return False
    if plan.get("action") == "end":
        return True
    return (
        plan.get("action") == "relaunch"
        and whole(plan.get("next_attempt"), 2**31)
        and whole(plan.get("master_port"), 65535)
        and isinstance(plan.get("set"), dict)
        and isinstance(plan.get("unset"), list)
    )


def first_cause(ends: dict[int, dict]) -> dict | None:
    """The end record whose failure came first (ends by a peer are skipped): the attempt's cause."""
    failed = [rec for rec in ends.values() if rec["cause"].get("kind") in REACT_TO]
    if not failed:
        return None
    return min(failed, key=lambda r: (r.get("fault_at") or r.get("detected_at") or float("inf"), r["node"]))


def gasp_words(own: str | None, ends: dict[int, dict]) -> str | None:
    """What the dying gasps of every node gave, in words (the node that failed asked it)."""
    said = [own] if own else []
    said += [
        f"node {k}: {rec['gasp']}"
        for k, rec in sorted(ends.items())
        if rec.get("gasp") and rec["gasp"] != own
    ]
    return "; ".join(said)[: schema.MAX_ERROR] or None


def summary(ends: dict[int, dict]) -> list[dict]:
    """Each node's end, as the supervised line keeps it."""
    return [
        {
            "node": node,
            "host": str(rec.get("host") or "?")[:253],
            "cause": str(rec["cause"].get("kind") or "?")[:16],
            "ended_at": rec.get("ended_at"),
            "last_step": rec.get("last_step"),
        }
        for node, rec in sorted(ends.items())
    ]


def ended_env(launch: str | None) -> dict:
    """For the next attempt's launch guard: every rank of ``launch`` is gone, on every node."""
    return {launchguard.ENDED_ENV: launch} if launch else {}
