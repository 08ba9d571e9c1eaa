"""When a job hangs: stack captures, webhook alerts and the automatic stop policy."""

from __future__ import annotations

from app.config.setting import G_INCIDENTS, Setting

SETTINGS: list[Setting] = [
    Setting(
        "PYSPY_PATH",
        "",
        "An absolute path to the `py-spy` the dashboard runs to capture a local rank its bridge "
        "cannot answer for. Empty: the copy beside the dashboard's Python (its venv's `bin`); "
        "`PATH` is never searched. The bridge reads the same variable for its native frames.",
        group=G_INCIDENTS,
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
        "SPIKE_MODE",
        "observe",
        "Loss spikes and NaN (docs/incidents.md): `off`; `observe` (default: alert, mark the chart, record "
        "what `enforce` would do, stop nothing); `enforce` (ask `rankwatch launch` for a rollback, stop "
        "gracefully as `policy`). A run's `rankwatch/spikes.json` overrides the `SPIKE_*` settings.",
        choices=("off", "observe", "enforce"),
        group=G_INCIDENTS,
    ),
    Setting(
        "SPIKE_FACTOR",
        3.0,
        "A loss (or reported global norm) above this many times the rank's rolling median is abnormal, "
        "if it also clears the window's noise (docs/incidents.md, Loss spikes and NaN). "
        "Must be above 1.",
        group=G_INCIDENTS,
    ),
    Setting(
        "SPIKE_STEPS",
        3,
        "A spike is abnormal losses over this many global steps in a row (and three samples at least, "
        "or this many if fewer: one odd value is never a spike).",
        group=G_INCIDENTS,
    ),
    Setting(
        "SPIKE_RECOVER_STEPS",
        100,
        "A spike whose loss is not back under its pre-spike level within this many global steps is a "
        "divergence, which `enforce` rolls back for (as for a NaN or infinite loss).",
        group=G_INCIDENTS,
    ),
    Setting(
        "SKIP_BATCHES",
        100,
        "A rollback skips this many batches past the spike's first step (the ladder's first rung).",
        group=G_INCIDENTS,
    ),
    Setting(
        "MAX_ROLLBACKS",
        3,
        "At most this many rollbacks per run; past it the job is stopped and needs attention.",
        group=G_INCIDENTS,
    ),
]
