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
BOOLEANS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


# Settings for which 0 means something (pick a port; retention milestones off).
ZERO_OK = ("PORT", "RETENTION_EVERY")


# The settings' groups (``Setting.group``).
G_RUN = "Run directory and address"
G_HEALTH = "Health verdicts"
G_PAGE = "Page, charts and metrics"
G_STOP = "Stop and checkpoints"
G_ACCESS = "Access"
G_INCIDENTS = "Stacks, alerts and the stop policy"
G_SERVER = "Server"
G_REDIS = "Several dashboards (Redis)"
G_AGENTS = "Agents (Redis)"

# Where a job becomes large for what one answer or one browser holds: app/large.py's
# one-at-a-time answers and the ranks page's window. Here, as this module imports no Flask.
LARGE_JOB_RANKS = 4096


class Setting(NamedTuple):
    name: str
    default: Any
    help: str
    # The only values a string setting takes, when it is one of a few words.
    choices: tuple[str, ...] = ()
    # Where ``serve --help`` and the reference list it (one of ``GROUPS``).
    group: str = ""

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
        if self.choices:
            if str(value).strip() not in self.choices:
                raise ValueError(
                    f"setting {self.name} ({self.env}) must be one of {', '.join(self.choices)}, not {value!r}"
                )
            return str(value).strip()
        if kind is bool and isinstance(value, str):
            if value.strip().lower() not in BOOLEANS:
                raise ValueError(
                    f"setting {self.name} ({self.env}) must be one of {', '.join(BOOLEANS)}, not {value!r}"
                )
            return BOOLEANS[value.strip().lower()]
        try:
            typed = kind(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"setting {self.name} ({self.env}) must be {kind.__name__}, not {value!r}"
            ) from None
        if kind in (int, float) and self.name not in ZERO_OK and typed <= 0:
            raise ValueError(f"setting {self.name} ({self.env}) must be positive, not {typed}")
        return typed


