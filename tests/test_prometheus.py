"""``GET /metrics``, read back with prometheus_client's own parser; and the shipped Grafana dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.health import VERDICTS
from app.prometheus import DEVICE_GAUGES, PREFIX, RANK_GAUGES
from app.stop_service import STAGES
from tests.heartbeats import HOST, heartbeat, write_heartbeat, write_job
from tests.test_checkpoints_api import save_bridge_set
from trainer_bridge import runfiles

REPO = Path(__file__).resolve().parents[1]
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


def scrape(client) -> dict[str, list]:
    """Sample name -> samples, parsed by prometheus_client (any malformed line raises)."""
    response = client.get("/metrics")
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
            heartbeat(r, WORLD, global_step=40, step_ms=50.0, seq=7, device=NPU if r == 1 else None),
        )
    write_heartbeat(
        run_dir, heartbeat(WORLD - 1, WORLD, global_step=12, state="failed", error="RuntimeError: boom")
    )
    return run_dir


def test_every_rank_has_a_series_in_base_units(client, job):
    s = scrape(client)
    ranks = set(range(WORLD))
    for _, name, _ in RANK_GAUGES:
        if name in ("rank_score_ratio",):
            continue  # only ranks compared with peers have a score
        assert set(by_rank(s[PREFIX + name])) == ranks, name
    assert all(sample.labels["host"] == HOST for sample in s[PREFIX + "rank_global_step"])
    assert by_rank(s[PREFIX + "rank_global_step"]) == {0: 40, 1: 40, 2: 40, 3: 12}
    assert by_rank(s[PREFIX + "rank_step_time_seconds"])[0] == pytest.approx(0.05)
    assert by_rank(s[PREFIX + "rank_cpu_usage_ratio"])[0] == pytest.approx(0.985)
    assert by_rank(s[PREFIX + "rank_resident_memory_bytes"])[0] == 512 * 2**20
    assert by_rank(s[PREFIX + "rank_heartbeats_total"])[0] == 7

    # Device series exist for the rank with a device, labelled with it.
    util = s[PREFIX + "rank_device_utilization_ratio"]
    assert [(x.labels["rank"], x.labels["device"], x.value) for x in util] == [("1", "npu:3", 0.87)]
    for _, name, _ in DEVICE_GAUGES:
        assert by_rank(s[PREFIX + name]).keys() == {1}, name


def test_verdicts_are_one_hot_and_job_counts_add_up(client, job):
    s = scrape(client)
    verdict = s[PREFIX + "rank_verdict"]
    for r in range(WORLD):
        mine = {x.labels["verdict"]: x.value for x in verdict if x.labels["rank"] == str(r)}
        assert set(mine) == set(VERDICTS) and sum(mine.values()) == 1
        assert mine["failed" if r == WORLD - 1 else "healthy"] == 1
    counts = {x.labels["verdict"]: x.value for x in s[PREFIX + "ranks"]}
    assert counts["healthy"] == WORLD - 1 and counts["failed"] == 1 and sum(counts.values()) == WORLD
    assert s[PREFIX + "world_size"][0].value == WORLD
    assert s[PREFIX + "ranks_reported"][0].value == WORLD
    assert [(x.labels["status"], x.value) for x in s[PREFIX + "run_status"]] == [("running", 1)]
    assert [(x.labels["state"], x.value) for x in s[PREFIX + "stop_state"]] == [("idle", 1)]
    assert PREFIX + "rank_stop_stage" not in s  # no stop requested
    assert s["process_resident_memory_bytes"][0].value > 0  # the dashboard's own process


def test_a_stop_shows_each_ranks_stage(client, job):
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
    for r in range(WORLD):
        mine = {x.labels["stage"]: x.value for x in stage if x.labels["rank"] == str(r)}
        assert set(mine) == set(STAGES) and sum(mine.values()) == 1
        assert mine["seen" if r == 0 else "requested"] == 1


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
    assert response.get_data(as_text=True).rstrip().endswith("# EOF")


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
