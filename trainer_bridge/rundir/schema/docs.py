"""The schema tables of docs/run-directory.md, generated from the models' field descriptions."""

from __future__ import annotations

import re
import sys
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel

from trainer_bridge.rundir.schema.base import _Model
from trainer_bridge.rundir.schema.heartbeat import BridgeCost, Device, Heartbeat, HistoryLine, StopRecord
from trainer_bridge.rundir.schema.job import (
    AttemptCause,
    AttemptEnd,
    AttemptHosts,
    AttemptNode,
    AttemptRefused,
    AttemptStart,
    AttemptSupervised,
    Job,
    RetentionFile,
    Scheduler,
    SpikesFile,
)


def _describe(field: Any) -> str:
    """A field's type for a reader: int, float or null, one of ..., object, list of float."""
    ann = field.annotation

    def name(t: Any) -> str:
        origin = typing.get_origin(t)
        if origin is Annotated:
            return name(typing.get_args(t)[0])
        if origin in (typing.Union, types.UnionType):
            parts = [name(a) for a in typing.get_args(t) if a is not type(None)]
            nullable = type(None) in typing.get_args(t)
            return " or ".join(parts) + (" or null" if nullable else "")
        if origin is Literal:
            args = typing.get_args(t)
            return "int" if all(isinstance(a, int) for a in args) else "str"
        if origin is list:
            return f"list of {name(typing.get_args(t)[0])}"
        if origin is dict:
            return "object"
        if isinstance(t, type) and issubclass(t, BaseModel):
            return "object"
        return getattr(t, "__name__", str(t))

    return name(ann)


def markdown_table(model: type[_Model]) -> str:
    """The README table of ``model``'s fields: name, type, meaning."""
    lines = ["| field | type | meaning |", "|---|---|---|"]
    for attr, field in model.model_fields.items():
        lines.append(f"| `{field.alias or attr}` | {_describe(field)} | {field.description or ''} |")
    return "\n".join(lines)


# The tables the README carries, in its order, between <!-- schema:NAME --> markers.
README_TABLES = {
    "heartbeat": Heartbeat,
    "stop": StopRecord,
    "device": Device,
    "bridge_cost": BridgeCost,
    "history": HistoryLine,
    "job": Job,
    "retention": RetentionFile,
    "spikes": SpikesFile,
    "attempt_start": AttemptStart,
    "attempt_hosts": AttemptHosts,
    "attempt_end": AttemptEnd,
    "attempt_supervised": AttemptSupervised,
    "attempt_cause": AttemptCause,
    "attempt_refused": AttemptRefused,
    "attempt_scheduler": Scheduler,
    "attempt_node": AttemptNode,
}


def render_readme(text: str) -> str:
    """``text`` with every ``<!-- schema:NAME -->`` block replaced by NAME's current table."""
    for name, model in README_TABLES.items():
        block = re.compile(rf"(<!-- schema:{name} -->\n).*?(<!-- /schema -->)", re.S)
        text = block.sub(lambda m, model=model: f"{m.group(1)}{markdown_table(model)}\n{m.group(2)}", text)
    return text


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer_bridge.rundir.schema [docs/run-directory.md]``: print the tables, or rewrite them in place."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        for name, model in README_TABLES.items():
            print(f"<!-- schema:{name} -->\n{markdown_table(model)}\n<!-- /schema -->\n")
        return 0
    path = argv[0]
    with open(path, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_readme(text))
    return 0
