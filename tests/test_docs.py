"""The README documents every setting, API route, Socket.IO event, row field and verdict."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.config import SETTINGS
from app.health import VERDICTS
from app.main.events import EVENTS
from app.metrics import METRICS
from tests.heartbeats import heartbeat

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    """The README section headed ``title``, up to the next heading of its level or above."""
    heading = re.search(rf"^(#+) {re.escape(title)}$", README, re.M)
    assert heading, f"README has no section {title!r}"
    level = len(heading.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(README, heading.end())
    return README[heading.end():end.start() if end else len(README)]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_setting_is_documented(setting):
    assert f"`{setting.env}`" in section("Dashboard settings")


def api_routes(app) -> list[str]:
    routes = []
    for rule in app.url_map.iter_rules():
        if rule.rule.startswith("/api/"):
            path = re.sub(r"<(?:\w+:)?(\w+)>", r"<\1>", rule.rule)
            routes += [f"{method} {path}" for method in sorted(rule.methods - {"HEAD", "OPTIONS"})]
    return routes


def test_every_api_route_is_documented(app):
    routes = api_routes(app)
    assert "GET /api/ranks" in routes
    text = section("JSON API")
    assert [r for r in routes if f"`{r}`" not in text] == []


@pytest.mark.parametrize("event", sorted(EVENTS))
def test_socket_event_is_documented(event):
    assert f"`{event}`" in section("Socket.IO events")


@pytest.mark.parametrize("field", [m.name for m in METRICS if m.group != "job"])
def test_row_field_is_documented(field):
    assert f"`{field}`" in section("JSON API")


@pytest.mark.parametrize("verdict", VERDICTS)
def test_verdict_is_documented(verdict):
    assert f"`{verdict}`" in section("Health verdicts")


def test_heartbeat_helper_writes_exactly_the_readme_schema():
    table = section("Heartbeat: `rankwatch/rank_{r}.json` (schema 1)")
    fields = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            fields |= set(re.findall(r"`(\w+)`", line.split("|")[1]))
    assert set(heartbeat(0, 1)) == fields
