"""The Ranks page: the run model (``app.run``) shaped for the page, its JSON API and Socket.IO.

``routes.py`` (the page and ``/api/ranks``), ``events.py`` (Socket.IO),
``window.py`` (the page's slice of a large job), ``metrics.py`` (every
row field described), ``charts.py`` (the charts, shaped from a
``RunState``). Importing this package imports no Flask.
"""
