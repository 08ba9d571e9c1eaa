"""The ranks: heartbeats and msrun logs -> the rules (judging) -> rows -> the live page.

``heartbeats.py`` and ``logmode/`` read what each rank says, ``judging.py`` and
``health.py`` give each rank its verdict, ``state.py`` keeps the run's board,
``rows.py`` and ``metrics.py`` shape it for ``routes.py`` (the page and JSON API)
and ``events.py`` (Socket.IO). Importing this package imports no Flask.
"""
