"""The live console: the page, the JSON API and the Socket.IO events."""

from flask import Blueprint

bp = Blueprint("main", __name__)
bp.record_once(lambda setup: setup.app.extensions["rankwatch"].nav.append(("main.index", "Ranks")))

from app.ranks import events, routes  # noqa: E402,F401  (they register on bp and socketio)
