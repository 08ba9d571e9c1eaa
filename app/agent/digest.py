"""The host digest: what one agent says about its host once a second, and how a hub checks it.

Keys, per run (``rankwatch:run:{run}``; the run's name is the same on every
node, by default the run directory's base name):

``{p}:digests``  a stream, one entry per digest (``h`` host, ``d`` the
                 digest's JSON, ``s`` its signature with a key), trimmed
                 (``MAXLEN ~``) to about ``STREAM_MAXLEN`` entries;
``{p}:flag:{host}``  the stop flag as the hub's run directory holds it, for
                 that host's agent to write into its own (``flag_value``);
``{p}:resync:{host}``  when a hub last asked that host's agent for all its rows
                 (``resync_value``: signed with the host's key, as its flag);
``{p}:peers``    digests that carried a change, forwarded by the hub process
                 that read them to the other processes of its ``HUB_GROUP``
                 (``app/agent/hub.py``).

A digest carries its host's checkpoint-listing version (``ckpt``): a hash
of the listing the agent would answer (``app/agent/ask.py``), which
changes when a checkpoint file appears, changes or goes. The hub asks a
host for its listing only when that version changed, and then for what
changed since the version it holds (``app/agent/ask.py``), so at rest no
listing travels at all and a new set costs its files.

A digest's size does not grow with the ranks on the host: counts by
verdict, a few figures, and at most ``MAX_ROWS`` rows: those whose verdict,
state or stop stage changed, plus a few of a rolling full resynchronisation.
Everything in a digest is untrusted at the hub (whoever can write to Redis
can add an entry): ``parse`` refuses what is too big, malformed or badly
signed, before anything is allocated per rank.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Annotated, Any, Literal, NotRequired

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

# pydantic needs typing_extensions' TypedDict before Python 3.12.
from typing_extensions import TypedDict

from app.run.verdicts import VERDICTS
from trainer_bridge.rundir import redisbus
from trainer_bridge.rundir.schema import Count, Host, Millis, Pid, Rank, StopRecord, UnixTime, WorldSize

VERSION = 1
# A digest larger than this is refused unread (a real one of MAX_ROWS rows is far smaller).
MAX_DIGEST_BYTES = 256 * 1024
# Rows per digest: the changed ones first; more wait for the next digest.
MAX_ROWS = 64
# Ranks one host may claim (a 1024-rank host is no host of today's clusters).
MAX_HOST_RANKS = 1024
# Digests kept in the stream: at 1 Hz, a few seconds of a 12,500-host job.
STREAM_MAXLEN = 50_000
# Forwarded digests kept in the peers' stream: changes only, so far fewer than digests.
MAX_FORWARD = 5_000
RUN_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")

Text = Annotated[str, Field(max_length=500)]
Reason = Annotated[str, Field(max_length=4000)]
Short = Annotated[str, Field(max_length=100)]
Float = Annotated[float, Field(ge=-1e15, le=1e15)]
Loss = Annotated[float, Field(allow_inf_nan=False)]
# A checkpoint-listing version: hex, short (``listing_version`` makes 32 digits).
ListingVersion = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[0-9a-f]+$")]


# TypedDicts, not models: the validator hands out plain dicts, so a hub keeps
# no model objects per host and rows need no dump (both matter at 12,500 digests a second).
_STRICT = ConfigDict(strict=True, extra="forbid")  # a field nobody writes is refused


class Row(TypedDict):
    """A rank's row exactly as ``app.run.rows.make_row`` builds it (the fields of ``/api/ranks``)."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]
    rank: Rank
    health: Literal[VERDICTS]
    reason: Reason
    score: Float | None
    state: Short | None
    epoch: Count | None
    step: Count | None
    global_step: Count | None
    loss: Loss | None
    loss_nonfinite: Literal["nan", "inf", "-inf"] | None
    step_time_ms: Millis | None
    step_time_mean_ms: Millis | None
    samples_per_s: Annotated[float, Field(ge=0, le=1e12)] | None
    host: Host | None
    pid: Pid | None
    cpu_percent: Annotated[float, Field(ge=0, le=1e5)] | None
    rss_bytes: Count | None
    device: Short | None
    device_util_percent: Float | None
    device_mem_used_bytes: Count | None
    device_mem_total_bytes: Count | None
    device_temp_c: Float | None
    device_health: Short | None
    stop_stage: Short | None
    warnings: Annotated[list[Text], Field(max_length=10)]
    time: UnixTime | None
    last_step_at: UnixTime | None
    seq: Count | None
    source: Literal["bridge", "log"]
    clock_skew_s: Float | None
    launch: Short | None
    resumed_from: Text | None


