"""A root of runs served for real (``python -m app --runs ROOT``): odd run names through real HTTP.

And ``--run-dir RUN``: today's URLs stay, and ``/api/runs/<name>/X`` answers as ``/api/X``.
"""

from __future__ import annotations

import html
import json
import time
import urllib.error
import urllib.parse
import urllib.request

from tests.helpers.app import TOKEN, operator
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job

ODD = [
    "with space",
    "team/exp 1",
    "ünï/日本",
    "a%2Fb",
    "..dots",
    "...",
    "-leading-dash",
    "tilde~7E~2F",
    "q?x#y",
]


def get(url: str, token: str | None = None, data: dict | None = None) -> tuple[int, bytes]:
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if data is not None:
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(
        url,
        headers=headers,
        data=None if data is None else json.dumps(data).encode(),
        method="POST" if data else "GET",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def fake_run(root, rel: str, step: int) -> None:
    run = root / rel
    write_job(run, 1)
    write_heartbeat(run, heartbeat(0, 1, global_step=step))


def test_odd_run_names_over_real_http(tmp_path, start_server):
    root = tmp_path / "root"
    for i, rel in enumerate(ODD):
        fake_run(root, rel, 100 + i)
    fake_run(tmp_path, "outside", 7)
    (root / "escape").symlink_to(tmp_path / "outside")
    # Heartbeats written once: thresholds no loaded machine reaches, so every run reads as training.
    env = {"RANKWATCH_TOKEN": TOKEN, "RANKWATCH_STALL_MIN_S": "600", "RANKWATCH_DEAD_AFTER_S": "900"}
    server = start_server(root, tmp_path / "dashboard.log", env=env, runs_root=True)
    status, body = get(server.url + "/api/runs?per_page=500")
    assert status == 200, body
    table = json.loads(body)
    assert sorted(r["id"] for r in table["runs"]) == sorted(ODD)
    assert {"path": "escape", "reason": "a symlink: not followed"} in table["discovery"]["skipped"]
    for row in table["runs"]:
        i = ODD.index(row["id"])
        assert row["global_step"] == 100 + i and row["world_size"] == 1 and row["live"]
        assert row["state"] == "training" and not row["needs_attention"]
        # The console: the page knows its run, and its JSON routes are that run's.
        status, page = get(server.url + row["url"])
        assert status == 200 and f'data-run="{html.escape(row["id"])}"' in page.decode()
        api = server.url + "/api" + row["url"]
        status, summary = get(api + "summary", TOKEN)
        assert status == 200, summary
        summary = json.loads(summary)
        assert summary["run"]["run_dir"] == str(root / row["id"])
        # Without the token, the run's id stands for where it lives (issue 32, P11).
        assert json.loads(get(api + "summary")[1])["run"]["run_dir"] == row["id"]
        assert summary["summary"]["global_step"] == 100 + i
    status, body = get(server.url + "/api/runs?q=" + urllib.parse.quote("日本"))
    assert [r["id"] for r in json.loads(body)["runs"]] == ["ünï/日本"]

    # Nothing outside the root is reachable, however the id is written; errors keep their shape.
    for path in (
        "escape",
        "..%2Foutside",
        "%2E%2E",
        "..",
        "team~2F..~2Foutside",
        "team~2fexp%201",
        "a~41",
    ):
        status, body = get(f"{server.url}/api/runs/{path}/summary")
        assert status == 404, (path, body)
        assert set(json.loads(body)) == {"error", "status"}
    status, body = get(server.url + "/api/ranks")
    assert status == 404 and "/api/runs/<id>/ranks" in json.loads(body)["error"]
    status, body = get(server.url + "/api/health")
    assert status == 200 and json.loads(body)["role"] == "only"

    # A stop acts on the run in its URL, and on no other.
    target = next(r for r in table["runs"] if r["id"] == "team/exp 1")
    status, body = get(server.url + "/api" + target["url"] + "exit", TOKEN, {"reason": "test", "who": "t"})
    assert status == 202 and json.loads(body)["created"], body
    flagged = sorted(str(p.parent.relative_to(root)) for p in root.rglob("graceful_exit.json"))
    assert flagged == ["team/exp 1"]
    status, body = get(server.url + "/api" + target["url"] + "exit")
    assert json.loads(body)["state"] == "requested"
    # The new run appears without a restart (the scan's period, polled).
    fake_run(root, "late arrival", 5)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ids = [r["id"] for r in json.loads(get(server.url + "/api/runs?per_page=500")[1])["runs"]]
        if "late arrival" in ids:
            break
        time.sleep(0.2)
    assert "late arrival" in ids


def test_run_dir_keeps_its_urls_and_answers_under_its_name(app, client, run_dir):
    write_job(run_dir, 2)
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2, global_step=42))
    name = run_dir.name
    old = client.get("/api/summary").get_json()
    new = client.get(f"/api/runs/{name}/summary").get_json()
    assert new["summary"] == old["summary"] and new["run"] == old["run"]
    rows = client.get("/api/runs").get_json()["runs"]
    assert [(r["id"], r["global_step"], r["world_size"]) for r in rows] == [(name, 42, 2)]
    assert rows[0]["url"] == f"/runs/{name}/"
    assert 'data-api="/api"' in client.get("/").get_data(as_text=True)
    page = client.get(f"/runs/{name}/").get_data(as_text=True)
    assert f'data-api="/api/runs/{name}"' in page and f'href="/runs/{name}/checkpoints"' in page
    assert client.get("/api/runs/other/summary").status_code == 404


