"""``GET /metrics``, read back with prometheus_client's own parser; and the shipped Grafana dashboard."""

from __future__ import annotations

import json
import re
import time
from importlib import metadata
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from app import create_app, large
from app.prometheus.exporter import DEVICE_GAUGES, PREFIX, RANK_GAUGES
from app.run.verdicts import VERDICTS
from app.stop.status import STAGES
from tests.helpers.app import FAST_SETTINGS, TOKEN, operator
from tests.helpers.checkpoints import save_bridge_set
from tests.helpers.heartbeats import HOST, heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import runfiles

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "static" / "grafana" / "rankwatch.json"
WORLD = 4
NPU = {
    "kind": "npu",
    "index": 3,
    "util_percent": 87.0,
    "mem_used_bytes": 30 * 2**30,
    "mem_total_bytes": 64 * 2**30,
    "temp_c": 61.0,
    "health": "OK",
}


def scrape(client, query: str = "", headers: dict | None = None) -> dict[str, list]:
    """Sample name -> samples, parsed by prometheus_client (any malformed line raises)."""
    response = client.get("/metrics" + query, headers=headers)
    assert response.status_code == 200
    assert response.content_type.startswith("text/plain; version=0.0.4")
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(response.get_data(as_text=True)):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def by_rank(samples: list, **labels) -> dict[int, float]:
    return {
        int(s.labels["rank"]): s.value
        for s in samples
        if all(s.labels.get(k) == v for k, v in labels.items())
    }


@pytest.fixture
def job(run_dir):
    write_job(run_dir, WORLD)
    for r in range(WORLD - 1):
        write_heartbeat(
            run_dir,
            heartbeat(
                r,
                WORLD,
                global_step=40,
                step_ms=50.0,
                seq=7,
                cpu_seconds=12.25 + r,
                cpu_percent=86.2,
                device=NPU if r == 1 else None,
            ),
        )
    write_heartbeat(
        run_dir, heartbeat(WORLD - 1, WORLD, global_step=12, state="failed", error="RuntimeError: boom")
    )
    return run_dir


LIVE = set(range(WORLD - 1))  # the last rank failed


def test_every_rank_has_its_series_in_base_units(client, job):
    s = scrape(client)
    for series in RANK_GAUGES:
        if series.name == "rank_score_ratio":
            continue  # only ranks compared with peers have a score
        assert set(by_rank(s[PREFIX + series.name])) == (LIVE if series.live_only else set(range(WORLD))), (
            series
        )
    assert by_rank(s[PREFIX + "rank_global_step"]) == {0: 40, 1: 40, 2: 40, 3: 12}
    assert by_rank(s[PREFIX + "rank_step_time_seconds"])[0] == 0.05
    assert by_rank(s[PREFIX + "rank_resident_memory_bytes"])[0] == 512 * 2**20
    assert by_rank(s[PREFIX + "rank_heartbeats_total"])[0] == 7
    stamps = by_rank(s[PREFIX + "rank_last_heartbeat_timestamp_seconds"])
    assert abs(stamps[0] - time.time()) < 600

    # Device series exist for the rank with a device, labelled with it.
    util = s[PREFIX + "rank_device_utilization_ratio"]
    assert [(x.labels, x.value) for x in util] == [({"rank": "1", "device": "npu:3"}, 0.87)]
    for series in DEVICE_GAUGES:
        assert by_rank(s[PREFIX + series.name]).keys() == {1}, series


def test_cpu_is_a_counter_of_seconds_not_a_ratio(client, job):
    s = scrape(client)
    assert by_rank(s[PREFIX + "rank_cpu_seconds_total"]) == {0: 12.25, 1: 13.25, 2: 14.25}
    assert not [name for name in s if "cpu_usage" in name or "heartbeat_age" in name]
    text = client.get("/metrics").get_data(as_text=True)
    assert "# TYPE rankwatch_rank_cpu_seconds_total counter" in text


