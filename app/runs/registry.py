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

With ``--run-dir RUN`` the registry holds that one run under its name
(``RUN``'s last component): ``/api/runs/<name>/X`` answers as ``/api/X``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from app.errors import RunNotFound
from app.runs.discovery import Discovery, RunEntry
from app.runs.ids import single_id  # noqa: F401  (create_app imports it from here)

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
        with self._lock:
            if touch:
                self._used[run_id] = self.clock()
            rw = self._open.get(run_id)
            if rw is None:
                rw = self._open[run_id] = self._build(self.discovery.runs[run_id].path, run_id)
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
        return entry is not None and (entry.live or now - self._used.get(run_id, -1e18) <= VIEWED_S)

    def _trim(self) -> None:
        """Drop gone runs, then the least recently used past the cap (under the lock)."""
        now = self.clock()
        for run_id in [r for r in self._open if r not in self.discovery.runs]:
            self._drop(run_id)
        while len(self._open) > self.cap:
            # Least recently used first, but a run neither live nor viewed before any other.
            victim = next((r for r in self._open if not self._keep(r, now)), next(iter(self._open)))
            self._drop(victim)

    def _drop(self, run_id: str) -> None:
        rw = self._open.pop(run_id)
        self._used.pop(run_id, None)
        close(rw)

    # -- the loop -----------------------------------------------------------------

    def tick(self) -> None:
        """Scan the root; keep the live runs' watchers running; drop what is neither live nor viewed."""
        if self.single is not None:
            return
        self.discovery.scan()
        now = self.clock()
        live = sorted(
            (e for e in self.discovery.runs.values() if e.live),
            key=lambda e: -(e.last_activity or 0),
        )
        for entry in live[: self.cap]:
            self.get(entry.id, touch=False).watcher.ensure_started()
        with self._lock:
            for run_id in [r for r in self._open if not self._keep(r, now)]:
                self._drop(run_id)
            self._trim()
        if self.on_tick is not None:
            self.on_tick()

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


def close(rw: Rankwatch) -> None:
    """Stop a container's watcher (the audit trail holds no connection between calls)."""
    watcher = getattr(rw, "watcher", None)  # the CLI's engines have none
    try:
        if watcher is not None:
            watcher.stop(timeout=2.0)
    except Exception:
        log.exception("stopping a run's watcher failed")
