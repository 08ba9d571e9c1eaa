"""The checkpoint browser's page and API (README, "Checkpoint browser" and "JSON API").

Reads need no token. Delete changes state, so it needs the operator token
and a JSON body (``app.edge.params``). Deep verify only reads the files, but it
starts a MindSpore process that costs memory, so it needs the token too.
"""

from __future__ import annotations

import time

from flask import Blueprint, current_app, jsonify, render_template, request, send_file, url_for

from app import push
from app.checkpoints.params import ApplyPlan, DeleteSet, FilePath, PinSet, SetId, VerifySet
from app.checkpoints.service import local_only
from app.edge import params
from app.edge.auth import for_viewer, has_token, require_operator
from app.errors import NotFound
from app.extensions import rankwatch, socketio
from app.push import CHECKPOINTS_DELTA_EVENT, CHECKPOINTS_EVENT, CHECKPOINTS_INDEX_REQUEST, VERIFY_EVENT
from trainer_bridge.rundir import runfiles

bp = Blueprint("checkpoints", __name__)
bp.record_once(
    lambda setup: setup.app.extensions["rankwatch"].nav.append(("checkpoints.page", "Checkpoints"))
)

WHO_DEFAULT = "operator"


def _world() -> int:
    """The job's world size (0 when unknown) from a fresh-enough view of the run."""
    rw = rankwatch()
    rw.state.refresh(time.time(), rw.watcher.tick_s)
    return rw.state.heartbeats()[1]


@bp.get("/checkpoints")
def page():
    config = {
        "events": {
            "checkpoints": CHECKPOINTS_EVENT,
            "delta": CHECKPOINTS_DELTA_EVENT,
            "whole": CHECKPOINTS_INDEX_REQUEST,
            "verify": VERIFY_EVENT,
        },
        "urls": {
            name: url_for(f"checkpoints.{endpoint}")
            for name, endpoint in (
                ("list", "api_checkpoints"),
                ("file", "api_file"),
                ("resume", "api_resume"),
                ("delete", "api_delete"),
                ("verify", "api_verify_start"),
                ("retention", "api_retention"),
                ("retention_apply", "api_retention_apply"),
                ("pin", "api_pin"),
            )
        },
        "scan_s": current_app.config["CHECKPOINT_SCAN_S"],
        "resume_step_env": runfiles.RESUME_STEP_ENV,
    }
    return render_template("checkpoints.html", page_config=config)


@bp.get("/api/checkpoints")
def api_checkpoints():
    return jsonify(_for_viewer(rankwatch().checkpoints.body(_world())))


# What a viewer without the token gets instead of the relaunch command.
COMMAND_NEEDS_TOKEN = (
    "the relaunch command (the job's own command line and arguments) is shown with the operator token"
)


def _for_viewer(body: dict) -> dict:
    """``body`` as a viewer without the token sees it: no absolute path of the run directory (P11)."""
    return for_viewer(body, rankwatch().checkpoints.run_dir, rankwatch().room)


@bp.get("/api/checkpoints/file")
def api_file():
    """Download one checkpoint file the index lists (``?path=`` relative to the run directory)."""
    f, name, size = rankwatch().checkpoints.open_file(params.query(FilePath).path, _world())
    # Sent from the descriptor opened after the checks (not re-opened by path),
    # so werkzeug cannot stat it: give the length, and no ranges without it.
    response = send_file(
        f, as_attachment=True, download_name=name, mimetype="application/octet-stream", conditional=False
    )
    response.content_length = size
    return response


@bp.get("/api/checkpoints/resume")
def api_resume():
    """The relaunch command and the code that loads the set ``?set=ID``."""
    world = _world()
    heartbeats, _ = rankwatch().state.heartbeats()
    body = rankwatch().checkpoints.resume(params.query(SetId).set, world, heartbeats)
    if body.get("command") and not has_token():
        # job.json's launcher_argv and script arguments: the operator's (P11).
        body = {
            **body,
            "command": None,
            "command_notes": [COMMAND_NEEDS_TOKEN, *body.get("command_notes", [])],
        }
    return jsonify(_for_viewer(body))


@bp.post("/api/checkpoints/delete")
def api_delete():
    require_operator()
    body = params.body(DeleteSet)
    service = rankwatch().checkpoints
    world = _world()
    result = service.delete(
        body.set,
        world,
        who=body.who or WHO_DEFAULT,
        remote_addr=request.remote_addr,
        reason=body.reason,
        force=body.force,
    )
    _push_now(service, world)
    return jsonify(result)


def _push_now(service, world) -> None:
    """Every page shows a change an operator made now, rather than at the watcher's next scan."""
    pushed = service.poll(world)
    if pushed is not None:
        push.emit(socketio, *pushed, run=rankwatch().room, redact=rankwatch().redact)


@bp.post("/api/checkpoints/verify")
def api_verify_start():
    """Start a deep verify of ``{"set": ID}``; progress arrives as ``checkpoint_verify`` events.

    Needs the token: it only reads, but it runs a MindSpore process that may
    take a few times the set's size in memory (one at a time; see verify.py).
    """
    require_operator()
    body = params.body(VerifySet)
    service = rankwatch().checkpoints
    _, cset = service.find(body.set, _world())
    local_only(cset.files, "verified")
    return jsonify(service.verifier.start(cset.id, cset.files, service.run_dir)), 202


@bp.get("/api/checkpoints/verify")
def api_verify_status():
    """The latest deep verify of ``?set=ID``, with every file's result."""
    set_id = params.query(SetId).set
    service = rankwatch().checkpoints
    status = service.verifier.status(set_id)
    if status is None:
        service.find(set_id, _world())  # an unknown set is a 404 that says so
        raise NotFound("no deep verify of this set has run since the dashboard started")
    return jsonify(status)


@bp.get("/api/checkpoints/retention")
def api_retention():
    """The retention plan: every set's keep or delete and why, the policy in force, disk space."""
    heartbeats, world = rankwatch().state.heartbeats()
    world = _world()
    return jsonify(rankwatch().checkpoints.retention.body(world, heartbeats))


@bp.post("/api/checkpoints/retention/apply")
def api_retention_apply():
    """Apply exactly the plan the operator saw (``{"hash"}``); 409 if it changed since."""
    require_operator()
    body = params.body(ApplyPlan)
    service = rankwatch().checkpoints
    world = _world()
    heartbeats, _ = rankwatch().state.heartbeats()
    result = service.retention.apply(
        body.hash, world, heartbeats, who=body.who or WHO_DEFAULT, remote_addr=request.remote_addr
    )
    _push_now(service, world)
    return jsonify(result)


@bp.post("/api/checkpoints/pin")
def api_pin():
    """Pin (``"pinned": true``) or unpin a set: retention never deletes a pinned set. Audited."""
    require_operator()
    body = params.body(PinSet)
    return jsonify(
        rankwatch().checkpoints.retention.pin(
            body.set,
            body.pinned,
            _world(),
            who=body.who or WHO_DEFAULT,
            remote_addr=request.remote_addr,
            reason=body.reason or "",
        )
    )
