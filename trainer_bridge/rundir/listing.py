"""How a message names a list that may be long: the first few, then "and N more".

Both processes name ranks, hosts and files in their sentences (a refused
launch, a stop's laggards, a status line, a retention plan), and a 100,000-rank
job must not make a sentence of 100,000 numbers. One rule, written once.
"""

from __future__ import annotations

from collections.abc import Iterable


def first_of(items: Iterable, limit: int, sep: str = ", ") -> str:
    """``items`` as text, at most ``limit`` of them, then " and N more" for the rest."""
    items = [str(i) for i in items]
    shown = sep.join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
