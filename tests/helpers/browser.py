"""Reading the page in Chromium: a rank's row and cell, the laptop viewport, overflow."""

from __future__ import annotations

WAIT_MS = 30_000


def row(page, rank: int):
    return page.locator(f'#rank-table tbody tr[data-rank="{rank}"]')


def cell(page, rank: int, col: str):
    return row(page, rank).locator(f'td[data-col="{col}"]')


LAPTOP = {"width": 1366, "height": 768}


def horizontal_overflow(page) -> dict:
    return page.evaluate(
        """() => {
          const wrap = document.querySelector('#rank-table').closest('.table-wrap');
          const doc = document.documentElement;
          return {table: wrap.scrollWidth - wrap.clientWidth, page: doc.scrollWidth - doc.clientWidth};
        }"""
    )
