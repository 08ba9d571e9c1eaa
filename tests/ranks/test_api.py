"""The JSON API, the page and the settings, through Flask's test client."""

from __future__ import annotations

import re
import time

import pytest

from app import create_app
from app.__main__ import parse_args
from app.config import SETTINGS, from_env
from app.ranks.metrics import METRICS
from app.ranks.routes import PER_PAGE_DEFAULT, PER_PAGE_MAX
from app.run.verdicts import VERDICTS
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job

DESIGN_FIELDS = {
    "rank",
    "health",
    "reason",
    "state",
    "epoch",
    "step",
    "global_step",
    "loss",
    "step_time_ms",
    "heartbeat_age_s",
    "host",
    "pid",
    "cpu_percent",
    "rss_bytes",
}


def test_create_app_does_nothing_at_import_or_build(run_dir):
    app = create_app({"RUN_DIR": str(run_dir)})
    rw = app.extensions["rankwatch"]
    assert rw.state.scanned_at is None
    assert not rw.watcher.running


def test_ranks_has_the_design_fields(client, run_dir):
    write_job(run_dir, 3)
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 3, seq=4, step_ms=40.0 + r))
    body = client.get("/api/ranks").get_json()
    assert body["world_size"] == 3
    assert [r["rank"] for r in body["ranks"]] == [0, 1, 2]
    for row in body["ranks"]:
        assert DESIGN_FIELDS <= set(row)
    first = body["ranks"][0]
    assert first["health"] == "healthy" and first["state"] == "training"
    assert first["step_time_ms"] == 40.0 and 0 <= first["heartbeat_age_s"] < 60
    assert body["ranks"][2]["health"] == "pending"
    assert body["run"]["status"] == "starting"


def test_ranks_reflect_new_files_without_a_watcher(client, run_dir, app):
    write_heartbeat(run_dir, heartbeat(0, 1, seq=1, global_step=10))
    assert client.get("/api/ranks").get_json()["ranks"][0]["global_step"] == 10
    write_heartbeat(run_dir, heartbeat(0, 1, seq=2, global_step=20))
    deadline = time.monotonic() + 10
    while client.get("/api/ranks").get_json()["ranks"][0]["global_step"] != 20:
        assert time.monotonic() < deadline, "the API never saw the new heartbeat"
        time.sleep(app.config["TICK_S"])


def test_ranks_filter_by_verdict(client, run_dir):
    write_job(run_dir, 3)
    write_heartbeat(run_dir, heartbeat(0, 3, state="failed", error="boom"))
    body = client.get("/api/ranks?health=failed,pending").get_json()
    assert [(r["rank"], r["health"]) for r in body["ranks"]] == [
        (0, "failed"),
        (1, "pending"),
        (2, "pending"),
    ]


def test_ranks_come_a_page_at_a_time(client, run_dir):
    write_job(run_dir, 7)
    for r in (0, 3, 5):
        write_heartbeat(run_dir, heartbeat(r, 7, state="failed", error="boom"))
    body = client.get("/api/ranks").get_json()
    assert (body["page"], body["per_page"], body["total"], body["pages"]) == (1, PER_PAGE_DEFAULT, 7, 1)
    assert body["world_size"] == 7 and [r["rank"] for r in body["ranks"]] == list(range(7))

    pages = [client.get(f"/api/ranks?per_page=3&page={p}").get_json() for p in (1, 2, 3)]
    assert [[r["rank"] for r in b["ranks"]] for b in pages] == [[0, 1, 2], [3, 4, 5], [6]]
    assert {(b["total"], b["pages"], b["per_page"], b["world_size"]) for b in pages} == {(7, 3, 3, 7)}
    assert all(0 <= r["heartbeat_age_s"] < 600 for r in pages[0]["ranks"] if r["rank"] == 0)

    # The verdict filter comes first: total and pages count the selected rows.
    failed = client.get("/api/ranks?health=failed&per_page=2&page=2").get_json()
    assert [r["rank"] for r in failed["ranks"]] == [5]
    assert (failed["total"], failed["pages"], failed["world_size"]) == (3, 2, 7)
    # An empty selection is one empty page, not an error.
    none = client.get("/api/ranks?health=stalled").get_json()
    assert (none["ranks"], none["total"], none["pages"], none["page"]) == ([], 0, 1, 1)


@pytest.mark.parametrize(
    "url, status, error",
    [
        (f"/api/ranks?per_page={PER_PAGE_MAX + 1}", 400, f"'per_page' may be at most {PER_PAGE_MAX}"),
        ("/api/ranks?per_page=0", 400, "'per_page' must be a positive integer"),
        ("/api/ranks?page=0", 400, "'page' must be a positive integer"),
        ("/api/ranks?page=-1", 400, "'page' must be a positive integer"),
        ("/api/ranks?page=1e3", 400, "'page' must be a positive integer"),
        ("/api/ranks?page=" + "9" * 30, 400, "'page' must be a positive integer"),
        ("/api/ranks?page=2", 404, "page 2 is past the last page, 1 (3 rows, 500 a page)"),
        ("/api/ranks?per_page=2&page=3", 404, "page 3 is past the last page, 2"),
    ],
)
def test_paging_bounds(client, run_dir, url, status, error):
    write_job(run_dir, 3)
    resp = client.get(url)
    assert resp.status_code == status
    body = resp.get_json()
    assert set(body) == {"error", "status"} and body["status"] == status and error in body["error"]