def test_no_float_noise(client, job):
    """86.2 % is 0.862, 50 ms 0.05: no value carries the last bits of a binary division."""
    text = client.get("/metrics").get_data(as_text=True)
    # Rankwatch's own series; prometheus_client's process_* series are its own business.
    values = [line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith("rankwatch_")]
    assert values
    for value in values:
        digits = value.split("e")[0].replace(".", "").replace("-", "").strip("0")
        assert len(digits) <= 15, value


def test_build_info_and_rank_info_carry_the_labels(client, job):
    s = scrape(client)
    [build] = s[PREFIX + "build_info"]
    assert build.value == 1 and build.labels == {"version": metadata.version("rankwatch")}
    info = {x.labels["rank"]: x for x in s[PREFIX + "rank_info"]}
    assert set(info) == {str(r) for r in range(WORLD)}
    assert all(
        x.value == 1 and x.labels["host"] == HOST and x.labels["source"] == "bridge" for x in info.values()
    )
    # The host is in rank_info only: a rank that moves host changes one series.
    for name, samples in s.items():
        if name.startswith(PREFIX + "rank_") and name != PREFIX + "rank_info":
            assert all("host" not in x.labels for x in samples), name


def test_each_rank_has_one_verdict_series_and_job_counts_add_up(client, job):
    s = scrape(client)
    verdict = s[PREFIX + "rank_verdict"]
    assert len(verdict) == WORLD
    assert {x.labels["rank"]: (x.labels["verdict"], x.value) for x in verdict} == {
        "0": ("healthy", 1),
        "1": ("healthy", 1),
        "2": ("healthy", 1),
        "3": ("failed", 1),
    }
    counts = {x.labels["verdict"]: x.value for x in s[PREFIX + "ranks"]}
    assert set(counts) == set(VERDICTS)  # every verdict, so "== 0" works on the counts
    assert counts["healthy"] == WORLD - 1 and counts["failed"] == 1 and sum(counts.values()) == WORLD
    hosts = {(x.labels["host"], x.labels["verdict"]): x.value for x in s[PREFIX + "host_ranks"]}
    assert hosts == {(HOST, "healthy"): WORLD - 1, (HOST, "failed"): 1}
    assert s[PREFIX + "world_size"][0].value == WORLD
    assert s[PREFIX + "ranks_reported"][0].value == WORLD
    assert [(x.labels["status"], x.value) for x in s[PREFIX + "run_status"]] == [("running", 1)]
    assert [(x.labels["state"], x.value) for x in s[PREFIX + "stop_state"]] == [("idle", 1)]
    assert PREFIX + "rank_stop_stage" not in s and PREFIX + "stop_ranks" not in s  # no stop requested
    assert s[PREFIX + "per_rank_series"][0].value == 1
    assert s["process_resident_memory_bytes"][0].value > 0  # the dashboard's own process


def test_a_stop_shows_each_ranks_stage_once(client, job):
    runfiles.write_flag(job, True, request_id="req-9", requested_at=1.0, reason="test")
    write_heartbeat(
        job,
        heartbeat(
            0, WORLD, seq=8, global_step=41, state="stopping", stop={"request_id": "req-9", "stage": "seen"}
        ),
    )
    s = scrape(client)
    assert [(x.labels["state"], x.value) for x in s[PREFIX + "stop_state"]] == [("stopping", 1)]
    stage = s[PREFIX + "rank_stop_stage"]
    assert len(stage) == WORLD
    assert {x.labels["rank"]: (x.labels["stage"], x.value) for x in stage} == {
        "0": ("seen", 1),
        "1": ("requested", 1),
        "2": ("requested", 1),
        "3": ("requested", 1),
    }
    counts = {x.labels["stage"]: x.value for x in s[PREFIX + "stop_ranks"]}
    assert set(counts) == set(STAGES)
    assert counts["seen"] == 1 and counts["requested"] == WORLD - 1 and sum(counts.values()) == WORLD


