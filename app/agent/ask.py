"""The hub asks an agent, the agent answers: one request/answer channel over Redis (no new port).

Keys, per run (``rankwatch:run:{run}``, ``app/agent/digest.py``):

``{p}:ask:{host}``   a list of the hub's requests to ``host``'s agent (``LPUSH``,
                     trimmed to ``QUEUE_MAX``, expiring after ``ASK_TTL_S``);
``{p}:answer:{id}``  the agent's answer to request ``id`` (``SET EX ANSWER_TTL_S``).

The agent pops at most ``MAX_ASKS`` requests in the pipeline it already
sends each tick (``Outbox.send``), so asking costs it no extra wake-up, and
answers them at once in one more round trip. A request is ``rank`` (that
rank's full row and chart history: ``RunState.rank``, as a dashboard on the
node would answer), ``node`` (every row of the node's ranks, when the page
opens a node) or ``ckpt`` (the node's checkpoint files:
``ckptindex.walk``, grouped by the hub with the same ``build_index``; asked
only when the digests' listing version changes, ``app/agent/listings.py``).
A ``ckpt`` request names the listing version the hub holds (``base``); an
agent that still holds that listing answers only what changed since
(``files`` added or changed, ``removed`` paths), one that does not, or a
request without a base, the whole listing (``base`` None). Either way the
answer names the version it brings the hub to (``version``).

Requests and answers are sealed like the flag (``digest.seal``), signed with
``RANKWATCH_REDIS_KEY`` when there is one and bound to the host and the
request's id, so an answer cannot be replayed for another request or host.
Whatever the hub reads is untrusted: an answer too big, unsigned, for
another request or malformed is refused and counted with the hostile
digests (``Hub.status``), and the hub waits on, at most ``timeout_s`` in all;
the caller then shows what the digests said.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from typing import Annotated, Literal, NotRequired

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from typing_extensions import TypedDict

from app.agent import digest as dg
from trainer_bridge.rundir import ckptindex, redisbus, safeio
from trainer_bridge.rundir.schema import Count, Host, Rank

log = logging.getLogger("rankwatch.agent")

MAX_REQUEST_BYTES = 2048
# An answer larger than this is refused unread; the agent says so instead of sending one.
MAX_ANSWER_BYTES = 4 * 1024 * 1024
# Files one node lists (more are left out, and the answer says so).
MAX_FILES = 10_000
MAX_HISTORY = 100_000
# Requests an agent answers per tick; more wait for the next tick.
MAX_ASKS = 8
# Listings an agent keeps by version, to answer a hub holding one of them with what changed since.
LISTING_HISTORY = 4
# Requests kept waiting per host: a hub asking a dead agent does not grow its list.
QUEUE_MAX = 32
ASK_TTL_S = 30
ANSWER_TTL_S = 30
# How often a waiting hub looks for the answers (only while a request waits).
POLL_S = 0.05

KINDS = ("rank", "ckpt", "node")
_STRICT = ConfigDict(strict=True, extra="forbid")
Text = Annotated[str, Field(max_length=4000)]
Num = Annotated[float, Field(allow_inf_nan=False)]


class Request(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    id: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    kind: Literal[KINDS]
    rank: Rank | None
    time: Num
    # ``ckpt``: the listing version the hub holds (None or absent: it wants the whole listing).
    base: NotRequired[dg.ListingVersion | None]


class Point(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    t: Num
    global_step: Count | None
    loss: Num | None
    step_time_ms: Num | None


class RankData(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    row: dg.Row
    history: Annotated[list[Point], Field(max_length=MAX_HISTORY)]


class FileEntry(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    path: Annotated[str, Field(min_length=1, max_length=4096)]
    format: Literal["ckpt", "safetensors", "mindir"] | None
    bytes: Count
    mtime: Num
    status: Literal["ok", "corrupt"]
    reason: Text | None
    epoch: Count | None
    step: Count | None
    global_step: Count | None
    step_source: Literal["contents", "name"] | None


class FilesData(TypedDict):
    """A node's checkpoint listing (``base`` None), or what changed in it since the listing ``base``."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]
    files: Annotated[list[FileEntry], Field(max_length=MAX_FILES)]  # all of them, or those added or changed
    errors: Annotated[list[Text], Field(max_length=50)]  # always all of them (a few lines)
    version: NotRequired[dg.ListingVersion | None]  # the listing's version once applied
    base: NotRequired[dg.ListingVersion | None]
    removed: NotRequired[Annotated[list[Annotated[str, Field(max_length=4096)]], Field(max_length=MAX_FILES)]]


