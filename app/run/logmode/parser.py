"""What a log has said, folded line by line: pure, no I/O, no clock.

``WorkerLog`` folds one rank's ``worker_N.log``: where training is (epoch,
step, global step when it can be derived, loss, step time), its state, the
error that ended it, and the evidence that it obeys ``OnRequestExit``.
``SchedulerLog`` folds msrun's ``scheduler.log`` (world size, each rank's
host, which ranks left cleanly or timed out) and ``LauncherLog`` msrun's own
output (which worker process exited with which code). The patterns they
apply are in ``app.run.logmode.patterns``; ``app.run.logmode.reader`` feeds them.

Every fold is bounded: a few numbers per rank, at most ``MAX_WARNINGS``
warnings and texts cut to the schema's lengths.
"""

from __future__ import annotations

import math
import signal
from collections import deque

from app.run.logmode.patterns import EXCEPTION, LAUNCHER, MAX_LINE, SCHEDULER, WORKER, Pattern
from trainer_bridge.rundir import schema

# Lines of a traceback read before giving up on finding its exception line.
TRACEBACK_MAX_LINES = 400
# Lines taken after an exception line with no message (MindSpore's C++ errors put it below).
MESSAGE_MAX_LINES = 20
# A log record starts with MindSpore's "[LEVEL] " prefix: it ends a message taken from below.
RECORD_PREFIXES = ("[ERROR] ", "[WARNING] ", "[INFO] ", "[DEBUG] ", "[CRITICAL] ")
MAX_TEXT = 500  # an evidence or warning sentence


def cut(text: str, limit: int = MAX_TEXT) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _float(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text.rstrip(",;"))
    except ValueError:
        return None
    return value


def _ms(text: str | None) -> float | None:
    value = _float(text)
    # The schema's bound (11 days); a figure beyond it is not a step time.
    return value if value is not None and math.isfinite(value) and 0 <= value <= 1e9 else None


