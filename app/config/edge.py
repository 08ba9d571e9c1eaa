"""Who may act (the operator token, sign-in, rate limits) and how the server holds up under load."""

from __future__ import annotations

from app.config.setting import G_ACCESS, G_SERVER, Setting

SETTINGS: list[Setting] = [
    Setting(
        "TOKEN",
        "",
        "The operator token that stop, cancel, re-arm and delete require (as "
        "`Authorization: Bearer <token>`, or typed once into the page). When unset, one is "
        "generated at start. It is never printed: the dashboard prints a single-use login link "
        "instead (`rankwatch login` mints another). A secret: no command-line flag (`ps` shows "
        "argv to every user of the host); from the environment, or from the file "
        "`RANKWATCH_TOKEN_FILE` names. A token shorter than 16 characters, or with little "
        "entropy, is warned about at start.",
        group=G_ACCESS,
        argv=False,
    ),
    Setting(
        "LOGIN_TTL_S",
        120.0,
        "How long a single-use login link works (the one printed at start, and each one "
        "`rankwatch login` prints). Two minutes is enough to open a link just printed; a link "
        "found later in a scrollback or a log is dead.",
        group=G_ACCESS,
    ),
    Setting(
        "LOGIN_LINK",
        "auto",
        "Where the start-up login link is printed: `auto` prints it when the output is a terminal, "
        "and only the address otherwise (a log file or a service's journal keeps no link); `always`; "
        "`never`. `rankwatch login` prints a fresh one on demand.",
        choices=("auto", "always", "never"),
        group=G_ACCESS,
    ),
    Setting(
        "OPERATOR_WRITES_PER_MIN",
        30,
        "Changes (stop, cancel, re-arm, delete, verify) one client address may make per minute, "
        "in a burst or spread out; more get a 429 with Retry-After, except a stop request, which "
        "always goes through (past the budget a press that joins a pending stop is not audited). "
        "A person clicks a few; this stops a script with the token from filling the audit trail "
        "without bound.",
        group=G_ACCESS,
    ),
    Setting(
        "AUTH_FAILURES_PER_MIN",
        20,
        "Wrong operator tokens and login codes counted per minute from all addresses together "
        "(each address also backs off on its own, exponentially); past it every wrong guess gets "
        "a 429 until the minute allows, with a log line and an alert (`auth_flood`) when it trips. "
        "The right token is never refused, so guessing cannot lock the operator out.",
        group=G_ACCESS,
    ),
    Setting(
        "SERVER_THREADS",
        64,
        "Requests the server works on at once (gunicorn's threaded worker, one process). "
        "Each open page holds one for its WebSocket; API calls and page loads take one "
        "for a few milliseconds. Slow or idle connections hold none (HEADER_TIMEOUT_S).",
        group=G_SERVER,
    ),
    Setting(
        "HEADER_TIMEOUT_S",
        10.0,
        "A connection must send a complete request head (request line and headers) "
        "within this many seconds, or it is closed. Heads are read without a thread, so "
        "hundreds of slow or idle connections (slowloris) cannot starve the page; a browser "
        "sends its head at once.",
        group=G_SERVER,
    ),
    Setting(
        "BODY_TIMEOUT_S",
        10.0,
        "A request's body (at most MAX_BODY_BYTES, with a Content-Length) must arrive within this "
        "many seconds of its head, or it is answered 408 and the connection closed. Bodies are read "
        "without a thread, like heads, so POSTs that trickle a byte now and then hold none.",
        group=G_SERVER,
    ),
    Setting(
        "RESERVED_THREADS",
        4,
        "Threads kept, besides SERVER_THREADS, for requests that carry the operator token "
        "(`Authorization: Bearer`) and for `/api/health`: the stop and the health check answer "
        "while tokenless clients (idle WebSockets, long polls) hold every other thread.",
        group=G_SERVER,
    ),
    Setting(
        "MAX_CONNS_PER_ADDR",
        128,
        "Open connections one client address may hold once half of MAX_CONNECTIONS are open; a "
        "further one is then answered 503 and closed, so that one address cannot fill the server. "
        "A page needs one or two. Behind a reverse proxy every client has the proxy's address: "
        "raise it there.",
        group=G_SERVER,
    ),
    Setting(
        "MAX_CONNECTIONS",
        1000,
        "Open connections in all (gunicorn's `worker_connections`); past it new ones wait in the "
        "kernel's queue until one closes (slow heads close after HEADER_TIMEOUT_S, slow bodies after "
        "BODY_TIMEOUT_S).",
        group=G_SERVER,
    ),
    Setting(
        "READ_TIMEOUT_S",
        60.0,
        "Once a request is in, a write of its answer (or a WebSocket's read) that "
        "waits longer than this fails and frees the thread; an open page's WebSocket hears "
        "Engine.IO's ping every 25 s, so this must be longer than that.",
        group=G_SERVER,
    ),
    Setting(
        "MAX_BODY_BYTES",
        65536,
        "Largest request body accepted; larger ones get a 413. The API's bodies are a few short strings.",
        group=G_SERVER,
    ),
]

# Engine.IO's default ping interval (Flask-SocketIO passes it through): a live
# WebSocket hears from its page at least this often (see READ_TIMEOUT_S).
PING_INTERVAL_S = 25
