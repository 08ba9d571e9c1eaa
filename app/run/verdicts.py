"""The verdicts' names: the list, the order trouble-first, each one's line of help and its glyph.

What the page, the CLI, Prometheus, the stop and the agent share of a
rank's verdict, apart from the rules that reach it (``app.run.health``).
"""

from __future__ import annotations

VERDICTS = (
    "starting",
    "healthy",
    "straggler",
    "stalled",
    "dead",
    "node_lost",
    # Only a hub shows it (app/agent/hub.py): the agent of the rank's host went silent.
    "agent_lost",
    "exited",
    "finished",
    "failed",
    "pending",
    "corrupt",
)

# Trouble first: the order of "sort by verdict" (the page's table.js keeps the same list).
WORST_FIRST = (
    "node_lost", "agent_lost", "dead", "failed", "stalled", "corrupt", "straggler",
    "pending", "starting", "healthy", "exited", "finished",
)  # fmt: skip

# One line per verdict, for the page's legend and the README.
VERDICT_HELP = {
    "starting": "has reported but not finished its first step yet (compiling the graph)",
    "healthy": "training (or saving) at the pace of its peers",
    "straggler": "steps markedly slower than the median of its peers",
    "stalled": "alive but has not finished a step for too long",
    "dead": "the process is gone or its heartbeats stopped",
    "exited": "stopped gracefully on request",
    "finished": "completed its training",
    "failed": "the process ended with an error",
    "pending": "has not written a heartbeat yet",
    "corrupt": "its heartbeat file is invalid (too large, not JSON, or a field out of bounds)",
    "node_lost": "every rank of its host went silent together while other hosts report: a machine or network failure",
    "agent_lost": "the agent of its host sent no digest for AGENT_LOST_S: its state is unknown (it may be training)",
}

# A shape per verdict, so that colour is never the only cue (the page's
# static/js/format.js GLYPH holds the same; tests/cli/test_cli.py checks they agree).
VERDICT_GLYPH = {
    "starting": "○",
    "healthy": "✓",
    "straggler": "▲",
    "stalled": "‖",
    "dead": "✕",
    "exited": "■",
    "finished": "★",
    "failed": "!",
    "pending": "…",
    "node_lost": "⨯",
    "agent_lost": "⊘",
    "corrupt": "?",
}

# States that end a rank's life; their verdict is the state itself.
TERMINAL_STATES = ("exited", "finished", "failed")
# Verdicts of a rank whose process has ended, or is taken for gone: its last
# rates (throughput, step time, CPU) describe the past, not the job.
ENDED_VERDICTS = ("dead", "node_lost", *TERMINAL_STATES)
# States in which a rank steps and so is compared with its peers.
STEPPING_STATES = ("training", "stopping")
