"""Single-use login links: how the operator token reaches the page without being written down.

The URL that the dashboard prints carries ``#login=<code>``, not the
token. The page trades the code once (``POST /api/login``) for the token,
keeps the token in the tab's ``sessionStorage`` and strips the code from the
address bar. A code works once and for ``LOGIN_TTL_S`` seconds (2 min), so the URL
that stays in the browser's history, a terminal's scrollback or a log file is
worthless afterwards; the token itself is never printed.

A new link later, once the printed one is used up or expired:

* ``rankwatch login`` (``mint_login_url()`` from Python) on the machine and
  as the user running the dashboard. When it starts, the dashboard writes a
  *server file* in a directory only its user can read
  (``$XDG_RUNTIME_DIR/rankwatch/``, else ``~/.local/state/rankwatch/``;
  0700, the file 0600), as Jupyter does, with its URL and token;
  ``mint_login_url`` reads it and asks the dashboard for a code with the
  token. Being that user is what grants it: anyone who can read that file
  could also read the dashboard's memory.
* Or, with the token at hand: ``POST /api/login-code`` with
  ``Authorization: Bearer <token>``.

The start-up link is printed only to a terminal by default (``LOGIN_LINK``):
output that goes to a file is a log, and a log keeps no link.

Codes live in the dashboard's memory only: a restart forgets them.
"""

from __future__ import annotations

import atexit
import hmac
import json
import os
import secrets
import signal
import stat
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

# The default of the LOGIN_TTL_S setting (app/config/edge.py says why).
CODE_TTL_S = 120.0
# Codes waiting to be used; minting more drops the oldest.
MAX_CODES = 16
SERVER_FILE_PREFIX = "dashboard-"


def _login_command() -> str:
    """How to run ``rankwatch login`` here: by name when it is on PATH, else by the path beside this
    Python (``make demo`` users have ``.venv/bin/rankwatch``, not on PATH)."""
    import shutil

    beside = Path(sys.executable).parent / "rankwatch"
    if shutil.which("rankwatch") or not beside.is_file():
        return "rankwatch login"
    return f"{beside} login"


# What the messages that point at ``rankwatch login`` say.
LOGIN_COMMAND = _login_command()


class LoginCodes:
    """Outstanding single-use codes, each valid for ``ttl_s`` seconds."""

    def __init__(self, ttl_s: float = CODE_TTL_S, clock: Callable[[], float] = time.time):
        self.ttl_s = ttl_s
        self.clock = clock
        self._codes: dict[str, float] = {}  # code -> expires at
        self._lock = threading.Lock()

    def mint(self) -> tuple[str, float]:
        """A fresh code and when it expires (Unix seconds)."""
        code = secrets.token_urlsafe(18)
        with self._lock:
            now = self.clock()
            self._codes = {c: t for c, t in self._codes.items() if t > now}
            while len(self._codes) >= MAX_CODES:
                del self._codes[min(self._codes, key=self._codes.get)]
            expires = now + self.ttl_s
            self._codes[code] = expires
        return code, expires

    def redeem(self, code: str) -> bool:
        """True once for a live code; a code is gone after its first use, right or late."""
        with self._lock:
            match = next((c for c in self._codes if hmac.compare_digest(c.encode(), code.encode())), None)
            if match is None:
                return False
            expires = self._codes.pop(match)
            return expires > self.clock()


def login_url(base_url: str, code: str) -> str:
    return base_url.rstrip("/") + "/#login=" + code


def announce(app, url: str, terminal: bool) -> str:
    """The start-up lines about operating: a single-use login URL, never the token.

    ``Rankwatch: open URL`` is the line to open (the demo repeats it, so keep
    the prefix); the URL carries the code only when ``LOGIN_LINK`` allows it
    (by default when ``terminal``, the output being a terminal, not a log).
    Also writes the server file that ``rankwatch login`` reads to mint a
    new link later.
    """
    write_server_file(url, app.config["TOKEN"], app.config["RUN_DIR"], app.config.get("RUNS_ROOT") or "")
    mode = app.config["LOGIN_LINK"]
    if mode == "never" or (mode == "auto" and not terminal):
        why = "this output may be a log" if mode == "auto" else "LOGIN_LINK is never"
        return (
            f"Rankwatch: open {url}\n"
            f"    to operate (stop, delete), `{LOGIN_COMMAND}` prints a single-use login link "
            f"(none is printed here: {why})"
        )
    code, _ = app.extensions["rankwatch_login"].mint()
    how = (
        "a token was generated for this run (set RANKWATCH_TOKEN to choose your own)"
        if app.config["TOKEN_GENERATED"]
        else "the token is RANKWATCH_TOKEN"
    )
    return (
        f"Rankwatch: open {login_url(url, code)}\n"
        f"    a single-use link that makes that browser an operator (stop, delete), valid "
        f"{for_how_long(app.extensions['rankwatch_login'].ttl_s)}; {how}; `{LOGIN_COMMAND}` prints a new one"
    )


