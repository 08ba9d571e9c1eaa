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

**Keys per role** (issue 32, P7). The dashboard alone holds the master
key. Every other process holds a key derived from it for its own role and
identity (``derive``), written as a *handed key*
``rk1:<label>:<64 hex>`` (``hand_out``): ``rank:<job>:<rank>`` for a
rank, ``agent:<host>`` for an agent; the dashboards' own queue and lock use
``dashboard``. A handed key signs only for its label (``own_key``): rank 0's
key cannot sign rank 1's heartbeat, an agent's cannot sign another host's
digests, and neither can sign what only a dashboard may say (the message
queue: ``stop_status``, ``close_room``; the hub's flag). The verifier derives
the sender's key from the master (``Verifier``). A master key given to a
trainer still works (it derives its rank's key) but separates nothing: that
was the only setup before P7. The bridge takes its key from
``RANKWATCH_REDIS_KEY`` or from the file ``RANKWATCH_REDIS_KEY_FILE`` names,
where ``{rank}`` stands for its rank (one 0600 file per rank,
``rankwatch redis-keys``).

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
REDIS_KEY_FILE_ENV = "RANKWATCH_REDIS_KEY_FILE"
# A handed key: the version tag, the label (role and identity) and the derived key in hex.
HANDED = "rk1"
DASHBOARD = "dashboard"
# A key file is a line; anything longer is not one (bounded read of an untrusted path).
MAX_KEY_BYTES = 4096
# Keys a verifier keeps derived (one per rank or host seen); past it, it derives each time.
MAX_CACHED_KEYS = 100_000
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


def env_key(rank: int | None = None) -> bytes | None:
    """``RANKWATCH_REDIS_KEY``, else the file ``RANKWATCH_REDIS_KEY_FILE`` names (``{rank}`` replaced
    by ``rank``), as bytes; None when neither is set. OSError or ValueError for a file that cannot be read."""
    raw = os.environ.get(REDIS_KEY_ENV, "").strip()
    if raw:
        return raw.encode()
    path = os.environ.get(REDIS_KEY_FILE_ENV, "").strip()
    if not path:
        return None
    if "{rank}" in path:
        if rank is None:
            raise ValueError(f"{REDIS_KEY_FILE_ENV} names a file per rank ({{rank}}), but no rank is known")
        path = path.replace("{rank}", str(rank))
    return read_key_file(path)


def read_key_file(path: str) -> bytes:
    """The key in ``path``: one line, at most ``MAX_KEY_BYTES``; never follows a symlink, never blocks."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        import stat

        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        data = os.read(fd, MAX_KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_BYTES or not data.strip():
        raise ValueError(f"{path} holds no key (empty, or longer than {MAX_KEY_BYTES} bytes)")
    return data.strip()


def rank_label(job: str, rank: int) -> str:
    return f"rank:{job}:{rank}"


def agent_label(host: str) -> str:
    return f"agent:{host}"


def launch_label(job: str) -> str:
    """The label every node's ``rankwatch launch`` of ``job`` signs its records with (app/supervise/board.py)."""
    return f"launch:{job}"


def derive(master: bytes, label: str) -> bytes:
    """The key of ``label`` (a role and an identity), derived from the master key (hex, as bytes)."""
    return hmac.digest(master, b"rankwatch/role-key\0" + label.encode(), "sha256").hex().encode()


def hand_out(master: bytes, label: str) -> str:
    """What a process of ``label`` is given: ``rk1:<label>:<key>``, naming what it may sign for."""
    return f"{HANDED}:{label}:{derive(master, label).decode()}"


def parse_handed(raw: bytes) -> tuple[str, bytes] | None:
    """(label, key) of a handed key; None for a master key. ValueError for a malformed handed key."""
    if not raw.startswith(HANDED.encode() + b":"):
        return None
    label, sep, key = raw[len(HANDED) + 1 :].rpartition(b":")
    if not sep or not label or len(key) != 64 or not all(c in b"0123456789abcdef" for c in key):
        raise ValueError(f"a malformed {REDIS_KEY_ENV} (it starts with {HANDED}: but is no handed key)")
    return label.decode(errors="replace"), key


def own_key(raw: bytes | None, label: str) -> bytes | None:
    """The key that signs for ``label``: derived from a master key, or the handed key of that label.

    ValueError for a handed key of another label: a process may sign only for itself.
    """
    if raw is None:
        return None
    handed = parse_handed(raw)
    if handed is None:
        return derive(raw, label)
    if handed[0] != label:
        raise ValueError(
            f"the {REDIS_KEY_ENV} given is {handed[0]!r}'s, not {label!r}'s: it signs only for its own"
        )
    return handed[1]


class Verifier:
    """The verifying side (a dashboard, with the master key): each sender's key, derived once."""

    def __init__(self, master: bytes | None):
        if master is not None and parse_handed(master) is not None:
            raise ValueError(
                f"{REDIS_KEY_ENV} of a dashboard must be the master key, not a handed {HANDED}: key"
            )
        self.master = master
        self._cache: dict[str, bytes] = {}

    def key(self, label: str) -> bytes | None:
        if self.master is None:
            return None
        key = self._cache.get(label)
        if key is None:
            key = derive(self.master, label)
            if len(self._cache) < MAX_CACHED_KEYS:
                self._cache[label] = key
        return key


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
            self.error = f"redis at {safe_url(self.url)} unreachable: {e}"
            self._down_until = self._clock() + RETRY_S
            self._client = None
            if first:
                log.warning("rankwatch: %s (retrying every %g s)", self.error, RETRY_S)
            raise RedisUnavailable(self.error) from None
        if self.error is not None:
            log.warning("rankwatch: redis at %s is back", safe_url(self.url))
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
        self.key = key  # the master or a handed key; each rank signs with its own (own_key)
        self._own: dict[int, bytes | None] = {}

    def rank_key(self, rank: int) -> bytes | None:
        """The key that signs ``rank``'s heartbeats; ValueError if ``key`` is another rank's."""
        if rank not in self._own:
            self._own[rank] = own_key(self.key, rank_label(self.job, rank))
        return self._own[rank]

    def publish(self, rank: int, heartbeat_json: bytes) -> bool:
        """Add the heartbeat to the stream and the hash in one round trip; False if Redis is down."""

        entry: dict = {"r": rank, "hb": heartbeat_json}
        latest: dict = {str(rank): heartbeat_json}
        key = self.rank_key(rank)
        if key is not None:
            sig = signature(key, "hb", self.job, str(rank), heartbeat_json)
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

    With ``key`` (the master), heartbeats without a valid signature by
    their own rank's key are left out: ``refused`` counts them and
    ``refused_last`` says which was the last.
    """

    def __init__(self, url: str, job: str, batch: int = 20_000, key: bytes | None = None, **kw):
        super().__init__(url, job, **kw)
        self.batch = batch
        self.key = key
        self.keys = Verifier(key)
        self.refused = 0
        self.refused_last: str | None = None
        self._last_id: bytes | None = None

    def _checked(self, rank: int, data: bytes, sig, where: str) -> bool:
        if signed(self.keys.key(rank_label(self.job, rank)), "hb", self.job, str(rank), data, sig):
            return True
        self.refused += 1
        self.refused_last = f"rank {rank}'s heartbeat in the {where}, {'badly signed' if sig else 'unsigned'}"
        if self.refused == 1:
            log.warning(
                "rankwatch: refused %s (%s is set): is something else writing to redis at %s?",
                self.refused_last,
                REDIS_KEY_ENV,
                safe_url(self.url),
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
    # A rank is a 31-bit number: anything else is not one (and would grow the verifier's key cache).
    return rank if 0 <= rank < 1 << 31 else None


def safe_url(url: str) -> str:
    """The URL without its password, for logs and the page."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url
