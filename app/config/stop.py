"""The stop, its audit trail, the checkpoint browser and checkpoint retention."""

from __future__ import annotations

from app.config.setting import G_STOP, Setting

SETTINGS: list[Setting] = [
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
        "CHECKPOINT_SCAN_S",
        2.0,
        "The checkpoint browser re-walks the run directory at most this often. A walk "
        "stats every file under it (only new or changed checkpoints are opened), which "
        "costs more than the heartbeat scan; a save takes seconds, so 2 s still shows a "
        "new set while the operator watches, and keeps a large shared file system quiet.",
        group=G_STOP,
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