def signal_name(code: int) -> str:
    """-9 → 'killed by SIGKILL, signal 9'; 1 → 'exit code 1'."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            return f"killed by signal {-code}"
        return f"killed by {name}, signal {-code}"
    return f"exit code {code}"


_PID = tuple(p for p in WORKER if p.kind == "pid")
_LINES = tuple(p for p in WORKER if p.kind != "pid")


class WorkerLog:
    """One rank's log, folded. ``feed`` each line in order; read the attributes."""

    __slots__ = (
        "epoch",
        "step",
        "spe",
        "global_step",
        "first_global_step",
        "loss",
        "step_ms",
        "step_mean_ms",
        "steps",
        "stride",
        "state",
        "error",
        "warnings",
        "pid",
        "rank_id",
        "on_request_exit",
        "_traceback",
        "_message",
        "lines",
        "matched",
    )

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.step: int | None = None
        self.spe: int | None = None  # steps per epoch, once known
        self.global_step: int | None = None
        self.first_global_step: int | None = None  # the first step line's: where this launch began
        self.loss: float | None = None
        self.step_ms: float | None = None  # the newest step line's own figure (MindFormers)
        self.step_mean_ms: float | None = None  # TimeMonitor's mean over the last epoch
        self.steps = 0  # step lines seen
        self.stride: int | None = None  # steps between the last two step lines of one epoch
        self.state = "starting"
        self.error: str | None = None
        self.warnings: deque[str] = deque(maxlen=schema.MAX_WARNINGS)
        self.pid: int | None = None
        self.rank_id: int | None = None
        self.on_request_exit: str | None = None  # a line that shows the script uses it
        self._traceback: int | None = None  # lines read inside a traceback, or None
        # (the exception's first line, the message lines below it) while they are taken
        self._message: tuple[str, list[str]] | None = None
        self.lines = 0
        self.matched = 0

    @property
    def position(self) -> tuple:
        """Changes exactly when a step line moved training on."""
        return (self.epoch, self.step, self.global_step)

    def feed(self, line: str) -> None:
        self.lines += 1
        if self.pid is None and line[:1] == "[":
            # Any MindSpore log line names its process; the first one tells the worker's pid.
            for pattern in _PID:
                m = pattern.match(line)
                if m is not None:
                    self._apply(pattern, m.groupdict())
        if self._message is not None and self._below(line):
            return
        if self._traceback is not None and self._in_traceback(line):
            return
        for pattern in _LINES:
            m = pattern.match(line)
            if m is not None:
                self.matched += 1
                self._apply(pattern, m.groupdict())
                return

    def _in_traceback(self, line: str) -> bool:
        """Inside a traceback: wait for its exception line (the first unindented one that fits)."""
        self._traceback += 1
        if line[:1] in (" ", "\t", "") or line.startswith("Traceback ("):
            return True
        m = EXCEPTION.match(line[:MAX_LINE])
        if m is None:
            # "During handling of the above exception...": more traceback follows.
            if self._traceback > TRACEBACK_MAX_LINES:
                self._traceback = None
            return self._traceback is not None
        self._traceback = None
        self._fail(line)
        if not (m.group("message") or "").strip():
            # "TypeError: " with the words on the lines below, as MindSpore writes its C++ errors.
            self._message = (line.strip(), [])
        return True

    def _below(self, line: str) -> bool:
        """Take a message line below an exception line; False (and stop) at the next log record.

        MindSpore frames its message with rules ("-----") and headings, and
        ends it with call stacks "(For framework developers)", which are left out.
        """
        head, parts = self._message
        text = line.strip()
        if line.startswith(RECORD_PREFIXES) or line.startswith("Traceback ("):
            self._message = None
            return False
        if "Call Stack" in text or len(parts) >= MESSAGE_MAX_LINES:
            self._message = None
            return True
        if text and text.strip("-"):
            parts.append(text.removeprefix("- "))
            if self.state == "failed":
                self.error = cut(f"{head} {' '.join(parts)}", schema.MAX_ERROR)
        return True

    def _apply(self, pattern: Pattern, g: dict) -> None:
        kind = pattern.kind
        if kind == "step":
            self._step(pattern, g)
        elif kind == "step_time":
            self.step_mean_ms = _ms(g["step_ms"])
        elif kind == "traceback":
            self._traceback = 0
        elif kind == "error":
            self._fail(f"{g['message']} ({pattern.note})" if pattern.note else g["message"])
        elif kind == "graceful_exit":
            self.state = "stopping"
            self.on_request_exit = cut(g["message"])
        elif kind == "on_request_exit":
            self.on_request_exit = cut(g["message"])
        elif kind == "rank_id":
            self.rank_id = int(g["rank"])
        elif kind == "pid":
            pid = int(g["pid"])
            self.pid = pid if 0 < pid <= 1 << 22 else None

    def _step(self, pattern: Pattern, g: dict) -> None:
        epoch = int(g["epoch"]) + 1 - pattern.base
        step = int(g["step"]) + 1 - pattern.base
        if g.get("spe"):
            self.spe = int(g["spe"]) or None
        elif self.epoch is not None and epoch == self.epoch + 1 and step == 1 and self.stride == 1:
            # Every step was printed and a new epoch began: the last one counted the epoch.
            self.spe = self.step
        self.stride = step - self.step if epoch == self.epoch and self.step is not None else None
        self.epoch, self.step = epoch, step
        if self.spe:
            self.global_step = (epoch - 1) * self.spe + step
        elif epoch == 1:
            self.global_step = step
        else:
            self.global_step = None
        loss = _float(g.get("loss"))
        self.loss = loss
        self.step_ms = _ms(g.get("step_ms"))
        if self.first_global_step is None:
            self.first_global_step = self.global_step
        self.steps += 1
        if self.error is not None:
            # Training went on after the error, so it was not fatal: keep it as a warning.
            self.warnings.append(cut(f"survived: {self.error}", schema.MAX_WARNING))
            self.error = None
        if self.state in ("starting", "failed"):
            self.state = "training"

    def _fail(self, message: str) -> None:
        self.error = cut(message, schema.MAX_ERROR)
        self.state = "failed"


