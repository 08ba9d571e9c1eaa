"""Reading the page in Chromium: a rank's row and cell, a node's row, the laptop viewport, overflow, axe."""

from __future__ import annotations

import time

from tests.helpers.axe import violations

WAIT_MS = 30_000

NODE_ROWS = "#rank-table tbody tr.node-row"
RANK_ROWS = "#rank-table tbody tr[data-rank]"


def row(page, rank: int):
    return page.locator(f'#rank-table tbody tr[data-rank="{rank}"]')


def cell(page, rank: int, col: str):
    return row(page, rank).locator(f'td[data-col="{col}"]')


def node_row(page, host: str):
    return page.locator(NODE_ROWS).filter(has=page.locator(".node-name", has_text=host))


LAPTOP = {"width": 1366, "height": 768}


def horizontal_overflow(page) -> dict:
    return page.evaluate(
        """() => {
          const wrap = document.querySelector('#rank-table').closest('.table-wrap');
          const doc = document.documentElement;
          return {table: wrap.scrollWidth - wrap.clientWidth, page: doc.scrollWidth - doc.clientWidth};
        }"""
    )


def serious(page) -> list[str]:
    """axe-core's serious and critical violations on the page, one line each (``tests/helpers/axe.py``)."""
    return violations(page, ("serious", "critical"))


def wait_for_js(page, expression: str, timeout_ms: int = WAIT_MS) -> None:
    """Poll ``expression`` in the page until it is truthy (a failure guard, not a timing).

    Not ``page.wait_for_function``: while its predicate is false it polls by
    evaluating the string inside the page, which the dashboard's CSP (no
    ``'unsafe-eval'``) refuses; ``page.evaluate`` is the browser's own.
    """
    deadline = time.monotonic() + timeout_ms / 1000
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"{expression!r} still false after {timeout_ms} ms")
        page.wait_for_timeout(50)