def test_pushes_do_not_mix_runs(tmp_path):
    """A run's console hears its run only: each run's watcher pushes to that run's rooms."""
    from app import create_app
    from app.extensions import socketio
    from tests.helpers.app import FAST_SETTINGS

    for rel, world in (("x", 1), ("team/y", 3)):
        write_job(tmp_path / rel, world)
        for r in range(world):
            write_heartbeat(tmp_path / rel, heartbeat(r, world, seq=1))
    app = create_app({"RUNS_ROOT": str(tmp_path), "TESTING": True, **FAST_SETTINGS})
    registry = app.extensions["rankwatch_runs"]
    client = app.test_client()
    try:
        assert not socketio.test_client(app, flask_test_client=client, auth={"run": "nope"}).is_connected()
        clients = {
            rel: socketio.test_client(app, flask_test_client=client, auth={"page": "ranks", "run": rel})
            for rel in ("x", "team/y")
        }
        worlds = {"x": 1, "team/y": 3}
        for rel, sio in clients.items():
            got = [e for e in sio.get_received() if e["name"] == "ranks_snapshot"]
            assert [e["args"][0]["world_size"] for e in got] == [worlds[rel]]
        for seq in (2, 3):
            for rel, world in worlds.items():
                for r in range(world):
                    write_heartbeat(tmp_path / rel, heartbeat(r, world, seq=seq))
                registry.get(rel).watcher.tick()
        for rel, sio in clients.items():
            pushed = [e["args"][0] for e in sio.get_received() if e["name"].startswith("ranks_")]
            assert pushed and {p["world_size"] for p in pushed} == {worlds[rel]}, (rel, pushed)
            ranks = {row["rank"] for p in pushed for row in p.get("rows", p.get("ranks", []))}
            assert ranks <= set(range(worlds[rel])) and ranks
            sio.disconnect()
    finally:
        registry.stop()


def test_runs_table_attention_first_filters_and_pages(tmp_path):
    from app import create_app

    def run(rel, states):
        write_job(tmp_path / rel, len(states))
        for r, s in enumerate(states):
            write_heartbeat(tmp_path / rel, heartbeat(r, len(states), seq=5, state=s))

    run("a-healthy", ["training", "training"])
    run("b-done", ["finished", "finished"])
    run("c-stopped", ["exited", "exited"])
    run("z-crashed", ["training", "failed"])
    # Heartbeats written once: thresholds no loaded machine reaches, so the verdicts are the states'.
    app = create_app(
        {
            "RUNS_ROOT": str(tmp_path),
            "TESTING": True,
            "TOKEN": TOKEN,
            "STALL_MIN_S": 600.0,
            "DEAD_AFTER_S": 900.0,
        }
    )
    client = app.test_client()
    try:
        body = client.get("/api/runs").get_json()
        states = {r["id"]: r["state"] for r in body["runs"]}
        assert states == {
            "a-healthy": "training",
            "b-done": "finished",
            "c-stopped": "stopped",
            "z-crashed": "failed",
        }
        assert [r["id"] for r in body["runs"]][0] == "z-crashed" and body["needs_attention"] == 1
        assert body["runs"][0]["health_counts"] == {"healthy": 1, "failed": 1}
        assert [r["id"] for r in client.get("/api/runs?state=attention").get_json()["runs"]] == ["z-crashed"]
        assert [r["id"] for r in client.get("/api/runs?state=finished").get_json()["runs"]] == ["b-done"]
        paged = client.get("/api/runs?sort=-id&per_page=1&page=2").get_json()
        assert [r["id"] for r in paged["runs"]] == ["c-stopped"] and paged["pages"] == 4
        for bad in ("state=nope", "sort=size", "page=0", "per_page=x", "q=" + "x" * 300):
            r = client.get("/api/runs?" + bad)
            assert r.status_code == 400 and set(r.get_json()) == {"error", "status"}, bad
        # /metrics: every open run's series with a run label (not job: Prometheus's own), parseable.
        from prometheus_client.parser import text_string_to_metric_families

        families = {
            f.name: f for f in text_string_to_metric_families(client.get("/metrics").get_data(as_text=True))
        }
        step = families["rankwatch_rank_global_step"].samples
        assert {s.labels["run"] for s in step} == set(states) and all("job" not in s.labels for s in step)
        assert len(families["rankwatch_build_info"].samples) == 1
        one = client.get("/runs/b-done/metrics").get_data(as_text=True)
        assert {
            s.labels.get("run")
            for f in text_string_to_metric_families(one)
            for s in f.samples
            if f.name.startswith("rankwatch_rank")
        } == {"b-done"}
        # Engines are bounded: past the cap the least recently used run's are dropped (its watcher stopped).
        registry = app.extensions["rankwatch_runs"]
        registry.cap = 2
        registry.tick()
        assert len(registry.open_ids()) == 2
        assert all(registry.peek(i).watcher.running for i in registry.open_ids())
        # ... and a dropped run is rebuilt on its next request, answering as before.
        dropped = next(i for i in states if i not in registry.open_ids())
        assert client.get(f"/api/runs/{dropped}/summary", headers=operator()).get_json()["run"][
            "run_dir"
        ] == str(tmp_path / dropped)
        assert len(registry.open_ids()) == 2 and dropped in registry.open_ids()
        # The landing page: a server-paged table, its filter and search labelled.
        page = client.get("/").get_data(as_text=True)
        assert (
            'id="runs-table"' in page
            and '<label for="runs-state">' in page
            and '<label for="runs-q">' in page
        )
    finally:
        app.extensions["rankwatch_runs"].stop()
