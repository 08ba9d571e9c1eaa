"""Issue 32, P8: a 10-byte job.json edit must not make one tokenless request cost the world size.

The review's attack: ``world_size`` 131072 in job.json, then one tokenless
``GET /api/history`` (394 MB before the fix) and a tokenless
``/metrics?per_rank=1``. Now the history is paged as ``/api/ranks`` is, and
every rank's series past METRICS_PER_RANK_MAX needs the token.
"""

from __future__ import annotations

import time

from app.config import LARGE_JOB_RANKS as HISTORY_PER_PAGE_MAX  # one page: app.edge.params
from tests.helpers.app import operator
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import schema

WORLD = schema.MAX_RANKS  # 131072: the most job.json may say


def test_a_huge_declared_world_costs_a_tokenless_reader_one_page(app, client, run_dir):
    write_job(run_dir, 2)
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2, seq=3, now=time.time()))
    assert client.get("/api/history").status_code == 200
    write_job(run_dir, WORLD)  # the attack: job.json now declares the largest job it may
    app.extensions["rankwatch"].state.scan(time.time())

    r = client.get("/api/history")
    assert r.status_code == 200
    body = r.get_json()
    assert body["total"] == WORLD and len(body["ranks"]) == HISTORY_PER_PAGE_MAX
    assert body["pages"] == WORLD // HISTORY_PER_PAGE_MAX and body["page"] == 1
    assert len(body["step_time_ms"]) == HISTORY_PER_PAGE_MAX
    # Every page of it can be had, one page at a time; past the last is a 404 in the error shape.
    last = client.get(f"/api/history?page={body['pages']}&per_page={HISTORY_PER_PAGE_MAX}").get_json()
    assert last["ranks"][-1] == WORLD - 1
    past = client.get(f"/api/history?page={body['pages'] + 1}")
    assert past.status_code == 404 and "past the last page" in past.get_json()["error"]
    too_big = client.get(f"/api/history?per_page={HISTORY_PER_PAGE_MAX + 1}")
    assert too_big.status_code == 400

    # /metrics with every rank's series: the token's; the summaries stay open.
    refused = client.get("/metrics?per_rank=1")
    assert refused.status_code == 401, refused.status_code
    assert client.get("/metrics").status_code == 200
    assert client.get("/metrics?per_rank=1", headers=operator()).status_code == 200