SETTINGS: list[Setting] = [
    Setting(
        "RUN_DIR",
        "",
        "The run directory the job writes (the trainers' `run_dir`). The dashboard "
        "reads `RUN/rankwatch/` (and msrun's worker logs, see LOG_DIR); it keeps watching "
        "a directory that does not exist yet and says so on the page.",
        group=G_RUN,
    ),
    Setting(
        "LOG_DIR",
        "",
        "Where msrun writes the worker logs (its `--log_dir`), read to show ranks whose script "
        "runs without the bridge (`worker_N.log`, `scheduler.log`). Empty means `RUN/msrun_logs`; "
        "a relative path is taken from the run directory. Only new bytes are read each tick.",
        group=G_RUN,
    ),
    Setting(
        "RUNS_ROOT",
        "",
        "A directory of runs (`rankwatch serve --runs ROOT`): every run below it, to RUNS_DEPTH levels, "
        "is listed on the landing page `/` and has its own console at `/runs/<id>/`. A run is a directory "
        "holding `rankwatch/`, msrun worker logs (LOG_DIR) or a `graceful_exit.json`; its id is its path "
        "relative to ROOT. Symlinks are not followed. Give either this or RUN_DIR.",
        group=G_RUN,
    ),
    Setting(
        "RUNS_DEPTH",
        3,
        "How many directory levels below RUNS_ROOT are searched for runs (1: only its children). A run's "
        "own subdirectories are never searched.",
        group=G_RUN,
    ),
    Setting(
        "RUN_IDLE_S",
        300.0,
        "A run is live while one of its heartbeats or worker logs was written within this many seconds; "
        "live runs (and the ones being viewed) keep their engines loaded and are read every tick, idle "
        "ones are read when their files change.",
        group=G_RUN,
    ),
    Setting(
        "PYSPY_PATH",
        "",
        "An absolute path to the `py-spy` the dashboard runs to capture a local rank its bridge "
        "cannot answer for. Empty: the copy beside the dashboard's Python (its venv's `bin`); "
        "`PATH` is never searched. The bridge reads the same variable for its native frames.",
        group=G_INCIDENTS,
    ),
    Setting(
        "HOST",
        "127.0.0.1",
        "Interface to listen on. Loopback by default so that the console is private "
        "to the machine unless you choose otherwise.",
        group=G_RUN,
    ),
    Setting("PORT", 5000, "Port to listen on; 0 picks a free one.", group=G_RUN),
    Setting(
        "ALLOWED_HOSTS",
        "",
        "Host names, besides `localhost`, `127.0.0.1`, `::1` and the bound address (all of this "
        "machine's names and addresses when bound to 0.0.0.0), that requests may carry in their "
        "`Host` header; comma-separated, `*.example.com` for subdomains, `*` for any. Others get a "
        "400: this is what stops a web page that rebinds its own name to 127.0.0.1 (DNS rebinding) "
        "from reading the dashboard. Behind a reverse proxy, add the name users type.",
        group=G_RUN,
    ),
    Setting(
        "SERVER_THREADS",
        64,
        "Requests the server works on at once (gunicorn's threaded worker, one process). "
        "Each open page holds one for its WebSocket; API calls and page loads take one "
        "for a few milliseconds. Slow or idle connections hold none (HEADER_TIMEOUT_S).",
        group=G_SERVER,
    ),
    Setting(
        "HEADER_TIMEOUT_S",
        10.0,
        "A connection must send a complete request head (request line and headers) "
        "within this many seconds, or it is closed. Heads are read without a thread, so "
        "hundreds of slow or idle connections (slowloris) cannot starve the page; a browser "
        "sends its head at once.",
        group=G_SERVER,
    ),
    Setting(
        "BODY_TIMEOUT_S",
        10.0,
        "A request's body (at most MAX_BODY_BYTES, with a Content-Length) must arrive within this "
        "many seconds of its head, or it is answered 408 and the connection closed. Bodies are read "
        "without a thread, like heads, so POSTs that trickle a byte now and then hold none.",
        group=G_SERVER,
    ),
    Setting(
        "RESERVED_THREADS",
        4,
        "Threads kept, besides SERVER_THREADS, for requests that carry the operator token "
        "(`Authorization: Bearer`) and for `/api/health`: the stop and the health check answer "
        "while tokenless clients (idle WebSockets, long polls) hold every other thread.",
        group=G_SERVER,
    ),
    Setting(
        "MAX_CONNS_PER_ADDR",
        128,
        "Open connections one client address may hold once half of MAX_CONNECTIONS are open; a "
        "further one is then answered 503 and closed, so that one address cannot fill the server. "
        "A page needs one or two. Behind a reverse proxy every client has the proxy's address: "
        "raise it there.",
        group=G_SERVER,
    ),
    Setting(
        "MAX_CONNECTIONS",
        1000,
        "Open connections in all (gunicorn's `worker_connections`); past it new ones wait in the "
        "kernel's queue until one closes (slow heads close after HEADER_TIMEOUT_S, slow bodies after "
        "BODY_TIMEOUT_S).",
        group=G_SERVER,
    ),
    Setting(
        "READ_TIMEOUT_S",
        60.0,
        "Once a request is in, a write of its answer (or a WebSocket's read) that "
        "waits longer than this fails and frees the thread; an open page's WebSocket hears "
        "Engine.IO's ping every 25 s, so this must be longer than that.",
        group=G_SERVER,
    ),
    Setting(
        "TICK_S",
        0.5,
        "Seconds between two scans of the run directory. Each tick stats every "
        "heartbeat file, reads only the changed ones and pushes at most one delta, so "
        "2 Hz keeps a 1 Hz heartbeat on screen within about a second at little cost.",
        group=G_HEALTH,
    ),
    Setting(
        "STRAGGLER_RATIO",
        1.5,
        "A rank is a straggler when its median step time is at least this many times "
        "the median of its peers (score = peer median / own, at most "
        "1 / this ratio). 1.5 flags a rank that costs the job a third of its speed while "
        "ignoring ordinary jitter.",
        group=G_HEALTH,
    ),
    Setting(
        "STRAGGLER_MIN_GAP_MS",
        5.0,
        "...and at least this many milliseconds slower than that median. Tiny models on "
        "CPU step in a few milliseconds, where scheduler jitter alone reaches 1.5x; a gap "
        "below this is noise, not a slow device.",
        group=G_HEALTH,
    ),
    Setting(
        "STRAGGLER_WINDOW",
        32,
        "How many recent step times make a rank's own median. Long enough that one "
        "slow step (a checkpoint, a garbage collection) does not flag a rank, short "
        "enough that a rank that stays slow is flagged within seconds.",
        group=G_HEALTH,
    ),
    Setting(
        "STRAGGLER_MIN_STEPS",
        16,
        "A rank is not compared until its window holds this many step times. The first "
        "steps carry graph compilation, data pipeline warm-up and the other ranks' start-up "
        "competing for the cores; a median of three of them flagged healthy ranks in tests.",
        group=G_HEALTH,
    ),
    Setting(
        "STALL_MIN_S",
        5.0,
        "A training rank is stalled when it has not finished a step for "
        "max(STALL_MIN_S, STALL_FACTOR x its median step time). Five seconds is five "
        "missed heartbeats: longer than a hiccup, shorter than an operator's patience.",
        group=G_HEALTH,
    ),
    Setting(
        "STALL_FACTOR",
        5.0,
        "See STALL_MIN_S: slow models (steps of seconds) get a limit that scales with "
        "their own pace instead of a fixed one.",
        group=G_HEALTH,
    ),
    Setting(
        "DEAD_AFTER_S",
        30.0,
        "A rank whose newest heartbeat is older than this is dead (heartbeats lost). "
        "Thirty missed 1 Hz heartbeats rides out a busy host or a shared file system's "
        "attribute cache; a rank on this host is found dead sooner by its process check.",
        group=G_HEALTH,
    ),
    Setting(
        "PROCESS_CHECK_AFTER_S",
        3.0,
        "When a rank on this host has not written a heartbeat for this long, the "
        "dashboard asks psutil whether its process still exists (and is the same process: "
        "create time before the bridge started). A fresh heartbeat already proves life, "
        "so only late ranks cost a probe.",
        group=G_HEALTH,
    ),
    Setting(
        "BRIDGE_GRACE_S",
        120.0,
        "While msrun's worker logs show ranks but no heartbeat has come, the page warns that "
        "the script may lack the bridge (and may ignore a stop) only once job.json's rank 0 no "
        "longer runs on this host and this long has passed since the job started: the bridge "
        "writes its first heartbeat after graph compilation.",
        group=G_HEALTH,
    ),
    Setting(
        "HISTORY_POINTS",
        300,
        "Chart history kept per rank, on the server and in the browser, in time buckets "
        "of CHART_BUCKET_S: 300 one-second buckets are five minutes, and bound memory at "
        "1024 ranks.",
        group=G_PAGE,
    ),
    Setting(
        "CHART_BUCKET_S",
        1.0,
        "Time resolution of the charts in seconds; the heartbeat rate, so one bucket "
        "holds about one heartbeat per rank.",
        group=G_PAGE,
    ),
    Setting(
        "CHART_REFRESH_S",
        1.0,
        "The browser redraws the charts at most this often, however many deltas arrive, "
        "so a 1024-rank heat map does not starve the table.",
        group=G_PAGE,
    ),
    Setting(
        "CHART_LINES_MAX_RANKS",
        16,
        "Above this many ranks the run page adds a heat map of ranks x time (the last "
        "HISTORY_POINTS buckets of each rank's step time) below the whole-run charts.",
        group=G_PAGE,
    ),
    Setting(
        "RUN_HISTORY_POINTS",
        10_000,
        "Points kept per run for the whole-run step-time and loss charts (one per attempt "
        "and global step, 40 bytes each). The last hour is kept whole, older points one a "
        "minute; past the cap the oldest ranges are thinned further, and the page says so.",
        group=G_PAGE,
    ),
    Setting(
        "TOKEN",
        "",
        "The operator token that stop, cancel, re-arm and delete require (as "
        "`Authorization: Bearer <token>`, or typed once into the page). When unset, one is "
        "generated at start. It is never printed: the dashboard prints a single-use login link "
        "instead (`rankwatch login` mints another). Prefer the environment variable to the "
        "flag: command lines are visible to every user of the host. A token shorter than 16 "
        "characters, or with little entropy, is warned about at start.",
        group=G_ACCESS,
    ),
    Setting(
        "LOGIN_TTL_S",
        120.0,
        "How long a single-use login link works (the one printed at start, and each one "
        "`rankwatch login` prints). Two minutes is enough to open a link just printed; a link "
        "found later in a scrollback or a log is dead.",
        group=G_ACCESS,
    ),
    Setting(
        "LOGIN_LINK",
        "auto",
        "Where the start-up login link is printed: `auto` prints it when the output is a terminal, "
        "and only the address otherwise (a log file or a service's journal keeps no link); `always`; "
        "`never`. `rankwatch login` prints a fresh one on demand.",
        choices=("auto", "always", "never"),
        group=G_ACCESS,
    ),
    Setting(
        "AUDIT_DB",
        "",
        "The audit trail's SQLite file. Empty means `RUN/rankwatch/audit.sqlite3`, so the "
        "trail stays with the run it describes and survives a dashboard restart.",
        group=G_STOP,
    ),
    Setting(
        "STOP_DEADLINE_S",
        900.0,
        "A rank that stays in one stop stage (requested, seen, agreed, saving, saved) longer "
        "than this is flagged late. 900 s is MindCluster's default for a graceful exit.",
        group=G_STOP,
    ),
    Setting(
        "STOP_HOLDING_AFTER_S",
        10.0,
        "During a stop, the ranks at the lowest stage are named as holding the others up only "
        "once they have been in that stage this long (and never when every rank is there): "
        "a normal stop moves every rank through a stage within a second or two, save times aside.",
        group=G_STOP,
    ),
    Setting(
        "AUTO_REARM",
        True,
        'After every rank has exited for a stop, return the flag to `{"GracefulExit": 0}` '
        "so that relaunching the same command trains instead of stopping at once "
        "(the stale-flag trap of llnl/scr#13). The bridge's request-id check is the second guard.",
        group=G_STOP,
    ),
    Setting(
        "MAX_BODY_BYTES",
        65536,
        "Largest request body accepted; larger ones get a 413. The API's bodies are a few short strings.",
        group=G_SERVER,
    ),
    Setting(
        "OPERATOR_WRITES_PER_MIN",
        30,
        "Changes (stop, cancel, re-arm, delete, verify) one client address may make per minute, "
        "in a burst or spread out; more get a 429 with Retry-After, except a stop request, which "
        "always goes through (past the budget a press that joins a pending stop is not audited). "
        "A person clicks a few; this stops a script with the token from filling the audit trail "
        "without bound.",
        group=G_ACCESS,
    ),
    Setting(
        "AUTH_FAILURES_PER_MIN",
        20,
        "Wrong operator tokens and login codes counted per minute from all addresses together "
        "(each address also backs off on its own, exponentially); past it every wrong guess gets "
        "a 429 until the minute allows, with a log line and an alert (`auth_flood`) when it trips. "
        "The right token is never refused, so guessing cannot lock the operator out.",
        group=G_ACCESS,
    ),
    Setting(
        "CHECKPOINT_SCAN_S",
        2.0,
        "The checkpoint browser re-walks the run directory at most this often. A walk "
        "stats every file under it (only new or changed checkpoints are opened), which "
        "costs more than the heartbeat scan; a save takes seconds, so 2 s still shows a "
        "new set while the operator watches, and keeps a large shared file system quiet.",
        group=G_STOP,
    ),
    Setting(
        "PAGE_SIZE",
        100,
        "Table rows per page. Larger jobs are paged so that the browser redraws at most "
        "this many rows per update.",
        group=G_PAGE,
    ),
    Setting(
        "PAGE_WINDOW_RANKS",
        LARGE_JOB_RANKS,
        "Above this many ranks the ranks page runs windowed: each browser gets the summary, "
        "the run status and only the rows on its screen, and the server pages, filters and "
        "sorts (rank or trouble first), so what a browser receives does not grow with the job. "
        "Up to it the browser gets every row and does that itself.",
        group=G_PAGE,
    ),
    Setting(
        "METRICS_PER_RANK_MAX",
        1024,
        "`/metrics` serves each rank's series up to this many ranks; above it, only summaries "
        "(ranks per verdict, per host and verdict, per stop stage), so a large job does not "
        "give Prometheus a dozen series per rank. `/metrics?per_rank=1` asks for every rank anyway "
        "(one such answer is built at a time), `?per_rank=0` for the summaries only.",
        group=G_PAGE,
    ),
    Setting(
        "WEBHOOK_URL",
        "",
        "Where alerts go: one URL, or several separated by commas, each receiving a JSON POST "
        '(`event`, `text`, `job`, `at`; see "When a job hangs"). Empty: no alerts. The page and '
        "the delivery log show only each URL's host, since incoming-webhook URLs carry their secret "
        "in the path.",
        group=G_INCIDENTS,
    ),
    Setting(
        "WEBHOOK_TIMEOUT_S",
        5.0,
        "Seconds one delivery attempt may take. Deliveries run on a thread per URL, so a slow "
        "receiver delays only its own alerts, never the watcher.",
        group=G_INCIDENTS,
    ),
    Setting(
        "WEBHOOK_RETRY_MAX_S",
        30.0,
        "A failed delivery is retried after 1, 2, 4, 8, 16 s, then at most this far apart: a "
        "receiver back after a restart gets its alerts within seconds, a long outage costs two "
        "attempts a minute.",
        group=G_INCIDENTS,
    ),
    Setting(
        "WEBHOOK_GIVE_UP_S",
        900.0,
        "An alert not delivered this long after it was raised is given up (and the delivery log "
        "says so): a stall alert an hour late misleads more than it helps.",
        group=G_INCIDENTS,
    ),
    Setting(
        "ALERT_GROUP_S",
        2.0,
        "Verdict changes are held this long and sent together. A job-wide hang turns ranks "
        "stalled over a second or two, not in one tick; two seconds gathers them into one "
        "alert for a small delay.",
        group=G_INCIDENTS,
    ),
    Setting(
        "ALERT_SUMMARY_OVER",
        5,
        "Up to this many verdict changes in one group are sent one alert each; more become one "
        'summary alert ("1024 ranks changed verdict: 1024 stalled (ranks 0-1023)").',
        group=G_INCIDENTS,
    ),
    Setting(
        "ALERT_RATE_PER_MIN",
        20,
        "At most this many verdict alerts a minute; past it, changes wait and go out as one summary. "
        "Stop and policy alerts are never held back.",
        group=G_INCIDENTS,
    ),
    Setting(
        "POLICY_MODE",
        "off",
        "The automatic stop policy: `off` (default), `dry_run` (log, audit and alert what it would do, "
        "stop nothing) or `on` (stop gracefully, as the button does, with who = `policy`).",
        group=G_INCIDENTS,
    ),
    Setting(
        "POLICY_RULES",
        "device_unhealthy:60",
        "The policy's rules as `kind:seconds`, comma-separated; kinds `device_unhealthy` (npu-smi "
        "health not OK), `straggler`, `stalled`, `node_lost`. A rule fires when one rank (or host) "
        "has been in that state for that long, at most once per job run. Checked at start whatever the "
        "mode (a typo fails at once); acted on only when POLICY_MODE is not `off`.",
        group=G_INCIDENTS,
    ),
    Setting(
        "REDIS_URL",
        "",
        "Opt-in, for jobs of thousands of ranks: a Redis URL (`redis://host:6379/0`) set on the "
        "trainers and the dashboard alike. Ranks then publish heartbeats to it and the dashboard "
        "reads only the new ones instead of stat'ing every heartbeat file; several dashboard "
        "processes share it as Flask-SocketIO's message queue. The flag and checkpoints stay in "
        "the run directory. Needs `pip install 'rankwatch[redis]'`. A password, an ACL user and TLS "
        "go in the URL (`rediss://rankwatch:PASSWORD@host:6380/0`); see REDIS_KEY.",
        group=G_REDIS,
    ),
    Setting(
        "REDIS_JOB",
        "",
        "The job's name in Redis. Empty: a digest of the run directory's real path, which is "
        "right when every node mounts it at the same path; set the same name on every node and "
        "the dashboard otherwise.",
        group=G_REDIS,
    ),
    Setting(
        "REDIS_KEY",
        "",
        "With `REDIS_URL`: a shared secret, set to the same value on the trainers and every dashboard "
        "(`RANKWATCH_REDIS_KEY` on both). The bridge then signs each heartbeat it publishes "
        "(HMAC-SHA256) and the dashboards sign their message-queue messages; unsigned or badly "
        "signed ones are dropped, counted and shown as a warning. Empty: Redis is trusted as it is "
        "(see the Security section on running Redis).",
        group=G_REDIS,
    ),
    Setting(
        "LEADER_TTL_S",
        10.0,
        "With `REDIS_URL`, several dashboard processes may serve one job; one of them, the leader, "
        "holds a lock in Redis that expires this long after its last renewal (every tick). A "
        "follower takes over at most this long after the leader died.",
        group=G_REDIS,
    ),
    Setting(
        "AGENTS",
        False,
        "With `REDIS_URL`: the job runs `rankwatch agent` on every node (docs/production.md, "
        '"One agent per node"), and this dashboard shows the ranks from the agents\' host digests '
        "instead of reading heartbeats. The run's name in Redis is `RUN`, else the run directory's "
        "base name, the same as the agents' `--run`.",
        group=G_AGENTS,
    ),
    Setting(
        "RUN",
        "",
        "With `REDIS_URL`: the run's name the agents publish under (their `--run`); setting it turns "
        "`AGENTS` on. Letters, digits, `.`, `_` and `-`.",
        group=G_AGENTS,
    ),
    Setting(
        "AGENT_LOST_S",
        10.0,
        "With agents: a host whose agent sent no digest for this long shows its ranks as `agent lost` "
        "(their last figures; not counted as ended), until its next digest.",
        group=G_AGENTS,
    ),
    Setting(
        "HUB_GROUP",
        "",
        "With agents: the Redis consumer group this dashboard reads the digests through. Empty: one of "
        "its own, so every dashboard process shows every host. Processes given the same name split the "
        "digests between them (the load divides, and each shows only the hosts it read).",
        group=G_AGENTS,
    ),
    Setting(
        "RETENTION_MODE",
        "off",
        'Checkpoint retention (docs/checkpoints.md, "Retention"): `off` (default: only the plan is '
        "shown), `dry_run` (audit and alert what it would delete, delete nothing) or `on` (apply the plan "
        "after each new complete set, with who = `policy`). A run's `rankwatch/retention.json` overrides it.",
        group=G_STOP,
    ),
    Setting(
        "RETENTION_KEEP", 3, "Retention keeps the newest this many complete checkpoint sets.", group=G_STOP
    ),
    Setting(
        "RETENTION_EVERY",
        0,
        "Retention also keeps every set whose global step is a multiple of this (milestones); 0: off.",
        group=G_STOP,
    ),
    Setting(
        "RETENTION_SETTLE_S",
        30.0,
        "Retention never deletes a set with a file whose size or mtime changed in the last this many "
        "seconds: a rank may still be writing it.",
        group=G_STOP,
    ),
    Setting(
        "RETENTION_TMP_AGE_S",
        3600.0,
        "Leftover temporary checkpoint directories (MindIO TTP `*_tmp`, NeMo `-unfinished`, Orbax "
        "`*.orbax-checkpoint-tmp*`) are collected once untouched for this long.",
        group=G_STOP,
    ),
]

