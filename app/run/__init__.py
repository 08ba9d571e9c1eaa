"""The run model: what every page, the watcher, the agent and the CLI read about one run.

Its sources are what the ranks say: their heartbeat files or Redis
(``heartbeats.py``), msrun's worker logs (``logmode/``), and, on a hub, the
agents' digests (``app.agent.hubsource``, a source as ``sources.py`` defines
one, given to ``RunState``). ``health.py`` holds the rules (over
``stepcost.py``'s step windows, naming ``verdicts.py``'s verdicts) and
``judging.py`` applies them to every rank at once; ``rows.py`` is the record
each rank is shown as; ``history.py`` keeps the whole-run charts;
``ending.py`` finds which ranks have ended, and ``jobend.py`` says
whether the job can still obey a stop; ``state.py``'s
``RunState`` holds it all under one lock. Importing this package imports no
Flask: the pages that show it (``app.ranks``, ``app.stop``, ...) sit above.
"""