def test_ended_ranks_keep_their_state_but_no_rates(client, run_dir):
    """After a stop every rank has exited: no throughput, step time, CPU or memory, and the
    heartbeat is a timestamp that does not grow, not an age that climbs."""
    write_job(run_dir, 3)
    then = time.time() - 3600
    write_heartbeat(
        run_dir, heartbeat(0, 3, seq=9, global_step=90, state="exited", now=then, cpu_seconds=5.0)
    )
    write_heartbeat(
        run_dir, heartbeat(1, 3, seq=9, global_step=90, state="finished", now=then, cpu_seconds=5.0)
    )
    write_heartbeat(run_dir, heartbeat(2, 3, seq=9, global_step=90, now=time.time(), cpu_seconds=5.0))
    s = scrape(client)
    verdicts = {x.labels["rank"]: x.labels["verdict"] for x in s[PREFIX + "rank_verdict"]}
    assert verdicts == {"0": "exited", "1": "finished", "2": "healthy"}
    for series in RANK_GAUGES:
        if series.live_only and series.name != "rank_score_ratio":
            assert by_rank(s[PREFIX + series.name]).keys() == {2}, series.name
    assert by_rank(s[PREFIX + "rank_cpu_seconds_total"]).keys() == {2}
    assert by_rank(s[PREFIX + "rank_global_step"]) == {0: 90, 1: 90, 2: 90}
    assert by_rank(s[PREFIX + "rank_last_heartbeat_timestamp_seconds"])[0] == pytest.approx(then, abs=1e-3)
    assert (
        scrape(client)[PREFIX + "rank_last_heartbeat_timestamp_seconds"]
        == s[PREFIX + "rank_last_heartbeat_timestamp_seconds"]
    )


def test_above_the_per_rank_limit_only_summaries_unless_asked(run_dir):
    app = create_app(
        {"RUN_DIR": str(run_dir), "TESTING": True, "TOKEN": TOKEN, **FAST_SETTINGS, "METRICS_PER_RANK_MAX": 3}
    )
    client = app.test_client()
    write_job(run_dir, WORLD)
    for r in range(WORLD):
        write_heartbeat(run_dir, heartbeat(r, WORLD, seq=3, host=f"node{r // 2}"))
    s = scrape(client)
    assert s[PREFIX + "per_rank_series"][0].value == 0
    assert not [name for name in s if name.startswith(PREFIX + "rank_")]
    hosts = {(x.labels["host"], x.labels["verdict"]): x.value for x in s[PREFIX + "host_ranks"]}
    assert hosts == {("node0", "healthy"): 2, ("node1", "healthy"): 2}
    assert {x.labels["verdict"]: x.value for x in s[PREFIX + "ranks"]}["healthy"] == WORLD

    # Every rank's series past the limit is an answer as large as job.json says: the operator's (P8).
    refused = client.get("/metrics?per_rank=1")
    assert refused.status_code == 401 and "operator token required" in refused.get_json()["error"]
    forced = scrape(client, "?per_rank=1", operator())
    assert forced[PREFIX + "per_rank_series"][0].value == 1
    assert len(forced[PREFIX + "rank_verdict"]) == WORLD
    assert {x.labels["rank"]: x.labels["host"] for x in forced[PREFIX + "rank_info"]} == {
        "0": "node0",
        "1": "node0",
        "2": "node1",
        "3": "node1",
    }
    # And the other way round: a small job asked for its summaries only.
    summary = scrape(
        create_app({"RUN_DIR": str(run_dir), "TESTING": True, **FAST_SETTINGS}).test_client(), "?per_rank=0"
    )
    assert PREFIX + "rank_verdict" not in summary and summary[PREFIX + "per_rank_series"][0].value == 0

    bad = client.get("/metrics?per_rank=yes")
    assert bad.status_code == 400
    assert bad.get_json() == {"error": "query parameter 'per_rank' must be 0 or 1, not 'yes'", "status": 400}


