"""How ranks are judged (the health verdicts) and shown (the page, its charts, the metrics)."""

from __future__ import annotations

from app.config.setting import G_HEALTH, G_PAGE, Setting

# Where a job becomes large for what one answer or one browser holds: app/large.py's
# one-at-a-time answers and the ranks page's window. Here, as the settings import no Flask.
LARGE_JOB_RANKS = 4096

SETTINGS: list[Setting] = [
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
        "ignoring ordinary jitter. A straggler stays one until it is below 0.9 of this "
        "ratio, so a rank near the line does not flap.",
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
        "(above this many ranks it needs the operator token, and one such answer is built at a time), "
        "`?per_rank=0` for the summaries only.",
        group=G_PAGE,
    ),
]
