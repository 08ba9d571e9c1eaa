"""One agent per host, digests over Redis Streams, and the hub that reads them (issue 20).

``rankwatch agent`` (``app/agent/runner.py``) runs beside msrun on every
node. It reads its own host's run directory with the dashboard's
``RunState`` (the same reader, the same ``VerdictBoard``, the same rows) and
once a second adds one **host digest** to the run's Redis Stream
(``app/agent/digest.py`` defines it, builds it and checks it). The
dashboard started with ``AGENTS`` (or ``RUN``) reads the digests through a
consumer group (``app/agent/hub.py``; a silent agent is judged by
``app/agent/lost.py``) and shows every node's ranks
(``app/agent/hubsource.py``); a stop it writes into its own run directory is
mirrored to Redis and written by each agent into its host's run directory
with the bridge's own flag writer. The hub asks an agent for what a digest
does not carry (a rank's full row and history, the node's checkpoint files)
over one request/answer channel in Redis (``app/agent/ask.py``).
"""
