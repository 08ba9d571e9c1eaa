"""A run id in a URL: one path segment, unambiguous, readable.

A run id is a POSIX path relative to the runs root (``team/exp 1``), so it
may hold ``/``, and a ``%2F`` that a server decodes before routing could not
be told from one. So the id is written as ONE segment: ``~`` becomes
``~7E`` and ``/`` becomes ``~2F`` (percent-encoding with ``~`` as the
escape), then the segment is percent-encoded as usual by ``url_for``:
``team/exp 1`` is ``/runs/team~2Fexp%201/``. Decoding accepts exactly these
two escapes, so every run has one URL and every URL at most one run.
"""

from __future__ import annotations

import os
import re

from werkzeug.routing import BaseConverter, ValidationError

_ESCAPE = re.compile(r"~(7E|2F)")
_DECODE = {"7E": "~", "2F": "/"}


def encode(run_id: str) -> str:
    return run_id.replace("~", "~7E").replace("/", "~2F")


def decode(segment: str) -> str | None:
    """The run id a segment names, or None if it is not one ``encode`` makes."""
    run_id = _ESCAPE.sub(lambda m: _DECODE[m.group(1)], segment)
    return run_id if encode(run_id) == segment else None


def single_id(run_dir: str) -> str:
    """The id of the one run of ``--run-dir``: its directory's name."""
    return os.path.basename(os.path.normpath(os.path.abspath(run_dir))) or "run"


def of_dir(run_dir: str | os.PathLike, root: str | os.PathLike | None) -> str:
    """The id of the run in ``run_dir``: its path below ``root`` if it is below it, else its name.

    What the audit trail's ``run`` column holds, so a shared ``AUDIT_DB``
    gets the same id for a run from ``--runs ROOT``, from ``--run-dir`` and
    from the CLI (with ``RANKWATCH_RUNS_ROOT`` set to that root).
    """
    run_dir = os.path.abspath(run_dir)
    if root:
        rel = os.path.relpath(run_dir, os.path.abspath(root))
        if rel != "." and rel != ".." and not rel.startswith(".." + os.sep):
            return rel.replace(os.sep, "/")
    return single_id(run_dir)


class RunIdConverter(BaseConverter):
    """``<run:run_id>``: a run id as one URL segment (``encode``/``decode``)."""

    regex = "[^/]+"
    part_isolating = True

    def to_python(self, value: str) -> str:
        run_id = decode(value)
        if run_id is None or not run_id:
            raise ValidationError()
        return run_id

    def to_url(self, value: str) -> str:
        return super().to_url(encode(value))