def test_one_large_answer_at_a_time(client, app, job, monkeypatch):
    """A second large answer while one is being built is refused at once, in the error shape."""
    monkeypatch.setattr(large, "LARGE_ANSWER_RANKS", WORLD - 1)
    assert client.get("/metrics").status_code == 200  # the slot is free
    slot = app.extensions.setdefault("rankwatch_large_answers", large.LargeAnswers())
    with slot.take("a test"):
        for url in ("/metrics", "/metrics?per_rank=1", "/api/history"):
            busy = client.get(url)
            assert busy.status_code == 503, url
            assert busy.get_json()["status"] == 503 and "being built" in busy.get_json()["error"]
            assert int(busy.headers["Retry-After"]) >= 1
        # A summary-only scrape holds no row per rank: it needs no slot.
        assert client.get("/metrics?per_rank=0").status_code == 200
        assert client.get("/api/ranks").status_code == 200  # paged: never large
    assert client.get("/metrics").status_code == 200
    assert client.get("/api/history").status_code == 200


def test_checkpoint_sets_are_counted(client, job):
    save_bridge_set(job, 16, ranks=range(WORLD))
    save_bridge_set(job, 24, ranks=(0,))
    s = scrape(client)
    assert s[PREFIX + "checkpoint_sets"][0].value == 2
    assert s[PREFIX + "checkpoint_sets_complete"][0].value == 1
    assert s[PREFIX + "checkpoint_newest_complete_global_step"][0].value == 16
    assert s[PREFIX + "checkpoint_bytes"][0].value > 0


def test_openmetrics_when_asked(client, job):
    response = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert response.status_code == 200
    assert response.content_type.startswith("application/openmetrics-text")
    text = response.get_data(as_text=True)
    assert text.rstrip().endswith("# EOF")
    assert "# TYPE rankwatch_build info" in text and "# TYPE rankwatch_rank_cpu_seconds counter" in text


# -- the Grafana dashboard --------------------------------------------------------------------

PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
    "unless", "inf", "nan",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions,
    keywords, label names or values, durations or numbers."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range durations
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    names = set()
    # Not preceded by a digit: "5m" in "offset 5m" is a duration, not a metric.
    for m in re.finditer(r"(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[m.end() :].lstrip()
        if rest.startswith("(") or m.group(0).lower() in PROMQL_WORDS:
            continue
        names.add(m.group(0))
    return names


def grafana_queries() -> list[str]:
    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" and isinstance(value, str):
                    yield value
                elif key == "query" and isinstance(value, dict) and "query" in value:
                    yield value["query"]
                else:
                    yield from walk(value)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)

    return list(walk(json.loads(GRAFANA.read_text())))


def test_metric_names_finds_what_a_query_selects():
    assert metric_names('sum by (verdict) (rankwatch_ranks{job=~"$job"})') == {"rankwatch_ranks"}
    assert metric_names('rate(a_total{x="y z"}[1m]) / b_bytes offset 5m') == {"a_total", "b_bytes"}
    assert metric_names("label_values(rankwatch_world_size, job)") == {"rankwatch_world_size", "job"}


def test_every_grafana_query_names_a_metric_that_metrics_serves(client, job):
    save_bridge_set(job, 16, ranks=range(WORLD))
    runfiles.write_flag(job, True, request_id="req-1", requested_at=1.0, reason="test")
    write_heartbeat(
        job,
        heartbeat(
            0, WORLD, seq=8, global_step=41, state="stopping", stop={"request_id": "req-1", "stage": "seen"}
        ),
    )
    served = set(scrape(client))
    queries = grafana_queries()
    assert len(queries) >= 15
    for query in queries:
        # label_values(metric, label): the label is not a metric.
        names = metric_names(query) - ({"job"} if query.startswith("label_values(") else set())
        assert names, f"no metric in {query!r}"
        assert names <= served, f"{query!r} names {sorted(names - served)}, which /metrics does not serve"