SETTINGS_BY_NAME = {s.name: s for s in SETTINGS}

# How ``rankwatch serve --help`` groups the settings, in this order; a setting
# not listed here is shown under "Other settings".
# The groups `rankwatch serve --help` and docs/reference.md list the settings in, in this order.
GROUPS: tuple[str, ...] = (
    G_RUN,
    G_HEALTH,
    G_PAGE,
    G_STOP,
    G_ACCESS,
    G_INCIDENTS,
    G_SERVER,
    G_REDIS,
    G_AGENTS,
)


def grouped() -> list[tuple[str, list[Setting]]]:
    """``SETTINGS`` by group, in ``GROUPS``' order (each group in ``SETTINGS``' order)."""
    return [(title, [s for s in SETTINGS if s.group == title]) for title in GROUPS]


# Engine.IO's default ping interval (Flask-SocketIO passes it through): a live
# WebSocket hears from its page at least this often (see READ_TIMEOUT_S).
PING_INTERVAL_S = 25


def from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every setting's value: from ``RANKWATCH_<NAME>`` if set, else its default."""
    environ = os.environ if environ is None else environ
    return {s.name: s.coerce(environ[s.env]) if s.env in environ else s.default for s in SETTINGS}


def coerce_all(config: Mapping[str, Any]) -> dict[str, Any]:
    """Coerce the known settings in ``config``; other keys (Flask's own) pass through."""
    return {k: SETTINGS_BY_NAME[k].coerce(v) if k in SETTINGS_BY_NAME else v for k, v in config.items()}
