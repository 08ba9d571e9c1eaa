"""Large jobs: heartbeats over Redis, several dashboards, and one agent per node."""

from __future__ import annotations

from app.config.setting import G_AGENTS, G_REDIS, Setting

SETTINGS: list[Setting] = [
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
        "With `REDIS_URL`: the master key, on every dashboard. Each rank and agent gets a key derived "
        "from it for itself only (`rankwatch redis-keys`; the master given to them still works but "
        "separates nothing). The bridge then signs each heartbeat it publishes "
        "(HMAC-SHA256) and the dashboards sign their message-queue messages; unsigned or badly "
        "signed ones are dropped, counted and shown as a warning. Empty: Redis is trusted as it is "
        "(see the Security section on running Redis). A secret: no command-line flag (`ps` shows "
        "argv to every user); from the environment, or from the file `RANKWATCH_REDIS_KEY_FILE` names.",
        group=G_REDIS,
        argv=False,
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
        "AGENT_ASK_TIMEOUT_S",
        3.0,
        "With agents: how long the dashboard waits for an agent's answer over Redis: a rank's full "
        "row and chart history (`GET /api/ranks/<rank>`), or its node's checkpoint files (the "
        "checkpoint browser). Past it the rank's row is the digest's (`agent.answered` false) and a "
        "node's files are as its agent last listed them.",
        group=G_AGENTS,
    ),
    Setting(
        "HUB_GROUP",
        "",
        "With agents: the Redis consumer group this dashboard reads the digests through. Empty: one of "
        "its own, so every dashboard process shows every host. Processes given the same name split the "
        "digests between them (the load divides); each forwards the digests that carry a change to the "
        "others, so each still shows every host and every change.",
        group=G_AGENTS,
    ),
]