ROW_FIELDS = tuple(Row.__annotations__)


class RankEntry(TypedDict):
    """One rank in a digest: its row, and what the stop service reads from its heartbeat."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]
    row: Row
    # schema.StopRecord, checked apart (stops are rare): a plain dict here.
    stop: NotRequired[dict | None]
    started_at: NotRequired[UnixTime | None]
    sync_every: NotRequired[Annotated[int, Field(ge=1, le=10**6)] | None]


class Slowest(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    rank: Rank
    step_time_ms: Millis


class Digest(TypedDict):
    """One host's digest (see the module's docstring)."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]
    v: Literal[VERSION]
    run: Short
    host: Host
    agent: Short  # host:pid:tag of the agent process
    boot: UnixTime  # when the agent started: (boot, seq) orders its digests across restarts
    seq: Count
    time: UnixTime
    attempt: UnixTime | None  # when this host's ranks started: a relaunch is a new attempt
    world_size: WorldSize | None
    ranks: tuple[Rank, Rank] | None  # lowest and highest rank on the host
    n: Annotated[int, Field(ge=0, le=MAX_HOST_RANKS)]
    counts: dict[Literal[VERDICTS], Annotated[int, Field(ge=0, le=MAX_HOST_RANKS)]]
    global_step: tuple[Count, Count, Count] | None  # min, median, max
    step_time_ms: tuple[Millis, Millis] | None  # median, max
    slowest: Slowest | None
    stalest: Rank | None
    last_step_at: UnixTime | None
    samples_per_s: Annotated[float, Field(ge=0, le=1e15)] | None
    stop_stages: dict[Short, Annotated[int, Field(ge=0, le=MAX_HOST_RANKS)]]
    flag: NotRequired[Annotated[float, Field(ge=0)] | None]  # the hub flag's version this agent applied
    # Why the agent refused the hub's flag value it read last (unsigned, stale, older, out of
    # bounds: issue 32, P4), None once a good one comes: the page says so.
    flag_problem: NotRequired[Annotated[str, Field(max_length=300)] | None]
    # The version of the host's checkpoint listing (None: not listed yet); the hub asks for the
    # listing only when it changes (``HubSource.checkpoint_files``).
    ckpt: NotRequired[ListingVersion | None]
    rows: Annotated[list[RankEntry], Field(max_length=MAX_ROWS)]
    # The ranks of ``rows`` sent because their verdict, state or stop stage changed (not the
    # rolling resynchronisation's): the hub processes of one group forward only such digests.
    changed: NotRequired[Annotated[list[Rank], Field(max_length=MAX_ROWS)]]


_DIGEST = TypeAdapter(Digest)
_STOP = TypeAdapter(StopRecord)
_ENTRY = TypeAdapter(RankEntry)


def entry_problem(entry: dict) -> str | None:
    """Why a hub would refuse this rank entry (the agent leaves such a row out), or None."""
    try:
        _ENTRY.validate_json(json.dumps(entry, allow_nan=False))
    except (ValidationError, ValueError) as e:
        errors = e.errors() if isinstance(e, ValidationError) else []
        return ".".join(map(str, errors[0]["loc"])) if errors else str(e)
    return None


class Refused(ValueError):
    """A digest the hub will not use; the message says why (never its content)."""


def keys(run: str) -> tuple[str, str, str]:
    """(digest stream, flag prefix, resync prefix) keys of ``run``; each host's are ``flag_key`` and ``resync_key``."""
    prefix = f"rankwatch:run:{run}"
    return f"{prefix}:digests", f"{prefix}:flag", f"{prefix}:resync"


