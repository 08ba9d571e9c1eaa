"""The manual (README.md and docs/*.md) documents every setting, API route, Socket.IO event, row field and verdict."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.config import SETTINGS
from app.ranks.events import EVENTS
from app.ranks.metrics import METRICS
from app.run.verdicts import VERDICTS
from tests.helpers.heartbeats import heartbeat
from trainer_bridge.rundir import schema

ROOT = Path(__file__).resolve().parents[1]
# The README is the front door; the reference lives in docs/, one page per area.
PAGES = {
    p: p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
}


def section(title: str) -> str:
    """The manual's section headed ``title``, up to the next heading of its level or above."""
    for text in PAGES.values():
        heading = re.search(rf"^(#+) {re.escape(title)}$", text, re.M)
        if heading:
            level = len(heading.group(1))
            end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, heading.end())
            return text[heading.end() : end.start() if end else len(text)]
    raise AssertionError(f"no page of the manual has a section {title!r}")


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_setting_is_documented(setting):
    assert f"`{setting.env}`" in section("Dashboard settings")


def api_routes(app) -> list[str]:
    """Every /api/ route, without the per-run twins (documented once, as a rule, in "JSON API")."""
    routes = []
    for rule in app.url_map.iter_rules():
        if rule.rule.startswith("/api/") and "run_id" not in rule.arguments:
            path = re.sub(r"<(?:\w+:)?(\w+)>", r"<\1>", rule.rule)
            routes += [f"{method} {path}" for method in sorted(rule.methods - {"HEAD", "OPTIONS"})]
    return routes


def test_every_api_route_is_documented(app):
    routes = api_routes(app)
    assert "GET /api/ranks" in routes
    text = section("JSON API")
    # Each route's run-scoped twin exists (app/runs/scoping.py), and the rule is written down.
    twins = [r.rule for r in app.url_map.iter_rules() if "run_id" in r.arguments]
    assert "/api/runs/<run:run_id>/ranks" in twins and "/runs/<run:run_id>/" in twins
    assert "`/api/runs/<id>/X`" in text
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


@pytest.mark.parametrize("page", sorted(PAGES), ids=lambda p: p.name)
def test_schema_tables_are_generated_from_the_schema(page):
    # Regenerate with: python -m trainer_bridge.rundir.schema docs/run-directory.md
    assert schema.render_readme(PAGES[page]) == PAGES[page]


def test_the_schema_tables_are_in_the_manual():
    text = "".join(PAGES.values())
    assert [name for name in schema.README_TABLES if f"<!-- schema:{name} -->" not in text] == []


def test_links_between_pages_resolve():
    """Every relative link to a page (and its #anchor) of the manual points at something there."""

    def anchors(text):
        heads = re.findall(r"^#+ (.*)$", text, re.M)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}

    broken = []
    for page, text in PAGES.items():
        for target, anchor in re.findall(r"\]\(([^)#:\s]*\.md|)(?:#([^)\s]+))?\)", text):
            dest = (page.parent / target).resolve() if target else page
            if dest not in PAGES:
                broken.append(f"{page.name}: {target}")
            elif anchor and anchor not in anchors(PAGES[dest]):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert broken == []


def test_heartbeat_helper_writes_exactly_the_schema():
    beat = heartbeat(0, 1)
    assert set(beat) == {f.alias or name for name, f in schema.Heartbeat.model_fields.items()}
    assert schema.validate(schema.Heartbeat, beat).to_dict() == beat


def test_every_cli_command_is_documented():
    from app.cli import main

    text = section("The command line: `rankwatch`")
    assert [c for c in main.commands if f"rankwatch {c} " not in text] == []


def test_every_prometheus_metric_is_documented(client):
    from prometheus_client.parser import text_string_to_metric_families

    text = section("Prometheus metrics")
    body = client.get("/metrics").get_data(as_text=True)
    names = {f.name for f in text_string_to_metric_families(body) if f.name.startswith("rankwatch_")}
    # Counters are documented by their sample name (with _total); enums and infos with their labels.
    documented = set(re.findall(r"`(rankwatch_\w+?)(?:_total)?[`{]", text))
    assert sorted(names - documented) == []
