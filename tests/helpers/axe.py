"""axe-core on a page in Chromium (axe-playwright-python), its violations one line each."""

from __future__ import annotations

from axe_playwright_python.sync_playwright import Axe

EVERY_IMPACT = ("minor", "moderate", "serious", "critical")


def violations(page, impacts: tuple[str, ...] = EVERY_IMPACT) -> list[str]:
    """axe-core's violations of these impacts on the page as it is now, one line each."""
    results = Axe().run(page)
    return [
        f"{v['id']} ({v['impact']}): {[n['target'] for n in v['nodes']][:3]}"
        for v in results.response["violations"]
        if v["impact"] in impacts
    ]