def flag_key(run: str, host: str) -> str:
    """Where the hub puts the flag for ``host``'s agent: one per host, each signed with that host's
    key (issue 32, P7), so that no agent can sign the flag another host applies."""
    return f"{keys(run)[1]}:{host}"


def resync_key(run: str, host: str) -> str:
    """Where the hub asks ``host``'s agent for all its rows; signed for that host only, as its flag."""
    return f"{keys(run)[2]}:{host}"


def resync_value(key: bytes | None, run: str, at: float) -> bytes:
    """A ``resync_key`` value: the hub's request of ``at`` (its clock), signed with the host's key."""
    return seal({"at": at}, "resync", "hub", key, run)


def open_resync(value: bytes, key: bytes | None, run: str) -> float:
    """When the hub made the request ``value``; ValueError if unsigned, badly signed or malformed.

    Whoever can write to Redis could otherwise make every agent send all its rows every tick.
    """
    inner: Any = json.loads(unseal(value, "resync", "hub", key, run, 1024))
    if not (isinstance(inner, dict) and _number(inner.get("at"))):
        raise ValueError("a malformed resync value")
    return float(inner["at"])


def peers_key(run: str) -> str:
    """The stream where the hub processes of one group forward the digests that carried a change."""
    return f"rankwatch:run:{run}:peers"


