"""Dashboard settings, declared once as data.

``SETTINGS`` is the single list the application, the command line, the README
and ``tests/test_docs.py`` all loop over. Each setting is read from the
environment variable ``RANKWATCH_<NAME>`` and can be overridden by a
``--<name>`` flag or by the dict passed to ``create_app``. The type of a
setting is the type of its default.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

ENV_PREFIX = "RANKWATCH_"
BOOLEANS = {"1": True, "true": True, "yes": True, "on": True,
            "0": False, "false": False, "no": False, "off": False}


class Setting(NamedTuple):
    name: str
    default: Any
    help: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name

    @property
    def flag(self) -> str:
        return "--" + self.name.lower().replace("_", "-")

    def coerce(self, value: Any) -> Any:
        """Convert ``value`` (often a string from the environment) to this setting's type.

        Raises ValueError naming the setting, so a typo in an environment
        variable fails at start with a message that says which one.
        """
        kind = type(self.default)
        if kind is bool and isinstance(value, str):
            if value.strip().lower() not in BOOLEANS:
                raise ValueError(f"setting {self.name} ({self.env}) must be one of "
                                 f"{', '.join(BOOLEANS)}, not {value!r}")
            return BOOLEANS[value.strip().lower()]
        try:
            typed = kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"setting {self.name} ({self.env}) must be {kind.__name__}, "
                             f"not {value!r}") from None
        if kind in (int, float) and self.name != "PORT" and typed <= 0:
            raise ValueError(f"setting {self.name} ({self.env}) must be positive, not {typed}")
        return typed


SETTINGS: list[Setting] = [
    Setting("RUN_DIR", "",
            "The run directory the job writes (the trainers' `run_dir`). The dashboard "
            "reads only `RUN/rankwatch/`; it keeps watching a directory that does not "
            "exist yet and says so on the page."),
    Setting("HOST", "127.0.0.1",
            "Interface to listen on. Loopback by default so that the console is private "
            "to the machine unless you choose otherwise."),
    Setting("PORT", 5000, "Port to listen on; 0 picks a free one."),
    Setting("TICK_S", 0.5,
            "Seconds between two scans of the run directory. Each tick stats every "
            "heartbeat file, reads only the changed ones and pushes at most one delta, so "
            "2 Hz keeps a 1 Hz heartbeat on screen within about a second at little cost."),
    Setting("STRAGGLER_RATIO", 1.5,
            "A rank is a straggler when its median step time is at least this many times "
            "the median of its peers (score = peer median / own, at most "
            "1 / this ratio). 1.5 flags a rank that costs the job a third of its speed while "
            "ignoring ordinary jitter."),
    Setting("STRAGGLER_MIN_GAP_MS", 5.0,
            "...and at least this many milliseconds slower than that median. Tiny models on "
            "CPU step in a few milliseconds, where scheduler jitter alone reaches 1.5x; a gap "
            "below this is noise, not a slow device."),
    Setting("STRAGGLER_WINDOW", 32,
            "How many recent step times make a rank's own median. Long enough that one "
            "slow step (a checkpoint, a garbage collection) does not flag a rank, short "
            "enough that a rank that stays slow is flagged within seconds."),
    Setting("STRAGGLER_MIN_STEPS", 16,
            "A rank is not compared until its window holds this many step times. The first "
            "steps carry graph compilation, data pipeline warm-up and the other ranks' start-up "
            "competing for the cores; a median of three of them flagged healthy ranks in tests."),
    Setting("STALL_MIN_S", 5.0,
            "A training rank is stalled when it has not finished a step for "
            "max(STALL_MIN_S, STALL_FACTOR x its median step time). Five seconds is five "
            "missed heartbeats: longer than a hiccup, shorter than an operator's patience."),
    Setting("STALL_FACTOR", 5.0,
            "See STALL_MIN_S: slow models (steps of seconds) get a limit that scales with "
            "their own pace instead of a fixed one."),
    Setting("DEAD_AFTER_S", 30.0,
            "A rank whose newest heartbeat is older than this is dead (heartbeats lost). "
            "Thirty missed 1 Hz heartbeats rides out a busy host or a shared file system's "
            "attribute cache; a rank on this host is found dead sooner by its process check."),
    Setting("PROCESS_CHECK_AFTER_S", 3.0,
            "When a rank on this host has not written a heartbeat for this long, the "
            "dashboard asks psutil whether its process still exists (and is the same process: "
            "create time before the bridge started). A fresh heartbeat already proves life, "
            "so only late ranks cost a probe."),
    Setting("HISTORY_POINTS", 300,
            "Chart history kept per rank, on the server and in the browser, in time buckets "
            "of CHART_BUCKET_S: 300 one-second buckets are five minutes, and bound memory at "
            "1024 ranks."),
    Setting("CHART_BUCKET_S", 1.0,
            "Time resolution of the charts in seconds; the heartbeat rate, so one bucket "
            "holds about one heartbeat per rank."),
    Setting("CHART_REFRESH_S", 1.0,
            "The browser redraws the charts at most this often, however many deltas arrive, "
            "so a 1024-rank heat map does not starve the table."),
    Setting("CHART_LINES_MAX_RANKS", 16,
            "Up to this many ranks the step-time and loss charts draw one line per rank; "
            "above it they draw the median and the slowest rank, and a heat map of ranks x "
            "time shows the rest."),
    Setting("TOKEN", "",
            "The operator token that stop, cancel, re-arm and delete require (as "
            "`Authorization: Bearer <token>`, or typed once into the page). When unset, one is "
            "generated at start and printed once, as Jupyter does. Prefer the environment "
            "variable to the flag: command lines are visible to every user of the host."),
    Setting("AUDIT_DB", "",
            "The audit trail's SQLite file. Empty means `RUN/rankwatch/audit.sqlite3`, so the "
            "trail stays with the run it describes and survives a dashboard restart."),
    Setting("STOP_DEADLINE_S", 900.0,
            "A rank that stays in one stop stage (requested, seen, agreed, saving, saved) longer "
            "than this is flagged late. 900 s is MindCluster's default for a graceful exit."),
    Setting("AUTO_REARM", True,
            "After every rank has exited for a stop, return the flag to `{\"GracefulExit\": 0}` "
            "so that relaunching the same command trains instead of stopping at once "
            "(the stale-flag trap of llnl/scr#13). The bridge's request-id check is the second guard."),
    Setting("MAX_BODY_BYTES", 65536,
            "Largest request body accepted; larger ones get a 413. The API's bodies are a few "
            "short strings."),
    Setting("CHECKPOINT_SCAN_S", 2.0,
            "The checkpoint browser re-walks the run directory at most this often. A walk "
            "stats every file under it (only new or changed checkpoints are opened), which "
            "costs more than the heartbeat scan; a save takes seconds, so 2 s still shows a "
            "new set while the operator watches, and keeps a large shared file system quiet."),
    Setting("PAGE_SIZE", 100,
            "Table rows per page. Larger jobs are paged so that the browser redraws at most "
            "this many rows per update."),
]

SETTINGS_BY_NAME = {s.name: s for s in SETTINGS}


def from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every setting's value: from ``RANKWATCH_<NAME>`` if set, else its default."""
    environ = os.environ if environ is None else environ
    return {s.name: s.coerce(environ[s.env]) if s.env in environ else s.default
            for s in SETTINGS}


def coerce_all(config: Mapping[str, Any]) -> dict[str, Any]:
    """Coerce the known settings in ``config``; other keys (Flask's own) pass through."""
    return {k: SETTINGS_BY_NAME[k].coerce(v) if k in SETTINGS_BY_NAME else v
            for k, v in config.items()}