class NodeData(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    rows: Annotated[list[dg.Row], Field(max_length=dg.MAX_HOST_RANKS)]


class Answer(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    id: str
    host: Host
    kind: Literal[KINDS]
    error: Text | None
    rank: RankData | None
    ckpt: FilesData | None
    node: NodeData | None


_REQUEST = TypeAdapter(Request)
_ANSWER = TypeAdapter(Answer)


def ask_key(run: str, host: str) -> str:
    return f"rankwatch:run:{run}:ask:{host}"


def answer_key(run: str, request_id: str) -> str:
    return f"rankwatch:run:{run}:answer:{request_id}"


# ---------------------------------------------------------------------- the agent's side
def serve(agent, raws: list[bytes], now: float) -> list[tuple[str, bytes]]:
    """The answers (key, sealed value) of this host's agent to the requests it popped."""
    out = []
    for raw in raws[:MAX_ASKS]:
        try:
            body = dg.unseal(raw, "ask", agent.host, agent.key, agent.run, MAX_REQUEST_BYTES)
            req = _REQUEST.validate_json(body)
        except (ValueError, ValidationError) as e:
            agent.asks_refused += 1
            if agent.asks_refused == 1:
                log.warning("rankwatch agent: refused a request in redis: %s", str(e)[:200])
            continue
        answer = {"id": req["id"], "host": agent.host, "kind": req["kind"], "error": None}
        answer |= dict.fromkeys(KINDS)
        try:
            if req["kind"] == "rank":
                answer["rank"] = agent.full_row(req["rank"], now)
                if answer["rank"] is None:
                    answer["error"] = f"rank {req['rank']} does not run on host {agent.host}"
            elif req["kind"] == "node":
                answer["node"] = agent.node_rows()
            else:
                answer["ckpt"] = agent.checkpoint_files(req.get("base"))
        except Exception as e:  # one request the agent cannot serve must not cost it its tick
            log.exception("rankwatch agent: cannot answer a %s request", req["kind"])
            answer |= dict.fromkeys(KINDS) | {"error": f"the agent failed: {e}"[:4000]}
        value = _seal_answer(answer, agent)
        if len(value) > MAX_ANSWER_BYTES:
            answer |= dict.fromkeys(KINDS) | {
                "error": f"the answer would be {len(value)} bytes (at most {MAX_ANSWER_BYTES})"
            }
            value = _seal_answer(answer, agent)
        out.append((answer_key(agent.run, req["id"]), value))
    return out


def _seal_answer(answer: dict, agent) -> bytes:
    return dg.seal(answer, "answer", f"{agent.host}/{answer['id']}", agent.key, agent.run)


def finite(value):
    """JSON has no NaN: a diverged loss in the chart history travels as None."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def file_listing(run_dir, cache) -> dict:
    """This node's checkpoint files as an agent answers them (``ckptindex.walk``)."""
    files, errors = ckptindex.walk(run_dir, cache)
    if len(files) > MAX_FILES:
        errors.append(f"{len(files)} checkpoint files on this node: only {MAX_FILES} listed")
    return {"files": [ckptindex.listing(f) for f in files[:MAX_FILES]], "errors": errors[:50]}


def files_answer(listing: dict, version: str | None, base: str | None, held: dict | None) -> dict:
    """The ``ckpt`` answer that brings a hub holding listing ``base`` (``held``, None if this agent
    no longer has it) to ``listing`` (of ``version``): what changed, or the whole listing when the
    hub holds none, the agent cannot tell what changed, or the change is no smaller."""
    if base is not None and held is not None:
        before = {e["path"]: e for e in held["files"]}
        changed = [e for e in listing["files"] if before.pop(e["path"], None) != e]
        # ``before`` now holds the paths gone since ``base``.
        if len(changed) + len(before) < len(listing["files"]):
            return {
                "files": changed,
                "errors": listing["errors"],
                "version": version,
                "base": base,
                "removed": list(before),
            }
    return {
        "files": listing["files"],
        "errors": listing["errors"],
        "version": version,
        "base": None,
        "removed": [],
    }


class ListingHistory:
    """An agent's last ``LISTING_HISTORY`` checkpoint listings by version, to answer with changes."""

    def __init__(self):
        self._by_version: dict[str, dict] = {}

    def keep(self, version: str, listing: dict) -> None:
        self._by_version.pop(version, None)
        self._by_version[version] = listing
        while len(self._by_version) > LISTING_HISTORY:
            del self._by_version[next(iter(self._by_version))]

    def get(self, version: str | None) -> dict | None:
        return None if version is None else self._by_version.get(version)


# ---------------------------------------------------------------------- the hub's side
class Pending(dict):
    """host -> (request id, kind, rank, monotonic time sent): requests posted, not yet answered."""


def post(
    hub, requests: dict[str, tuple[str, int | None]], pending: Pending, bases: dict[str, str] | None = None
) -> dict[str, str]:
    """Push ``requests`` (host -> (kind, rank)) to the agents and note them in ``pending``;
    ``bases``: host -> the listing version the hub holds, for ``ckpt`` requests.

    Returns host -> why it could not be asked (Redis away), for the hosts not posted.
    """
    if not requests:
        return {}
    sent = time.monotonic()
    now = time.time()
    ids = {host: uuid.uuid4().hex for host in requests}

    def push(client):
        pipe = client.pipeline(transaction=False)
        for host, (kind, rank) in requests.items():
            req = {"id": ids[host], "kind": kind, "rank": rank, "time": now}
            if kind == "ckpt":
                req["base"] = (bases or {}).get(host)
            key = ask_key(hub.run, host)
            pipe.lpush(key, dg.seal(req, "ask", host, hub.agent_key(host), hub.run))
            pipe.ltrim(key, 0, QUEUE_MAX - 1)
            pipe.expire(key, ASK_TTL_S)
        pipe.execute()

    try:
        hub._call(push)
    except redisbus.RedisUnavailable as e:
        return dict.fromkeys(requests, f"cannot ask the agent: {e}")
    for host, (kind, rank) in requests.items():
        pending[host] = (ids[host], kind, rank, sent)
    return {}


def collect(hub, pending: Pending) -> dict[str, dict | str]:
    """The answers arrived so far (one MGET, no wait): host -> data, or the agent's own error.

    Answered hosts leave ``pending``; a refused answer is counted on
    ``hub`` (``Hub.refuse``) and its request stays pending, for the real one.
    """
    if not pending:
        return {}
    hosts = list(pending)
    keys = [answer_key(hub.run, pending[h][0]) for h in hosts]
    try:
        values = hub._call(lambda client: client.mget(keys))
    except redisbus.RedisUnavailable as e:
        pending.clear()
        return {h: f"cannot read the agent's answer: {e}" for h in hosts}
    out: dict[str, dict | str] = {}
    read = []
    for host, key, value in zip(hosts, keys, values, strict=True):
        if value is None:
            continue
        read.append(key)
        request_id, kind, rank, _ = pending[host]
        try:
            out[host] = check(value, hub, host, request_id, (kind, rank))
            del pending[host]
        except ValueError as e:
            hub.refuse(f"an answer for host {host[:100]!r}: {e}")
    if read:
        try:
            hub._call(lambda client: client.delete(*read))
        except redisbus.RedisUnavailable:
            pass  # they expire
    return out


def overdue(hub, pending: Pending, timeout_s: float) -> dict[str, str]:
    """Drop (and count) the requests unanswered for ``timeout_s``: host -> why."""
    late = [h for h, (*_, sent) in pending.items() if time.monotonic() - sent >= timeout_s]
    for host in late:
        del pending[host]
    hub.ask_timeouts += len(late)
    return {h: f"the agent on host {h} did not answer within {timeout_s:g} s" for h in late}


def ask(hub, requests: dict[str, tuple[str, int | None]], timeout_s: float) -> dict[str, dict | str]:
    """Ask each host's agent ``(kind, rank)`` and wait; host -> the checked answer's data, or why none.

    Waits at most ``timeout_s`` in all, whatever Redis or the agents do.
    """
    pending = Pending()
    out: dict[str, dict | str] = post(hub, requests, pending)
    while pending:
        out.update(collect(hub, pending))
        if pending:
            left = min(pending.values(), key=lambda p: p[3])[3] + timeout_s - time.monotonic()
            if left <= 0:
                out.update(overdue(hub, pending, timeout_s))
                break
            time.sleep(min(POLL_S, left))
    return out


def check(value: bytes, hub, host: str, request_id: str, request: tuple[str, int | None]) -> dict | str:
    """The answer's data (a dict), or the agent's own error (a str); ValueError if refused."""
    body = dg.unseal(value, "answer", f"{host}/{request_id}", hub.agent_key(host), hub.run, MAX_ANSWER_BYTES)
    try:
        answer = _ANSWER.validate_json(body)
    except ValidationError as e:
        where = ".".join(map(str, e.errors()[0]["loc"])) if e.errors() else "?"
        raise ValueError(f"malformed (field {where})") from None
    kind, rank = request
    if answer["id"] != request_id or answer["host"] != host or answer["kind"] != kind:
        raise ValueError("it answers another request")
    if answer["error"] is not None:
        return f"the agent on host {host} answered: {answer['error']}"
    data = answer[kind]
    if data is None:
        raise ValueError("it holds neither data nor an error")
    if kind == "rank":
        row = data["row"]
        if row["rank"] != rank or row["host"] not in (host, None):
            raise ValueError(f"it holds rank {row['rank']} of host {str(row['host'])[:100]!r}")
    elif kind == "node":
        for row in data["rows"]:
            if row["host"] != host:
                raise ValueError(f"it holds rank {row['rank']} of host {str(row['host'])[:100]!r}")
    else:
        for path in [entry["path"] for entry in data["files"]] + data.get("removed", []):
            try:
                safeio.parts(path)
            except safeio.UnsafePath:
                raise ValueError(f"it lists a file outside the run directory: {path[:200]!r}") from None
    return data


def remote_files(
    listed: dict[str, tuple[list[ckptindex.CheckpointFile], list[str]]], owner: dict[int, str]
) -> tuple[list, list[str]]:
    """The checkpoint files the agents listed (host -> its files, ``from_listing``'s, and its
    errors), grouped for ``ckptindex.build_index``, and what went wrong: the whole merge, which
    ``app/agent/listings.py`` keeps up to date path by path with ``pick`` and ``placed``.

    Nodes that share a run directory list the same files: each path is kept
    once, from its rank's node when that node listed it.
    """
    holders: dict[str, list[str]] = {}
    errors: list[str] = []
    for host in sorted(listed):
        files, their_errors = listed[host]
        errors.extend(their_errors)
        for f in files:
            holders.setdefault(f.path, []).append(host)
    by_host = {host: {f.path: f for f in listed[host][0]} for host in listed}
    files = []
    for path, hosts in holders.items():
        host = hosts[0] if len(hosts) == 1 else pick(hosts, owner.get(by_host[hosts[0]][path].rank))
        files.append(placed(by_host[host][path], owner))
    return files, errors


def pick(hosts, runs_on: str | None) -> str:
    """Of the hosts that list one path, the one whose file counts: its rank's, else the first by name."""
    return runs_on if runs_on in hosts else min(hosts)


def placed(f: ckptindex.CheckpointFile, owner) -> ckptindex.CheckpointFile:
    """``f`` as the index shows it: a file counts towards its set only on the node its rank runs
    on; a copy elsewhere cannot be loaded by that rank, so it is listed as misplaced."""
    runs_on = owner.get(f.rank)
    if f.ok and runs_on is not None and runs_on != f.host:
        return ckptindex.from_listing(
            ckptindex.listing(f)
            | {
                "status": "misplaced",
                "reason": f"on host {f.host}, but rank {f.rank} runs on host {runs_on}",
            },
            f.host,
        )
    return f