def listing_version(listing: dict) -> str:
    """The ``ckpt`` version of a checkpoint listing (``ask.file_listing``): any change, a new one."""
    body = json.dumps(listing, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def check_run(name: str) -> str:
    """``name`` if it can name a run in Redis; ValueError otherwise."""
    if not RUN_NAME.fullmatch(name or ""):
        raise ValueError(f"a run name is 1 to 128 letters, digits, '.', '_' or '-', not {name!r}")
    return name


def encode(digest: dict, key: bytes | None) -> dict[str, bytes]:
    """A digest as a stream entry's fields, signed when there is a key: with its host's own key,
    derived from ``key`` if it is the master, or ``key`` if handed to that host (``redisbus.own_key``)."""
    body = json.dumps(digest, separators=(",", ":"), allow_nan=False).encode()
    fields = {"h": digest["host"].encode(), "d": body}
    own = redisbus.own_key(key, redisbus.agent_label(digest["host"]))
    if own is not None:
        fields["s"] = redisbus.signature(own, "digest", digest["run"], digest["host"], body)
    return fields


def parse(fields: dict, run: str, keys: redisbus.Verifier) -> Digest:
    """The digest of a stream entry, checked with its host's own key (``keys``); Refused says why not."""
    host, body = fields.get(b"h"), fields.get(b"d")
    if not isinstance(host, bytes) or not isinstance(body, bytes):
        raise Refused("an entry without a host or a digest")
    if len(body) > MAX_DIGEST_BYTES or len(host) > 253:
        raise Refused(f"a digest of {len(body)} bytes (at most {MAX_DIGEST_BYTES})")
    name = host.decode(errors="replace")
    if not redisbus.signed(keys.key(redisbus.agent_label(name)), "digest", run, name, body, fields.get(b"s")):
        raise Refused(
            f"a digest for host {name[:100]!r}, {'badly signed' if fields.get(b's') else 'unsigned'}"
        )
    try:
        digest = _DIGEST.validate_json(body)
        for entry in digest["rows"]:
            if entry.get("stop") is not None:
                entry["stop"] = _STOP.validate_python(entry["stop"]).to_dict()
    except ValidationError as e:
        where = ".".join(map(str, e.errors()[0]["loc"])) if e.errors() else "?"
        raise Refused(f"a malformed digest for host {name[:100]!r} (field {where})") from None
    if digest["host"] != name or digest["run"] != run:
        raise Refused(
            f"a digest whose entry names host {name[:100]!r} but whose body names another host or run"
        )
    low, high = digest["ranks"] or (0, -1)
    if digest["ranks"] is not None and (high < low or high - low >= MAX_HOST_RANKS):
        raise Refused(f"a digest for host {name[:100]!r} claiming ranks {low} to {high}")
    for entry in digest["rows"]:
        row = entry["row"]
        if not low <= row["rank"] <= high or (row["host"] is not None and row["host"] != name):
            raise Refused(
                f"a digest for host {name[:100]!r} with a row of rank {row['rank']} "
                f"(host {str(row['host'])[:100]!r}) outside its ranks"
            )
    return digest


def seal(value: Any, purpose: str, name: str, key: bytes | None, run: str) -> bytes:
    """``value`` as JSON in a ``{"body", "sig"}`` envelope, signed with ``key`` for ``purpose`` and ``name``.

    The flag, the hub's requests and the agents' answers (``app/agent/ask.py``) travel so.
    """
    body = json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
    sig = redisbus.signature(key, purpose, run, name, body).decode() if key is not None else ""
    return json.dumps({"body": body.decode(), "sig": sig}, separators=(",", ":")).encode()


def unseal(value: bytes, purpose: str, name: str, key: bytes | None, run: str, max_bytes: int) -> bytes:
    """The body (JSON bytes, unchecked) of a ``seal`` envelope; ValueError if too big, malformed or unsigned."""
    if len(value) > max_bytes:
        raise ValueError(f"a {purpose} value of {len(value)} bytes (at most {max_bytes})")
    try:
        outer = json.loads(value)
    except RecursionError:  # nesting deep enough to overflow the parser is no envelope
        raise ValueError(f"a malformed {purpose} value") from None
    if not isinstance(outer, dict) or not isinstance(outer.get("body"), str):
        raise ValueError(f"a malformed {purpose} value")
    body = outer["body"].encode()
    if not redisbus.signed(key, purpose, run, name, body, outer.get("sig") or None):
        raise ValueError(f"an unsigned or badly signed {purpose} value")
    return body


# How far the hub's publication time (``at``) may be from an agent's clock, either way (issue 32, P4).
# The hub publishes its flag every tick, so a genuine value is never older than a tick or two: an
# older one is a replay (or the clocks are apart, which the agent then says). The flag's version (its
# file's mtime on the hub) may not be ahead of the agent's clock by more either: a version of 1e300
# would make every later stop "older".
FLAG_FRESH_S = 60.0


def flag_value(
    raw: bytes, version: float, key: bytes | None, run: str, *, request_id: str | None, at: float
) -> bytes:
    """The ``{p}:flag`` value: the flag file's bytes, its version, the request it is and when the hub
    published it, signed with a key."""
    body = {"flag": raw.decode(), "version": version, "request_id": request_id, "at": at}
    return seal(body, "flag", "hub", key, run)


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def open_flag(
    value: bytes, key: bytes | None, run: str, now: float
) -> tuple[bytes, float, float, str | None]:
    """(flag file bytes, version, publication time, request id) of a ``{p}:flag`` value, as of ``now``.

    ValueError if unsigned, bad or malformed, published more than ``FLAG_FRESH_S`` from ``now`` either way, or with a version out of bounds.
    """
    inner: Any = json.loads(unseal(value, "flag", "hub", key, run, 4 * 65536))
    if not (
        isinstance(inner, dict)
        and isinstance(inner.get("flag"), str)
        and _number(inner.get("version"))
        and _number(inner.get("at"))
        and (inner.get("request_id") is None or isinstance(inner.get("request_id"), str))
    ):
        raise ValueError("a malformed flag value")
    version, at = float(inner["version"]), float(inner["at"])
    if not 0 <= version <= now + FLAG_FRESH_S:
        raise ValueError(f"a flag version out of bounds ({version:.6g}, this host's clock is {now:.0f})")
    if abs(now - at) > FLAG_FRESH_S:
        raise ValueError(
            f"a flag published {now - at:.0f} s from this host's clock (at most {FLAG_FRESH_S:g}): "
            "a replayed value, or the hub's and this host's clocks are apart"
        )
    return inner["flag"].encode(), version, at, inner["request_id"]
