"""Redis as the heartbeat transport for very large jobs (opt-in: ``RANKWATCH_REDIS_URL``).

At thousands of ranks, heartbeat files cost the shared file system what it
handles worst: every rank renames a file each second and the dashboard stats
all of them twice a second. With ``RANKWATCH_REDIS_URL`` set on both sides,
each rank also publishes its heartbeat to Redis and the dashboard reads only
the new ones, in batches, instead of scanning files. The run directory stays
the source of truth for the stop flag and the checkpoints, and heartbeat
files are still written (less often) for a restarted dashboard and for
forensics.

Keys, per job (``rankwatch:{job}``):

``{p}:beats``   a stream, one entry per heartbeat (``r`` rank, ``hb`` the
                heartbeat's JSON, validated by the reader like a file),
                trimmed to about ``STREAM_PER_RANK`` entries per rank;
``{p}:latest``  a hash, rank -> its newest heartbeat, for a dashboard that
                starts, restarts or fell behind the stream's trimming;
``{p}:leader``  which dashboard process leads (``Leader``, app/cluster.py).

**Signatures** (``RANKWATCH_REDIS_KEY``, optional, the same on both sides):
whoever can write to Redis could otherwise publish any rank's heartbeat,
for instance one with a higher ``seq``, after which the real ones are
ignored. With a key, the bridge signs every heartbeat it publishes
(HMAC-SHA256 over the job, the rank and the exact bytes published; the
stream entry's ``s`` field, the hash's ``{rank}:s`` field) and the
dashboard drops the unsigned and the badly signed ones, counts them and
says so once in its log and on the page (``Subscriber.refused``).

``job`` is ``RANKWATCH_REDIS_JOB`` when set (nodes that mount the run
directory at different paths must set the same one), else a digest of the
run directory's real path. Nothing here imports mindspore.

Redis down never blocks or stops training: every call has a short socket
timeout, a failure is reported once and retried at most every
``RETRY_S`` seconds, and the bridge then writes heartbeat files at the full
rate again.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time

REDIS_URL_ENV = "RANKWATCH_REDIS_URL"
REDIS_JOB_ENV = "RANKWATCH_REDIS_JOB"
REDIS_KEY_ENV = "RANKWATCH_REDIS_KEY"
# Heartbeats kept in the stream per rank: a dashboard may fall this many
# heartbeats behind (seconds, at 1 Hz) before it resynchronises from the hash.
STREAM_PER_RANK = 8
STREAM_MIN = 10_000
# A call to Redis waits at most this long (the bridge calls from its reporter
# thread, never from the training step, but a stuck call would still delay
# the flag poll).
SOCKET_TIMEOUT_S = 0.5
# After a failure, try again at most this often.
RETRY_S = 5.0

log = logging.getLogger("trainer_bridge")


class RedisUnavailable(RuntimeError):
    """Redis could not be reached or answered with an error; the message says which."""


def job_key(run_dir: str | os.PathLike) -> str:
    """The job's name in Redis: ``RANKWATCH_REDIS_JOB``, else a digest of the run directory's path."""
    explicit = os.environ.get(REDIS_JOB_ENV, "").strip()
    if explicit:
        return explicit
    return hashlib.sha1(os.path.realpath(run_dir).encode()).hexdigest()[:16]


def env_key() -> bytes | None:
    """``RANKWATCH_REDIS_KEY`` as bytes, or None when unset or blank."""
    raw = os.environ.get(REDIS_KEY_ENV, "").strip()
    return raw.encode() if raw else None


def signature(key: bytes, purpose: str, job: str, name: str, data: bytes) -> bytes:
    """HMAC-SHA256 (hex) of ``data``, bound to what it is for, the job and a name (a rank).

    The binding keeps a signed message valid only where it was published:
    rank 3's heartbeat cannot be replayed as rank 5's, nor one job's as another's.
    """
    head = f"rankwatch/{purpose}\0{job}\0{name}\0".encode()
    # hmac.digest: OpenSSL's one-shot HMAC, the same bytes as hmac.new's at a fraction of the cost.
    return hmac.digest(key, head + data, "sha256").hex().encode()


def signed(key: bytes | None, purpose: str, job: str, name: str, data: bytes, sig) -> bool:
    """Whether ``sig`` is ``data``'s signature (True without a key: nothing is checked)."""
    if key is None:
        return True
    if not isinstance(sig, bytes | str):
        return False
    sig = sig.encode() if isinstance(sig, str) else sig
    return hmac.compare_digest(sig, signature(key, purpose, job, name, data))


def keys(job: str) -> tuple[str, str, str]:
    """(stream, latest hash, leader lock) keys of ``job``."""
    prefix = f"rankwatch:{job}"
    return f"{prefix}:beats", f"{prefix}:latest", f"{prefix}:leader"


def connect(url: str):
    """A client with short timeouts; redis-py is imported only by those who opt in."""
    import redis

    return redis.Redis.from_url(
        url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S, retry_on_timeout=False
    )


