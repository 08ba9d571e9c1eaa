"""Run id -> that run's engines (a ``Rankwatch`` container), bounded.

Under ``--runs ROOT`` the runs are what ``Discovery`` finds; each run's
container is built on first use by ``app.compose.build``, the one
factory. Only runs that are live or
being viewed keep theirs, and at most ``cap`` at once (least recently used
out first): a root of a thousand finished runs costs the engines of the
few on screen, not a thousand. A run that is dropped keeps nothing here:
its files are read again when it is next opened.

Live runs' watchers run (their stop service records completed stops, the
stop policy and alerts follow them) whether or not a page is open; a run
opened only to be looked at has its watcher started by its page's Socket.IO
connect, as today, and stopped when the run is dropped.

**Which runs get a watcher** (issue 32, P6): a run whose flag says stop, and
a live run while the stop policy or retention is on for it, always; the other
live runs by evidence (valid heartbeats of an open run, then the discovery's
count of non-empty, not future-dated files, then the newest), up to ``cap``.
Live runs left without one are counted in ``/api/health`` (``runs``).

With ``--run-dir RUN`` the registry holds that one run under its name
(``RUN``'s last component): ``/api/runs/<name>/X`` answers as ``/api/X``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from app.checkpoints.retention_plan import policy_for
from app.errors import RunNotFound
from app.runs import pinned
from app.runs.discovery import FLAG, Discovery, RunEntry, pin_holds
from app.runs.ids import single_id  # noqa: F401  (create_app imports it from here)
from trainer_bridge.rundir import runfiles

if TYPE_CHECKING:
    from app.extensions import Rankwatch

log = logging.getLogger(__name__)

# Containers kept at once (live runs and runs being viewed), least recently used out first.
OPEN_MAX = 32
# A run whose page or API was used within this many seconds is being viewed.
VIEWED_S = 120.0
# Discovery's period: a new run is listed within this (plus one scan's time).
SCAN_S = 5.0


class Registry:
    def __init__(
        self,
        config: dict[str, Any],
        build: Callable[..., Rankwatch],
        *,
        single: tuple[str, Rankwatch] | None = None,
        cap: int = OPEN_MAX,
        clock: Callable[[], float] = time.time,
        start_task: Callable | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.config = config
        self._build = build
        self.single = single
        self.cap = cap
        self.clock = clock
        self._start_task = start_task
        self._sleep = sleep
        self.discovery = (
            None
            if single is not None
            else Discovery(
                config["RUNS_ROOT"],
                depth=config["RUNS_DEPTH"],
                log_dir=config["LOG_DIR"],
                idle_s=config["RUN_IDLE_S"],
            )
        )
        self._open: OrderedDict[str, Rankwatch] = OrderedDict()
        self._used: dict[str, float] = {}
        self._lock = threading.RLock()
        self._task = None
        self._stopping = threading.Event()
        self._must: set[str] = set()  # runs that are always watched (see the module's docstring)
        self._pins: dict[str, tuple] = {}  # run id -> the (device, inode) its open container was built on
        # run id -> its directory's descriptor as a path (app/runs/pinned.py), closed when the last user goes
        self._paths: dict[str, pinned.PinnedPath] = {}
        self.unwatched: list[str] = []  # live runs the last tick left without a watcher
        # Called after each scan of the loop (the runs table reads idle rows ahead: app/runs/rows.py).
        self.on_tick: Callable[[], object] | None = None

    @property
    def is_root(self) -> bool:
        return self.single is None

    # -- the runs -----------------------------------------------------------------

    def refresh(self, max_age: float = SCAN_S) -> None:
        """Scan the root if the last scan is older than ``max_age`` (requests before the loop runs)."""
        d = self.discovery
        if d is not None and (d.scanned_at is None or self.clock() - d.scanned_at >= max_age):
            d.scan()

    def entries(self) -> dict[str, RunEntry | None]:
        """Every run id known now -> its discovery entry (None for ``--run-dir``'s run)."""
        if self.single is not None:
            return {self.single[0]: None}
        self.refresh()
        return dict(self.discovery.runs)

    def known(self, run_id: str) -> bool:
        if self.single is not None:
            return run_id == self.single[0]
        self.refresh()
        return run_id in self.discovery.runs

    def get(self, run_id: str, *, touch: bool = True) -> Rankwatch:
        """The run's container (built now if not open); RunNotFound for a run that is not here."""
        if self.single is not None:
            if run_id != self.single[0]:
                raise RunNotFound(f"no run {run_id!r} here: this dashboard serves {self.single[0]!r}")
            return self.single[1]
        if not self.known(run_id):
            raise RunNotFound(f"no run {run_id!r} under {self.config['RUNS_ROOT']}")
        entry = self.discovery.runs[run_id]
        with self._lock:
            if run_id in self._open and self._pins.get(run_id) != entry.ident:
                self._drop(run_id)  # another directory under the same name: a new run (P2)
            if not pin_holds(self.discovery.root, run_id, entry.ident):
                if run_id in self._open:
                    self._drop(run_id)
                raise RunNotFound(
                    f"run {run_id!r}: its directory was replaced since it was found (a symlink is never "
                    "followed); the next scan looks at it again"
                )
            if touch:
                self._used[run_id] = self.clock()
            rw = self._open.get(run_id)
            if rw is None:
                try:
                    # The engines get the directory by its descriptor, never ROOT/name (P2).
                    path = pinned.pin(self.discovery.root, run_id, entry.ident)
                except pinned.Replaced:
                    raise RunNotFound(
                        f"run {run_id!r}: its directory was replaced since it was found (a symlink is "
                        "never followed); the next scan looks at it again"
                    ) from None
                rw = self._open[run_id] = self._build(path, run_id)
                self._pins[run_id] = entry.ident
                self._paths[run_id] = path
                watcher = getattr(rw, "watcher", None)
                if watcher is not None:
                    # Each tick first checks the pin: no write or delete through a swapped directory.
                    watcher.guard = functools.partial(pin_holds, self.discovery.root, run_id, entry.ident)
                    retention = getattr(getattr(rw, "checkpoints", None), "retention", None)
                    if retention is not None:
                        retention.guard = watcher.guard
            self._open.move_to_end(run_id)
            self._trim()
            return rw

    def peek(self, run_id: str) -> Rankwatch | None:
        """The run's container if it is open, else None (nothing is built)."""
        if self.single is not None:
            return self.single[1] if run_id == self.single[0] else None
        with self._lock:
            return self._open.get(run_id)

    def open_ids(self) -> list[str]:
        with self._lock:
            return list(self._open)

    def _keep(self, run_id: str, now: float) -> bool:
        entry = self.discovery.runs.get(run_id)
        return entry is not None and (
            entry.live or run_id in self._must or now - self._used.get(run_id, -1e18) <= VIEWED_S
        )

    def _trim(self) -> None:
        """Drop gone runs, then the least recently used past the cap (under the lock).

        A run that must be watched is never the one dropped for the cap.
        """
        now = self.clock()
        for run_id in [r for r in self._open if r not in self.discovery.runs]:
            self._drop(run_id)
        while len(self._open) > self.cap:
            # Least recently used first, but a run neither live nor viewed before any other.
            droppable = [r for r in self._open if r not in self._must]
            if not droppable:
                break
            victim = next((r for r in droppable if not self._keep(r, now)), droppable[0])
            self._drop(victim)

    def _drop(self, run_id: str) -> None:
        rw = self._open.pop(run_id)
        self._used.pop(run_id, None)
        self._pins.pop(run_id, None)
        self._paths.pop(run_id, None)
        close(rw)

    # -- the loop -----------------------------------------------------------------

    def tick(self) -> None:
        """Scan the root; keep the live runs' watchers running; drop what is neither live nor viewed."""
        if self.single is not None:
            return
        with self._lock:
            watched = [r for r, rw in self._open.items() if _watching(rw)]
        # A run with a watcher is not dropped because a scan was cut short (P5).
        self.discovery.scan(keep=watched)
        now = self.clock()
        runs = self.discovery.runs
        must = {e.id for e in runs.values() if self._must_watch(e)}
        live = sorted(
            (e for e in runs.values() if e.live and e.id not in must),
            key=lambda e: self._evidence(e),
            reverse=True,
        )
        chosen = sorted(must) + [e.id for e in live[: max(0, self.cap - len(must))]]
        with self._lock:
            self._must = must
            for run_id in [r for r in self._open if r in runs and self._pins.get(r) != runs[r].ident]:
                self._drop(run_id)  # its directory changed identity: the old run is gone (P2)
        for run_id in chosen:
            try:
                self.get(run_id, touch=False).watcher.ensure_started()
            except RunNotFound:
                continue  # replaced since this scan: the next one finds what is there now
        self.unwatched = sorted(e.id for e in live[max(0, self.cap - len(must)) :])
        if self.unwatched:
            log.warning(
                "runs: %d live run(s) have no watcher (at most %d): %s",
                len(self.unwatched),
                self.cap,
                ", ".join(self.unwatched[:8]),
            )
        with self._lock:
            for run_id in [r for r in self._open if not self._keep(r, now)]:
                self._drop(run_id)
            self._trim()
        if self.on_tick is not None:
            self.on_tick()

    def _must_watch(self, entry: RunEntry) -> bool:
        """A run whose flag says stop; a live run while the policy or retention acts on it."""
        if FLAG in entry.markers and _flag_says_stop(entry.path):
            return True
        if not entry.live:
            return False
        if self.config.get("POLICY_MODE", "off") != "off":
            return True
        return policy_for(entry.path, self.config).mode == "on"

    def _evidence(self, entry: RunEntry) -> tuple:
        """How sure it is that a run lives: valid heartbeats (an open run's), files, the newest."""
        rw = self.peek(entry.id)
        valid = 0
        if rw is not None:
            try:
                beats, _ = rw.state.heartbeats()
                valid = sum(1 for hb in beats.values() if hb)
            except Exception:  # a container the CLI built has no state worth ranking by
                valid = 0
        return (valid, entry.evidence, entry.last_activity or 0)

    def watch_status(self) -> dict:
        """For ``/api/health``: how many runs are watched, and which live runs are not."""
        with self._lock:
            watched = sum(1 for rw in self._open.values() if _watching(rw))
        return {
            "watched": watched,
            "cap": self.cap,
            "always_watched": len(self._must),
            "unwatched": len(self.unwatched),
            "unwatched_ids": self.unwatched[:20],
            "discovery": self.discovery.status() if self.discovery is not None else None,
        }

    def ensure_started(self) -> None:
        """Start the loop (the server's worker calls this); with ``--run-dir``, that run's watcher."""
        if self.single is not None:
            self.single[1].watcher.ensure_started()
            return
        with self._lock:
            if self._task is None and self._start_task is not None:
                self._task = self._start_task(self._run)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("runs scan failed; the next one starts again")
            self._sleep(SCAN_S)

    def stop(self, timeout: float = 5.0) -> None:
        if self.single is not None:
            self.single[1].watcher.stop(timeout)
            return
        self._stopping.set()
        with self._lock:
            for run_id in list(self._open):
                self._drop(run_id)


def _watching(rw) -> bool:
    watcher = getattr(rw, "watcher", None)
    return bool(watcher is not None and getattr(watcher, "running", False))


def _flag_says_stop(path: str) -> bool:
    try:
        flag = runfiles.read_flag(path)
    except (OSError, runfiles.FlagError):
        return False
    return bool(flag and flag.exit)


def close(rw: Rankwatch) -> None:
    """Stop a container's watcher (the audit trail holds no connection between calls)."""
    watcher = getattr(rw, "watcher", None)  # the CLI's engines have none
    try:
        if watcher is not None:
            watcher.stop(timeout=2.0)
    except Exception:
        log.exception("stopping a run's watcher failed")
