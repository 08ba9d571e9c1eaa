"""Reading and building the files: parse, build, validate and load, each failing with a SchemaError."""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import ValidationError

from trainer_bridge.rundir.runfiles import MAX_FILE_BYTES, FileTooLarge, read_capped
from trainer_bridge.rundir.schema.base import MAX_WARNING, MAX_WARNINGS, M, SchemaError, _error, _explain
from trainer_bridge.rundir.schema.heartbeat import Device, Heartbeat

# ---------------------------------------------------------------- a bad device figure

# What a Device may lose and stay a Device; without its kind or index it is dropped whole.
_DEVICE_REQUIRED = ("kind", "index")


def _device_at_fault(model: type, e: ValidationError) -> bool:
    return model is Heartbeat and all(err["loc"][:1] == ("device",) for err in e.errors())


def clean_device(raw: Any) -> tuple[dict | None, list[str]]:
    """A heartbeat's ``device`` without its bad figures, and a warning for each one left out.

    One out-of-range figure (``npu-smi`` printing a utilisation of 101, or
    garbage) must not fail the whole heartbeat, or the rank looks dead.
    """
    if not isinstance(raw, dict):
        return None, [f"device: not an object (got {type(raw).__name__}); left out"]
    device, notes = dict(raw), []
    for _ in range(len(Device.model_fields) + 1):
        try:
            Device.model_validate(device)
            return device, notes
        except ValidationError as e:
            errors = e.errors(include_url=False)
            bad = {err["loc"][0] for err in errors if err["loc"] and err["loc"][0] not in _DEVICE_REQUIRED}
            if len(bad) < len(errors) or not bad:
                return None, [*notes, f"device left out: {_explain(e)}"]
            for name in sorted(bad, key=str):
                value = repr(device.pop(name))
                value = value if len(value) <= 40 else value[:37] + "..."
                notes.append(f"device {name} {value} is out of range or not a number; left out")
    return None, notes


def _without_bad_device(fields: dict) -> dict:
    device, notes = clean_device(fields.get("device"))
    warnings = fields.get("warnings")
    if not isinstance(warnings, list):
        return {**fields, "device": device}
    # Newest last, as the bridge keeps them; a note is cut to the field's bound.
    warnings = [*warnings, *(n[:MAX_WARNING] for n in notes)][-MAX_WARNINGS:]
    return {**fields, "device": device, "warnings": warnings}


def parse(model: type[M], data: bytes | str) -> M:
    """Validate a file's bytes against ``model``; SchemaError says what is wrong."""
    if len(data) > MAX_FILE_BYTES:
        raise SchemaError(
            f"file is {len(data)} bytes, more than the {MAX_FILE_BYTES} a {model.__name__} may be"
        )
    try:
        return model.model_validate_json(data)
    except ValidationError as e:
        if not _device_at_fault(model, e):
            raise _error(e) from None
    # Only a heartbeat whose device alone is wrong gets here: keep the rest.
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise SchemaError(f"not valid JSON: {e}") from None
    return validate(model, obj)


def build(model: type[M], /, **fields: Any) -> M:
    """``model(**fields)``, failing with SchemaError: how a writer makes a file's object.

    A heartbeat whose ``device`` alone is wrong is built without the bad
    figures, and says so in its ``warnings`` (``clean_device``).
    """
    try:
        return model(**fields)
    except ValidationError as e:
        if not _device_at_fault(model, e):
            raise _error(e) from None
    try:
        return model(**_without_bad_device(fields))
    except ValidationError as e:
        raise _error(e) from None


def validate(model: type[M], obj: Any) -> M:
    """Validate an already-parsed JSON value (e.g. from Redis) against ``model``.

    As ``build``, a heartbeat whose ``device`` alone is wrong keeps the rest.
    """
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        if not (_device_at_fault(model, e) and isinstance(obj, dict)):
            raise _error(e) from None
    try:
        return model.model_validate(_without_bad_device(obj))
    except ValidationError as e:
        raise _error(e) from None


def load(model: type[M], path: str | os.PathLike) -> M:
    """Read (at most ``MAX_FILE_BYTES``) and validate one run-directory file.

    Raises OSError, or SchemaError for a file too large or not matching ``model``.
    """
    try:
        data = read_capped(path)
    except FileTooLarge as e:
        raise SchemaError(str(e)) from None
    return parse(model, data)
