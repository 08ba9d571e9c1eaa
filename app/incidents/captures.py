"""Reading stack captures from a hostile run directory at a bounded cost per request.

Every rank's capture directory is written by that rank (attacker B), and
``GET /api/stacks`` is tokenless. A rank may keep up to ``MAX_TRIED`` junk
files of ``MAX_CAPTURE_BYTES`` in front of its real captures, so one rank can
make a request parse 16 MiB; 8 ranks made it 128 MiB, 0.7 to 1.7 s per
request (issue 32, P10), and, counted against the parsed-capture cache,
that junk flushed the cache on every request. So:

* a file that is not a valid capture is remembered by its stat signature
  at no cost to the cache's byte budget (it holds nothing);
* every request may parse at most ``READ_BUDGET_BYTES`` of files not
  already cached, across all ranks. That is one rank's worst case: a single
  rank's request always completes, and many ranks' junk costs no more;
* ranks are served round-robin by depth (every rank's newest file, then
  every rank's second, ...), so one rank's junk cannot spend the budget
  before another rank's real capture is read. A rank the budget did not
  reach is reported as unread, never as "no capture"; its files are read
  by later requests, whose cache hits are free.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from trainer_bridge.rundir import runfiles, schema, stackfiles

# Capture files kept parsed in memory, by their size on disk (a capture is
# typically 10-30 KB: 1,024 ranks' newest fit many times over).
CACHE_BYTES = 64 * 1024 * 1024
# What a remembered invalid file costs the cache: its key, no content.
INVALID_COST = 256
# A rank's capture directory is listed again at most this often while unchanged.
LIST_TTL_S = 1.0
# Capture files tried per rank, newest first: the bridge keeps 8, so the rest is junk.
MAX_TRIED = 32
# Bytes of uncached capture files one request may parse, across all ranks.
READ_BUDGET_BYTES = MAX_TRIED * stackfiles.MAX_CAPTURE_BYTES

UNREAD = object()  # the budget ran out before this file could be read


@dataclass
class Budget:
    """What one request may still read, and what it did read (``bytes``, ``files``)."""

    left: int = READ_BUDGET_BYTES
    bytes: int = 0
    files: int = 0


class CaptureReader:
    """One run directory's capture files: listed, parsed and cached, within a budget per request."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._lock = threading.Lock()
        # path -> (stat key, capture or None), oldest use first
        self._cache: collections.OrderedDict[Path, tuple[tuple, dict | None, int]] = collections.OrderedDict()
        self._cache_bytes = 0
        self._listings: dict[int, tuple[tuple, float, list[Path]]] = {}  # rank -> (dir key, when, files)

    def load(self, path: Path, budget: Budget) -> dict | None | object:
        """A capture file as a dict, cached by (inode, mtime, size); None if invalid, ``UNREAD`` past the budget."""
        try:
            st = path.stat()
        except OSError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            hit = self._cache.get(path)
            if hit is not None and hit[0] == key:
                self._cache.move_to_end(path)
                return hit[1]
        # A file over the cap is refused without being read: it costs nothing.
        cost = st.st_size if st.st_size <= stackfiles.MAX_CAPTURE_BYTES else 0
        if cost > budget.left:
            return UNREAD
        budget.left -= cost
        budget.bytes += cost
        budget.files += 1
        try:
            capture = stackfiles.load_capture(path).to_dict()
        except (OSError, schema.SchemaError):
            capture = None
        held = st.st_size if capture is not None else INVALID_COST
        with self._lock:
            old = self._cache.pop(path, None)
            if old is not None:
                self._cache_bytes -= old[2]
            # Bounded by what it holds: a hostile run directory full of
            # maximal captures must not grow the dashboard without limit.
            while self._cache and self._cache_bytes + held > CACHE_BYTES:
                _, (_, _, gone) = self._cache.popitem(last=False)
                self._cache_bytes -= gone
            self._cache[path] = (key, capture, held)
            self._cache_bytes += held
        return capture

    def files(self, rank: int) -> list[Path]:
        """``stackfiles.capture_files``, listed again only when the directory changed or ``LIST_TTL_S`` passed.

        A tokenless viewer can ask for every rank's stacks as often as it
        likes: each request then costs one ``stat`` per rank, and a directory
        stuffed with junk at most one bounded listing per ``LIST_TTL_S``.
        """
        folder = runfiles.stack_captures_dir(self.run_dir, rank)
        try:
            st = os.stat(folder)
        except OSError:
            return []
        key, now = (st.st_ino, st.st_mtime_ns), time.monotonic()
        with self._lock:
            hit = self._listings.get(rank)
        # The TTL covers a change within the mtime's granularity (a clock tick).
        if hit is not None and hit[0] == key and now - hit[1] < LIST_TTL_S:
            return hit[2]
        files = stackfiles.capture_files(self.run_dir, rank)
        with self._lock:
            if len(self._listings) > schema.MAX_RANKS:
                self._listings.clear()
            self._listings[rank] = (key, now, files)
        return files

    def newest(self, ranks: list[int], budget: Budget, trigger: str | None = None) -> tuple[dict, list[int]]:
        """Each rank's newest valid capture (of ``trigger``) among its newest ``MAX_TRIED`` files.

        Returns ``({rank: capture or None}, unread)``: ``unread`` lists the
        ranks the budget ran out on before their answer was known.
        """
        queue = {}
        for r in ranks:
            paths = self.files(r)[:MAX_TRIED]
            if trigger is not None:
                paths = [p for p in paths if p.name.endswith(f"-{trigger}.json")]
            queue[r] = paths
        found: dict[int, dict | None] = {}
        unread: list[int] = []
        pending = list(ranks)
        depth = 0
        while pending:
            still = []
            for r in pending:
                paths = queue[r]
                if depth >= len(paths):
                    found[r] = None
                    continue
                capture = self.load(paths[depth], budget)
                if capture is UNREAD:
                    unread.append(r)
                elif capture is not None and capture["rank"] == r:
                    found[r] = capture
                else:
                    still.append(r)
            pending = still
            depth += 1
        return found, sorted(unread)
