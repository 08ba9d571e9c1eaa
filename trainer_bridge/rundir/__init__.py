"""The run-directory contract: the only code the trainer and the dashboard share.

Everything one process writes into ``RUN/`` and another reads is drawn here,
once: the paths and the stop flag (``runfiles``), the typed files
(``schema``, ``stackfiles``), opening them and their directories safely
(``safeio``, ``safedirs``), the Redis channel beside the files
(``redisbus``), checkpoint files, sets and their metadata (``ckptpaths``,
``ckptindex``, ``ckptmeta``, ``ckpthealth``), msrun's launch line
(``launch``), each launch of the job (``attempts``, with the supervisor's
lines folded by ``supervised``; ``launchguard`` refuses a second one at
once), whether a rank's process lives (``liveness``), whether a run
directory is a copy (``copies``) and py-spy (``pyspy``).

It imports the standard library, pydantic and psutil, never MindSpore, so the
dashboard can import it on a machine without an accelerator; ``make lint``
checks that rule (import-linter, ``pyproject.toml``).
"""
