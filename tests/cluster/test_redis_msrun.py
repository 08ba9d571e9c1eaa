"""Heartbeats over Redis from a real 2-rank msrun job, and Redis killed mid-run.

``RANKWATCH_REDIS_URL`` is set on the trainers and on the dashboard, as the
README says; the Redis is Debian's ``redis-server`` on a loopback port. The
bridge publishes every heartbeat and writes its file only every
``FILE_EVERY_S``; with Redis gone, training goes on, the files come at the
full rate again with a warning in each heartbeat, the dashboard says Redis
is unreachable, and both sides return to Redis once it is back. Every wait
polls with a deadline; nothing asserts a duration.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.helpers.app import FAST_SETTINGS, wait_for
from tests.helpers.jobs import dump, write_flag
from trainer_bridge.rundir import redisbus, runfiles

pytestmark = pytest.mark.msrun


def api(server) -> dict:
    with urllib.request.urlopen(server.url + "/api/ranks", timeout=30) as r:
        return json.loads(r.read())


def file_seq(run_dir, rank: int) -> int:
    hb = runfiles.read_json_or_none(runfiles.heartbeat_path(run_dir, rank))
    return hb["seq"] if hb else 0


def test_heartbeats_go_over_redis_and_training_outlives_redis(
    run_dir, tmp_path, redis_server, start_job, start_server
):
    redis_env = {redisbus.REDIS_URL_ENV: redis_server.url}
    job = start_job(run_dir, epochs=40, step_delay=0.05, env=redis_env)
    settings = {f"RANKWATCH_{k}": str(v) for k, v in FAST_SETTINGS.items()}
    server = start_server(run_dir, tmp_path / "dashboard.log", env={**settings, **redis_env})
    # Over Redis the dashboard is ahead of the heartbeat files, which come every FILE_EVERY_S.
    view = wait_for(
        lambda: (
            (v := api(server))["run"]["transport"] == "redis"
            and len(v["ranks"]) == 2
            and all(row["health"] == "healthy" for row in v["ranks"])
            and all(row["seq"] >= file_seq(run_dir, row["rank"]) + 3 for row in v["ranks"])
            and v
        ),
        "both ranks healthy over Redis, ahead of their files",
        timeout=240,
    )
    assert all(row["warnings"] == [] for row in view["ranks"]), dump(view["ranks"])

    redis_server.stop()
    step = max(h["global_step"] for h in job.heartbeats())
    # Training goes on; each heartbeat file is fresh again and says why.
    hbs = job.wait_until(
        lambda hbs: (
            hbs
            if all(
                h and h["global_step"] > step + 20 and any("unreachable" in w for w in h["warnings"])
                for h in hbs
            )
            else None
        ),
        "training on, with the Redis warning in every heartbeat",
    )
    assert all(h["state"] == "training" for h in hbs), dump(hbs)
    down = wait_for(
        lambda: (v := api(server))["run"]["transport"] == "files" and v,
        "the dashboard reading files",
    )
    assert "Redis is unreachable" in down["run"]["message"]
    assert all(row["health"] == "healthy" for row in down["ranks"]), dump(down["ranks"])

    redis_server.start()
    wait_for(
        lambda: (
            (v := api(server))["run"]["transport"] == "redis"
            and all(row["warnings"] == [] and row["health"] == "healthy" for row in v["ranks"])
        ),
        "both sides back on Redis",
        timeout=120,
    )

    # The stop never depended on Redis, and still works with it.
    write_flag(run_dir)
    assert job.wait() == 0, job.logs()
    job.stopped_together()


def test_with_a_key_forged_heartbeats_do_not_silence_a_real_job(
    run_dir, tmp_path, redis_server, start_job, start_server
):
    """Issue 19, item 4: someone republishes rank 1's heartbeat with a far higher seq, over and over.

    With RANKWATCH_REDIS_KEY on both sides the forgeries are refused and
    said so, rank 1's real heartbeats keep coming through, and the stop
    completes on both ranks.
    """
    import redis

    env = {redisbus.REDIS_URL_ENV: redis_server.url, redisbus.REDIS_KEY_ENV: "a-shared-key-for-this-job"}
    job = start_job(run_dir, epochs=40, step_delay=0.05, env=env)
    settings = {f"RANKWATCH_{k}": str(v) for k, v in FAST_SETTINGS.items()}
    server = start_server(run_dir, tmp_path / "dashboard.log", env={**settings, **env})
    client = redis.Redis.from_url(redis_server.url)
    stream, latest, _ = redisbus.keys(redisbus.job_key(run_dir))
    wait_for(
        lambda: (
            (v := api(server))["run"]["transport"] == "redis"
            and len(v["ranks"]) == 2
            and all(row["health"] == "healthy" for row in v["ranks"])
            and client.hget(latest, "1")
        ),
        "both ranks healthy over Redis",
        timeout=240,
    )
    forged_seq = 10**6
    for _ in range(20):  # the attacker: rank 1's own newest heartbeat, with a higher seq
        real = json.loads(client.hget(latest, "1"))
        forged = json.dumps(real | {"seq": forged_seq}).encode()
        client.xadd(stream, {"r": 1, "hb": forged})
        client.hset(latest, "1", forged)
    before = api(server)["ranks"][1]["seq"]
    view = wait_for(
        lambda: (
            (v := api(server))["ranks"][1]["seq"] > before + 10
            and "refused as unsigned or badly signed" in v["run"]["message"]
            and v
        ),
        "rank 1's real heartbeats still read, the forgeries refused",
    )
    assert all(row["seq"] < forged_seq for row in view["ranks"]), dump(view["ranks"])
    assert all(row["health"] == "healthy" for row in view["ranks"]), dump(view["ranks"])

    write_flag(run_dir)
    assert job.wait() == 0, job.logs()
    job.stopped_together()
