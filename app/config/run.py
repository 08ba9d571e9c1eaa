"""Where the dashboard reads and listens: the run directory (or a root of runs) and its address."""

from __future__ import annotations

from app.config.setting import G_RUN, Setting

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
        "SLURM",
        False,
        "Show Slurm's view of the runs on the landing page (docs/slurm.md): pending with its reason, "
        "running and on which nodes, the time left, and a run still in the queue before its first "
        "heartbeat. One `squeue --json` for all runs per SLURM_POLL_S; the dashboard never cancels a job.",
        group=G_RUN,
    ),
    Setting(
        "SLURM_POLL_S",
        10.0,
        "How often, at most, the dashboard asks Slurm (`squeue --json`) about the jobs (with SLURM on).",
        group=G_RUN,
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
]
