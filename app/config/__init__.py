"""Dashboard settings, declared once as data.

``SETTINGS`` is the single list the application, the command line, the README
and ``tests/test_docs.py`` all loop over. Each setting is read from the
environment variable ``RANKWATCH_<NAME>`` and can be overridden by a
``--<name>`` flag or by the dict passed to ``create_app``. The type of a
setting is the type of its default.

The machinery (``Setting``, the groups) is in ``setting.py``; the settings
themselves are declared by area, one module each, named as the app's packages
are: ``run``, ``ranks``, ``stop``, ``edge``, ``incidents`` and ``cluster``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from app.config import cluster, edge, incidents, ranks, run, stop
from app.config.edge import PING_INTERVAL_S
from app.config.ranks import LARGE_JOB_RANKS
from app.config.setting import (
    BOOLEANS,
    ENV_PREFIX,
    G_ACCESS,
    G_AGENTS,
    G_HEALTH,
    G_INCIDENTS,
    G_PAGE,
    G_REDIS,
    G_RUN,
    G_SERVER,
    G_STOP,
    GROUPS,
    ZERO_OK,
    Setting,
)

__all__ = [
    "BOOLEANS",
    "ENV_PREFIX",
    "GROUPS",
    "G_ACCESS",
    "G_AGENTS",
    "G_HEALTH",
    "G_INCIDENTS",
    "G_PAGE",
    "G_REDIS",
    "G_RUN",
    "G_SERVER",
    "G_STOP",
    "LARGE_JOB_RANKS",
    "PING_INTERVAL_S",
    "SETTINGS",
    "SETTINGS_BY_NAME",
    "Setting",
    "ZERO_OK",
    "coerce_all",
    "from_env",
    "grouped",
    "secrets_from_env",
]

SETTINGS: list[Setting] = [
    *run.SETTINGS,
    *ranks.SETTINGS,
    *stop.SETTINGS,
    *edge.SETTINGS,
    *incidents.SETTINGS,
    *cluster.SETTINGS,
]

SETTINGS_BY_NAME = {s.name: s for s in SETTINGS}


def grouped() -> list[tuple[str, list[Setting]]]:
    """``SETTINGS`` by group, in ``GROUPS``' order (each group in ``SETTINGS``' order)."""
    return [(title, [s for s in SETTINGS if s.group == title]) for title in GROUPS]


def from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every setting's value: from ``RANKWATCH_<NAME>`` if set, else its default.

    A secret (``Setting.argv`` False) may come from the file ``RANKWATCH_<NAME>_FILE`` names instead.
    """
    environ = os.environ if environ is None else environ
    return {s.name: _value(s, environ) for s in SETTINGS}


def secrets_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings that have no command-line flag (secrets), from the environment or their files."""
    environ = os.environ if environ is None else environ
    return {s.name: _value(s, environ) for s in SETTINGS if not s.argv}


def _value(s: Setting, environ: Mapping[str, str]) -> Any:
    if s.env in environ:
        return s.coerce(environ[s.env])
    if not s.argv and environ.get(s.env_file):
        path = environ[s.env_file]
        try:
            with open(path, encoding="utf-8") as f:
                return s.coerce(f.read(4096).strip())
        except OSError as e:
            raise ValueError(
                f"setting {s.name}: cannot read {s.env_file} ({path}): {e.strerror or e}"
            ) from None
    return s.default


def coerce_all(config: Mapping[str, Any]) -> dict[str, Any]:
    """Coerce the known settings in ``config``; other keys (Flask's own) pass through."""
    return {k: SETTINGS_BY_NAME[k].coerce(v) if k in SETTINGS_BY_NAME else v for k, v in config.items()}