@pytest.mark.parametrize(
    "url, status",
    [
        ("/api/ranks?health=sick", 400),
        ("/api/history?points=0", 400),
        ("/api/history?points=x", 400),
        ("/api/ranks/7", 404),
        ("/api/nothing", 404),
    ],
)
def test_api_errors_have_one_shape(client, run_dir, url, status):
    resp = client.get(url)
    assert resp.status_code == status
    assert resp.is_json
    body = resp.get_json()
    assert set(body) == {"error", "status"} and body["status"] == status and body["error"]


def test_wrong_method_under_api_is_405_in_the_same_shape(client):
    resp = client.post("/api/ranks")
    assert resp.status_code == 405
    assert resp.get_json()["status"] == 405


def test_html_errors_outside_api(client):
    resp = client.get("/no-such-page")
    assert resp.status_code == 404
    assert resp.mimetype == "text/html"
    assert b"404" in resp.data


def test_a_bug_is_a_500_in_the_same_shape(client, app, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("bug")

    monkeypatch.setattr(app.extensions["rankwatch"].state, "page", broken)
    resp = client.get("/api/ranks")
    assert resp.status_code == 500
    assert resp.get_json() == {"error": "internal error (a bug: see the dashboard's log)", "status": 500}


def test_one_rank_with_its_history(client, run_dir):
    write_heartbeat(run_dir, heartbeat(0, 1, seq=1))
    body = client.get("/api/ranks/0").get_json()
    assert body["rank"]["rank"] == 0
    assert body["history"] and set(body["history"][0]) == {"t", "global_step", "loss", "step_time_ms"}


def test_summary(client, run_dir):
    write_job(run_dir, 2)
    # Enough steps each to be compared (STRAGGLER_MIN_STEPS): a warming rank is nobody's peer yet.
    write_heartbeat(run_dir, heartbeat(0, 2, step_ms=50.0, batch_size=10, steps=32))
    write_heartbeat(run_dir, heartbeat(1, 2, step_ms=100.0, batch_size=10, steps=32))
    body = client.get("/api/summary").get_json()
    s = body["summary"]
    assert s["world_size"] == 2 and s["counts"]["healthy"] + s["counts"]["straggler"] == 2
    # Quoted against its peer median, the other rank's 50 ms, as its row is judged (app/run/peers.py).
    assert s["slowest"]["rank"] == 1 and s["slowest"]["gap_ms"] == 50.0 and s["slowest"]["median_ms"] == 50.0
    assert s["throughput"] == 300.0
    assert set(body) == {"now", "world_size", "run", "summary"}


def test_history_matrix(client, run_dir):
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2, seq=1))
    body = client.get("/api/history").get_json()
    assert body["ranks"] == [0, 1]
    assert len(body["step_time_ms"]) == 2 and len(body["step_time_ms"][0]) == len(body["t"])


def test_metrics_describe_every_row_field(client, run_dir):
    write_heartbeat(run_dir, heartbeat(0, 1))
    body = client.get("/api/metrics").get_json()
    names = {m["name"] for m in body["metrics"]}
    row = client.get("/api/ranks").get_json()["ranks"][0]
    assert DESIGN_FIELDS <= names
    assert {m.name for m in METRICS if m.group != "job"} == set(row)
    assert [v["name"] for v in body["verdicts"]] == list(VERDICTS)


def test_page_uses_only_local_assets(client):
    page = client.get("/").get_data(as_text=True)
    assert 'id="rank-table"' in page
    sources = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert sources and all(s.startswith(("/", "data:")) for s in sources), sources
    assert "/vendor/plotly.min.js" in page and "socket.io-4." in page
    for src in sources:
        if src.startswith("/") and not src.startswith("/api/"):
            assert client.get(src).status_code == 200, src


def test_plotly_comes_from_the_installed_package(client):
    resp = client.get("/vendor/plotly.min.js")
    assert resp.status_code == 200
    assert resp.mimetype == "text/javascript"
    assert b"plotly.js v" in resp.data[:200]


def test_every_setting_reads_its_environment_variable():
    for s in SETTINGS:
        if isinstance(s.default, bool):
            assert from_env({s.env: "no"})[s.name] is False, s.name
            assert from_env({s.env: "1"})[s.name] is True, s.name
            continue
        if s.choices:
            assert from_env({s.env: s.choices[-1]})[s.name] == s.choices[-1], s.name
            with pytest.raises(ValueError, match=s.env):
                from_env({s.env: "x"})
            continue
        raw = "7" if isinstance(s.default, (int, float)) else "x"
        assert from_env({s.env: raw})[s.name] == type(s.default)(raw), s.name


def test_bad_setting_names_the_variable():
    with pytest.raises(ValueError, match="RANKWATCH_TICK_S"):
        from_env({"RANKWATCH_TICK_S": "fast"})
    with pytest.raises(ValueError, match="must be positive"):
        create_app({"DEAD_AFTER_S": -1})


def test_cli_has_a_flag_per_setting(monkeypatch):
    monkeypatch.setenv("RANKWATCH_DEAD_AFTER_S", "12")
    args = parse_args(["--run-dir", "RUN", "--port", "0", "--stall-min-s", "2"])
    assert args["RUN_DIR"] == "RUN" and args["PORT"] == 0
    assert args["STALL_MIN_S"] == 2.0 and args["DEAD_AFTER_S"] == 12.0
    assert set(args) == {s.name for s in SETTINGS}


def test_cli_requires_a_run_dir(monkeypatch, capsys):
    monkeypatch.delenv("RANKWATCH_RUN_DIR", raising=False)
    with pytest.raises(SystemExit):
        parse_args([])
    assert "--run-dir is required" in capsys.readouterr().err