class Guarded:
    """One Redis connection that fails softly: after an error, calls are skipped for ``RETRY_S``."""

    def __init__(self, url: str, job: str, clock=time.monotonic):
        self.url = url
        self.job = job
        self.stream, self.latest, self.leader = keys(job)
        self._clock = clock
        self._client = None
        self._down_until = 0.0
        self.error: str | None = None

    def _call(self, fn):
        """Run ``fn(client)``; RedisUnavailable (with the reason) if Redis is down or erred."""
        import redis

        if self._clock() < self._down_until:
            raise RedisUnavailable(self.error or "redis unavailable")
        try:
            if self._client is None:
                self._client = connect(self.url)
            result = fn(self._client)
        except (redis.RedisError, OSError) as e:
            first = self.error is None
            self.error = f"redis at {_safe_url(self.url)} unreachable: {e}"
            self._down_until = self._clock() + RETRY_S
            self._client = None
            if first:
                log.warning("rankwatch: %s (retrying every %g s)", self.error, RETRY_S)
            raise RedisUnavailable(self.error) from None
        if self.error is not None:
            log.warning("rankwatch: redis at %s is back", _safe_url(self.url))
            self.error = None
        return result

    def close(self) -> None:
        """Drop the connection; safe to call twice."""
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a dead connection must not raise at exit
                pass


class Publisher(Guarded):
    """The bridge's side: publish one rank's heartbeats."""

    def __init__(self, url: str, job: str, world_size: int, key: bytes | None = None, **kw):
        super().__init__(url, job, **kw)
        self.maxlen = max(STREAM_MIN, STREAM_PER_RANK * world_size)
        self.key = key

    def publish(self, rank: int, heartbeat_json: bytes) -> bool:
        """Add the heartbeat to the stream and the hash in one round trip; False if Redis is down."""

        entry: dict = {"r": rank, "hb": heartbeat_json}
        latest: dict = {str(rank): heartbeat_json}
        if self.key is not None:
            sig = signature(self.key, "hb", self.job, str(rank), heartbeat_json)
            entry["s"] = latest[f"{rank}:s"] = sig

        def send(client):
            pipe = client.pipeline(transaction=False)
            pipe.xadd(self.stream, entry, maxlen=self.maxlen, approximate=True)
            # One HSET: the heartbeat and its signature change together.
            pipe.hset(self.latest, mapping=latest)
            pipe.execute()

        try:
            self._call(send)
        except RedisUnavailable:
            return False
        return True


class Subscriber(Guarded):
    """The dashboard's side: every rank's newest heartbeat, then only what is new.

    ``poll()`` returns ``(rank, heartbeat bytes)`` pairs in arrival order.
    The first call (and any call after the stream was trimmed past what this
    reader had seen, or after Redis came back) returns the hash's newest
    heartbeat of every rank instead: a resynchronisation. Raises
    RedisUnavailable when Redis cannot be reached.

    With ``key``, heartbeats without a valid signature are left out:
    ``refused`` counts them and ``refused_last`` says which was the last.
    """

    def __init__(self, url: str, job: str, batch: int = 20_000, key: bytes | None = None, **kw):
        super().__init__(url, job, **kw)
        self.batch = batch
        self.key = key
        self.refused = 0
        self.refused_last: str | None = None
        self._last_id: bytes | None = None

    def _checked(self, rank: int, data: bytes, sig, where: str) -> bool:
        if signed(self.key, "hb", self.job, str(rank), data, sig):
            return True
        self.refused += 1
        self.refused_last = f"rank {rank}'s heartbeat in the {where}, {'badly signed' if sig else 'unsigned'}"
        if self.refused == 1:
            log.warning(
                "rankwatch: refused %s (%s is set): is something else writing to redis at %s?",
                self.refused_last,
                REDIS_KEY_ENV,
                _safe_url(self.url),
            )
        return False

    def poll(self) -> list[tuple[int, bytes]]:
        try:
            if self._last_id is None:
                return self._call(self._resync)
            out, gap = self._call(self._read_new)
            if gap:
                return self._call(self._resync)
            return out
        except RedisUnavailable:
            self._last_id = None  # after an outage, start from the hash again
            raise

    def _resync(self, client) -> list[tuple[int, bytes]]:
        # The stream position first: entries after it may repeat what the
        # hash holds, which the reader drops as the same heartbeat (seq).
        newest = client.xrevrange(self.stream, count=1)
        self._last_id = newest[0][0] if newest else b"0-0"
        latest = client.hgetall(self.latest)
        out = []
        for key, value in latest.items():
            rank = _rank(key)
            if rank is not None and self._checked(rank, value, latest.get(key + b":s"), "hash"):
                out.append((rank, value))
        out.sort()
        return out

    def _read_new(self, client) -> tuple[list[tuple[int, bytes]], bool]:
        import redis

        try:
            first = client.xinfo_stream(self.stream).get("first-entry")
        except redis.ResponseError:  # no stream yet: nobody has published
            first = None
        # The stream keeps STREAM_PER_RANK heartbeats per rank, far more than a
        # tick brings; its oldest entry being newer than the last one read
        # means this reader fell behind the trimming: take the hash instead.
        if first is not None and _stream_id(first[0]) > _stream_id(self._last_id):
            return [], True
        out: list[tuple[int, bytes]] = []
        while True:
            got = client.xread({self.stream: self._last_id}, count=self.batch)
            entries = got[0][1] if got else []
            for entry_id, fields in entries:
                rank = _rank(fields.get(b"r"))
                data = fields.get(b"hb")
                if (
                    rank is not None
                    and data is not None
                    and self._checked(rank, data, fields.get(b"s"), "stream")
                ):
                    out.append((rank, data))
                self._last_id = entry_id
            if len(entries) < self.batch or len(out) >= 4 * self.batch:
                return out, False


def _stream_id(raw: bytes) -> tuple[int, int]:
    ms, _, seq = raw.partition(b"-")
    return int(ms), int(seq or 0)


def _rank(raw) -> int | None:
    try:
        rank = int(raw)
    except (TypeError, ValueError):
        return None
    return rank if rank >= 0 else None


def _safe_url(url: str) -> str:
    """The URL without its password, for logs and the page."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url
