"""The stop flag as a rank reads it: only when its file changed, never blocking, never followed.

``FlagPoller.read`` stats the flag file and reads it again only when its
mtime, size or inode changed (or when asked to, before a vote). A flag that
cannot be read (garbage, a torn write, too large) is logged once per
distinct file and otherwise ignored: training goes on. A flag that no longer
says stop, or asks for a stop the ranks already saved for (llnl/scr#13: it
must not stop the relaunch), withdraws a request not yet voted through.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from trainer_bridge.rundir import runfiles
from trainer_bridge.saving import Served

log = logging.getLogger("trainer_bridge")


class FlagPoller:
    """One rank's reads of ``RUN/rankwatch/stop.flag``; not thread-safe (the reporter holds a lock)."""

    def __init__(self, run_dir: Path, served: Served, log_once: Callable[..., None]):
        self.run_dir = run_dir
        self.served = served
        self._log_once = log_once
        self._sig = None  # (mtime, size, inode) of the file last read
        self._bad_logged: set = set()

    def read(self, force: bool = False) -> tuple[runfiles.Flag | None, str | None]:
        """(the request the flag makes, or None; why a request seen is withdrawn, or None).

        ``(None, None)``: nothing new (unchanged, unreadable, or not to be read now).
        """
        path = runfiles.flag_path(self.run_dir)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._sig = None
            return None, "the flag file was removed"
        except OSError as e:
            self._log_once(f"flagstat:{e.errno}", "rankwatch: cannot stat %s: %s", path, e)
            return None, None
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        if sig == self._sig and not force:
            return None, None
        self._sig = sig
        try:
            flag = runfiles.parse_flag(runfiles.read_capped(path))
        except (OSError, runfiles.FlagError, runfiles.FileTooLarge) as e:
            # Garbage or a torn write: log it once per distinct file, keep training.
            if sig not in self._bad_logged:
                self._bad_logged.add(sig)
                log.warning("rankwatch: ignoring unreadable stop flag %s: %s", path, e)
            return None, None
        # A request the ranks already saved for is stale (llnl/scr#13): it
        # must not stop the relaunch.
        if not flag.exit or self.served.covers(flag, st.st_mtime):
            return None, "the flag no longer says stop (cancelled)"
        return flag, None