class SchedulerLog:
    """msrun's scheduler.log, folded: the world size and each rank's fate."""

    __slots__ = ("world", "hosts", "nodes", "timed_out", "left", "lines", "version")

    def __init__(self) -> None:
        self.world: int | None = None
        self.hosts: dict[int, str] = {}
        self.nodes: dict[str, int] = {}  # scheduler node id → rank
        self.timed_out: dict[int, str] = {}  # rank → the scheduler's sentence
        self.left: set[int] = set()  # ranks that unregistered (finished cleanly)
        self.lines = 0
        self.version = 0  # +1 per line that told something (the reader rebuilds rows on a change)

    def rank_of(self, node: str) -> int | None:
        if node in self.nodes:
            return self.nodes[node]
        # msrun exports RANK_ID, so node ids are the ranks ("set by numeric node ids").
        return int(node) if node.isdigit() and len(node) <= 7 else None

    def feed(self, line: str) -> None:
        self.lines += 1
        for pattern in SCHEDULER:
            m = pattern.match(line)
            if m is None:
                continue
            g = m.groupdict()
            self.version += 1
            if pattern.kind == "registered":
                rank = int(g["rank"])
                if rank < schema.MAX_RANKS and len(self.nodes) < schema.MAX_RANKS:
                    self.nodes[g["node"]] = rank
                    self.hosts[rank] = g["host"]
                    self.timed_out.pop(rank, None)
                    self.left.discard(rank)
                world = int(g["world"])
                self.world = world if 0 < world <= schema.MAX_RANKS else self.world
            else:
                rank = self.rank_of(g["node"])
                if rank is None or rank >= schema.MAX_RANKS:
                    return
                if pattern.kind == "timed_out":
                    self.timed_out[rank] = cut(g["message"])
                else:
                    self.left.add(rank)
            return


# msrun's last words when a worker failed (``join_processes`` raises it, and msrun exits):
# a plain substring, so that it needs no pattern of its own.
JOB_EXITED = "Distributed job exited with exception"


class LauncherLog:
    """msrun's own output (when redirected into the log directory), folded."""

    __slots__ = ("ranks", "exits", "killed_all", "job_exited", "lines", "version")

    def __init__(self) -> None:
        self.ranks: dict[int, str] = {}  # rank → its worker log's file name, as msrun started it
        self.exits: dict[int, tuple[int, str]] = {}  # pid → (code, msrun's sentence)
        self.killed_all: str | None = None  # why msrun killed the remaining workers
        self.job_exited: str | None = None  # msrun said the job is over (it exits after this)
        self.lines = 0
        self.version = 0

    def feed(self, line: str) -> None:
        self.lines += 1
        # Not the traceback's source line, `raise RuntimeError("Distributed job ... in "`, which
        # comes first and ends mid-sentence: the exception's own line, after it, says where.
        if (
            JOB_EXITED in line
            and self.job_exited is None
            and not line[: line.index(JOB_EXITED)].endswith(('"', "'"))
        ):
            self.job_exited = cut(line[line.index(JOB_EXITED) :])
            self.version += 1
            return
        for pattern in LAUNCHER:
            m = pattern.match(line)
            if m is None:
                continue
            g = m.groupdict()
            self.version += 1
            if pattern.kind == "start_worker":
                rank = int(g["rank"])
                if rank in self.ranks:
                    # A relaunch appended to the same file: what the earlier run said is over.
                    self.ranks.clear()
                    self.exits.clear()
                    self.killed_all = None
                    self.job_exited = None
                if rank < schema.MAX_RANKS and len(self.ranks) < schema.MAX_RANKS:
                    self.ranks[rank] = g["message"].rsplit("/", 1)[-1]
            elif pattern.kind == "worker_exit":
                if len(self.exits) < schema.MAX_RANKS:
                    code = int(g["code"])
                    said = cut(g["message"]).rstrip(".")
                    self.exits[int(g["pid"])] = (code, f"{said} ({signal_name(code)})")
            elif pattern.kind == "kill_all":
                first = next(iter(self.exits.values()), None)
                self.killed_all = "msrun killed the remaining workers" + (
                    f" after: {first[1]}" if first else " after a worker exited with an exception"
                )
            return