def for_how_long(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 and seconds % 60 == 0 else f"{seconds:.0f} s"


# -- the server file -------------------------------------------------------------


def runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or str(Path.home() / ".local" / "state")
    return Path(base) / "rankwatch"


def _private_dir() -> Path:
    """The server-file directory, created 0700; refused if anyone else could write or read it."""
    path = runtime_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} must be a directory of yours that only you can use (mode 0700)")
    return path


def write_server_file(url: str, token: str, run_dir: str, runs_root: str = "") -> Path | None:
    """Record this dashboard for ``mint_login_url``; removed when the process exits.

    Returns the file, or None (with a line on stderr) when it cannot be
    written safely: new links then need the token (``POST /api/login-code``).
    """
    try:
        path = _private_dir() / f"{SERVER_FILE_PREFIX}{os.getpid()}.json"
        data = json.dumps(
            {"url": url, "token": token, "pid": os.getpid(), "run_dir": run_dir, "runs_root": runs_root}
        ).encode()
        try:
            os.unlink(path)  # a leftover of a dead process with our pid
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError as e:
        print(f"Rankwatch: no server file for new login links ({e})", file=sys.stderr, flush=True)
        return None
    atexit.register(_remove, path)
    # atexit does not run on a plain SIGTERM (how services and tests stop a
    # dashboard): turn it into an ordinary exit, unless someone handles it already.
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    return path


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def running_dashboards() -> list[dict]:
    """The server files of this user's dashboards whose process still runs."""
    try:
        directory = _private_dir()
    except OSError:
        return []
    found = []
    for path in sorted(directory.glob(f"{SERVER_FILE_PREFIX}*.json")):
        try:
            info = json.loads(path.read_bytes())
            os.kill(int(info["pid"]), 0)
        except ProcessLookupError:
            _remove(path)  # left by a dashboard that was killed
            continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found.append(info)
    return found


def _serves(info: dict, run_dir: str) -> bool:
    """Whether the dashboard of this server file serves ``run_dir``: its run, or its --runs ROOT
    or a run under it (`rankwatch login --run-dir ROOT` found none of a --runs dashboard)."""
    want = os.path.realpath(run_dir)
    own = info.get("run_dir")
    if isinstance(own, str) and own and os.path.realpath(own) == want:
        return True
    root = info.get("runs_root")
    if not (isinstance(root, str) and root):
        return False
    root = os.path.realpath(root)
    return want == root or want.startswith(root + os.sep)


def mint_login_url(url: str | None = None, run_dir: str | None = None, timeout: float = 10.0) -> str:
    """A fresh single-use login URL for a running dashboard of this user.

    ``url`` or ``run_dir`` picks the dashboard when several run; with
    neither, there must be exactly one. Raises LookupError if none matches,
    RuntimeError if it refuses.
    """
    found = running_dashboards()
    if url is not None:
        found = [d for d in found if d.get("url", "").rstrip("/") == url.rstrip("/")]
    if run_dir is not None:
        found = [d for d in found if _serves(d, run_dir)]
    if len(found) != 1:
        where = ", ".join(d.get("url", "?") for d in found) or "none"
        raise LookupError(
            f"{len(found)} running dashboard(s) of this user match (found: {where}); "
            "give the URL or the run directory"
        )
    info = found[0]
    request = urllib.request.Request(
        info["url"].rstrip("/") + "/api/login-code",
        data=b"{}",
        method="POST",
        headers={"Authorization": f"Bearer {info['token']}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())["login_url"]
    except urllib.error.HTTPError as e:
        raise RuntimeError(
            f"the dashboard at {info['url']} refused: {e.read()[:300].decode(errors='replace')}"
        ) from None
