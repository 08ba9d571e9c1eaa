"""Where one rank's heartbeats go: its heartbeat file (and its history), and Redis when ``RANKWATCH_REDIS_URL`` is set.

Without Redis every heartbeat replaces ``rankwatch/rank_{r}.json``, as
always. With it (``trainer_bridge/rundir/redisbus.py``) every heartbeat is
published, and the file is replaced only every ``FILE_EVERY_S`` seconds and
whenever the rank's ``state`` is not ``training`` (a stop's stages, the
exit, a failure): enough for a restarted dashboard, for ``rankwatch stop``
and ``rankwatch status`` without a dashboard, and for forensics, at a tenth
of the metadata load on a shared file system.

Redis down never blocks or stops training: the publisher's calls have short
timeouts and back off (``redisbus.RETRY_S``); while it is down, every
heartbeat goes to the file again and ``warnings`` says so, so the dashboard
shows why. A missing ``redis`` package with the variable set is the same: a
warning, and files.
"""

from __future__ import annotations

import logging
import os
import time

from trainer_bridge.rundir import redisbus, runfiles, safeio, schema

# Seconds between heartbeat files while Redis carries the heartbeats.
FILE_EVERY_S = 10.0

log = logging.getLogger("trainer_bridge")


class BeatSink:
    """Write one rank's heartbeats; ``write`` raises only OSError, from the file."""

    def __init__(self, run_dir, rank: int, world_size: int, url: str | None = None, clock=time.monotonic):
        self.run_dir = run_dir
        self.path = runfiles.heartbeat_path(run_dir, rank)
        # The state directory, held open: the heartbeat and its history are
        # written relative to it, a few syscalls each (safeio.HeldDir).
        self.dir = safeio.HeldDir(run_dir, runfiles.STATE_DIR)
        self.rank = rank
        self._clock = clock
        self._file_due = 0.0
        self._last_state: str | None = None
        self._setup_error: str | None = None
        self._history_size: int | None = None
        self.publisher: redisbus.Publisher | None = None
        url = os.environ.get(redisbus.REDIS_URL_ENV, "").strip() if url is None else url
        if not url:
            return
        try:
            import redis  # noqa: F401  (only to know it is there)
        except ImportError:
            self._setup_error = (
                f"{redisbus.REDIS_URL_ENV} is set but the redis package is not installed "
                "(pip install 'rankwatch[redis]'): heartbeats go to files"
            )
            log.warning("rankwatch: %s", self._setup_error)
            return
        try:
            publisher = redisbus.Publisher(
                url, redisbus.job_key(run_dir), world_size, key=redisbus.env_key(rank), clock=clock
            )
            publisher.rank_key(rank)  # a key for another rank (or none readable) is said now, not per beat
        except (OSError, ValueError) as e:
            self._setup_error = f"cannot take this rank's redis key ({e}): heartbeats go to files"
            log.warning("rankwatch: %s", self._setup_error)
            return
        self.publisher = publisher

    @property
    def warnings(self) -> list[str]:
        """What the heartbeat should say about its transport (empty when all is well)."""
        if self._setup_error:
            return [self._setup_error]
        if self.publisher is not None and self.publisher.error:
            return [f"{self.publisher.error}: heartbeats go to files at the full rate (training continues)"]
        return []

    def write(self, data: bytes, state: str) -> None:
        """Publish ``data`` (a heartbeat's JSON) and/or replace the heartbeat file, as the rules above say."""
        published = False
        if self.publisher is not None:
            try:
                published = self.publisher.publish(self.rank, data)
            except Exception as e:  # an unexpected library error must not reach the training loop
                if self._setup_error is None:
                    log.warning("rankwatch: publishing to redis failed (training continues): %r", e)
                self._setup_error = f"publishing to redis failed: {e!r}; heartbeats go to files"
                self.publisher = None
        now = self._clock()
        if not published or state != "training" or state != self._last_state or now >= self._file_due:
            # No fsync: os.replace already keeps readers from torn files, and a
            # heartbeat lost to a power cut is replaced a second later.
            self.dir.write_atomic(self.path.name, data)
            self._file_due = now + FILE_EVERY_S
        self._last_state = state

    def append_history(self, beat: schema.Heartbeat) -> None:
        """Append ``beat``'s line to the rank's heartbeat history; raises OSError only."""
        name = runfiles.history_path(self.run_dir, self.rank).name
        line = schema.HistoryLine.of(beat).to_json() + b"\n"
        # Rotated by the size the last append returned, not a stat per
        # heartbeat (one metadata operation fewer a second on a shared file
        # system). The first append of a launch learns the size.
        size, self._history_size = self._history_size, None  # a failed append learns it again
        if size is None:
            size = self.dir.append(name, b"")
        if size + len(line) > runfiles.HISTORY_SEGMENT_BYTES:
            try:
                self.dir.replace(name, f"{name}.1")
            except FileNotFoundError:
                pass
        # Never blocks and follows nothing: a FIFO or a symlink put at the
        # history's name is refused (NotRegular, an OSError reported once).
        self._history_size = self.dir.append(name, line)

    def close(self) -> None:
        self.dir.close()
        if self.publisher is not None:
            self.publisher.close()
