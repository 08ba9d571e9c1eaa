"""Several dashboard processes behind one Redis (opt-in: ``REDIS_URL``).

Each process serves its own pages and JSON API. The Redis that carries the
heartbeats (``trainer_bridge/rundir/redisbus.py``) is also Flask-SocketIO's message
queue: an event one process emits reaches the pages connected to every
process (``RedisQueue``, on the channel ``rankwatch:{job}:socketio``).

Exactly one process, the leader, does what must happen once per job: push
the rank deltas and the stop lifecycle, record a completed stop and re-arm
the flag, raise alerts and run the stop policy. Leadership is a lock in
Redis (``Leader``: ``SET key token NX PX ttl`` on
``rankwatch:{job}:leader``): the leader renews it every watcher tick; when
it dies, its key expires after ``LEADER_TTL_S`` and the next follower to
try takes it over.

Redis down: nobody can be elected, so each process keeps the role it had
(a dashboard started while Redis is down follows until Redis answers),
and, since nothing is relayed, every process pushes its own view to its own
pages (``Cluster.relaying``). The stop never depends on Redis: the flag file
in the run directory is written by whichever process got the POST, and the
run status says Redis is unreachable until it is back. When the lock's key
is gone after an outage (a restarted Redis keeps nothing) the old leader
takes it again at once, unless another process was quicker.

**What the queue trusts.** python-socketio before 5.14 unpickled whatever
was published on the channel: one ``PUBLISH`` ran code in every dashboard.
``QueueCodec`` is the queue's only decoder, whatever the library's version:
the standard library's JSON, and only objects. With ``REDIS_KEY`` it also
signs every message (HMAC-SHA256 with a timestamp) and drops the unsigned,
the badly signed and those older than ``QUEUE_MAX_AGE_S`` (counted, logged
once, in ``/api/health``): nobody without the key can forge a page's
events or close its rooms through Redis. The key that signs them is the
dashboards' own, derived from the master key (``redisbus.own_key``): the
keys handed to ranks and agents cannot sign a ``stop_status`` or a
``close_room`` (issue 32, P7).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any, NoReturn

import socketio

from trainer_bridge.rundir import redisbus

log = logging.getLogger(__name__)

# After the queue's subscription fails, try again this often (python-socketio's
# own pause doubles up to 60 s, during which a follower's pages would hear
# nothing after Redis returned).
LISTEN_RETRY_S = 1.0
# A signed queue message older (or newer) than this is refused: a replay, or
# a dashboard whose clock is that far off.
QUEUE_MAX_AGE_S = 60.0


def channel(job: str) -> str:
    """The Socket.IO message queue's pub/sub channel of ``job``."""
    return f"rankwatch:{job}:socketio"


def redis_key(config: Mapping[str, Any]) -> bytes | None:
    """``REDIS_KEY`` as bytes, or None: what signs the heartbeats, the digests and the message queue."""
    return config["REDIS_KEY"].encode() if config["REDIS_KEY"] else None


def redis_subscriber(config: Mapping[str, Any], run_dir: str | None) -> redisbus.Subscriber | None:
    """The Redis heartbeat reader when ``REDIS_URL`` is set (trainer_bridge/rundir/redisbus.py), else None."""
    if not config["REDIS_URL"] or not run_dir:
        return None
    job = config["REDIS_JOB"] or redisbus.job_key(run_dir)
    return redisbus.Subscriber(config["REDIS_URL"], job, key=redis_key(config))


class QueueCodec:
    """The queue's serialiser (a ``json``-like module for python-socketio): JSON, signed with a key.

    ``loads`` raises ValueError for anything it refuses, which the library
    skips; it never unpickles.
    """

    def __init__(self, job: str, key: bytes | None, clock=time.time):
        self.job = job
        # The dashboards' own key, derived from the master: a rank's or an agent's handed key
        # cannot sign what only a dashboard may say (issue 32, P7).
        self.key = redisbus.own_key(key, redisbus.DASHBOARD)
        self.clock = clock
        self.refused = 0
        self.refused_last: str | None = None

    def dumps(self, data, **kwargs) -> str:
        body = json.dumps(data, separators=(",", ":"))
        if self.key is None:
            return body
        at = f"{self.clock():.3f}"
        sig = redisbus.signature(self.key, "queue", self.job, at, body.encode()).decode()
        return json.dumps({"rankwatch": at, "sig": sig, "body": body}, separators=(",", ":"))

    def loads(self, raw, **kwargs) -> dict:
        try:
            data = json.loads(raw)  # bytes that are not UTF-8 (a pickle) are a ValueError too
        except ValueError:
            self._refuse("a message that is not JSON")
        if self.key is not None:
            data = self._open(data)
        if not isinstance(data, dict):
            self._refuse("a message that is not a JSON object")
        return data

    def _open(self, envelope) -> dict:
        if not isinstance(envelope, dict) or set(envelope) != {"rankwatch", "sig", "body"}:
            self._refuse("an unsigned message")
        at, sig, body = envelope["rankwatch"], envelope["sig"], envelope["body"]
        if not (isinstance(at, str) and isinstance(body, str)):
            self._refuse("a malformed signed message")
        if not redisbus.signed(self.key, "queue", self.job, at, body.encode(), sig):
            self._refuse("a badly signed message")
        try:
            age = abs(self.clock() - float(at))
        except ValueError:
            age = float("inf")
        if not age <= QUEUE_MAX_AGE_S:
            self._refuse(f"a signed message {age:.0f} s off this host's clock (a replay?)")
        return json.loads(body)

    def _refuse(self, what: str) -> NoReturn:
        self.refused += 1
        self.refused_last = what
        if self.refused == 1:
            log.warning(
                "socket.io relay refused %s on %s%s: is something else publishing to redis?",
                what,
                channel(self.job),
                " (REDIS_KEY is set)" if self.key else "",
            )
        raise ValueError(what)


class RedisQueue(socketio.RedisManager):
    """python-socketio's Redis manager with short connect timeouts and ``QueueCodec``; says whether it listens.

    ``listening`` is True while the relay subscription is up, so that the
    watcher knows whether the leader's pushes reach this process's pages.
    """

    def __init__(self, url: str, job: str, key: bytes | None = None):
        self.codec = QueueCodec(job, key)
        super().__init__(
            url,
            channel=channel(job),
            json=self.codec,
            # No socket_timeout: the subscription blocks on its read between messages.
            redis_options={
                "socket_connect_timeout": redisbus.SOCKET_TIMEOUT_S,
                "socket_keepalive": True,
            },
        )
        self.listening = False

    # python-socketio swaps in the server's JSON module when it attaches the
    # manager (BaseManager.set_server); the queue keeps its own codec.
    @property
    def json(self):
        return self.codec

    @json.setter
    def json(self, value):
        pass

    def _listen(self):
        # Decoded here, so that the library only ever sees dicts: whatever
        # its version, it then has nothing to unpickle.
        for message in super()._listen():
            try:
                yield self.codec.loads(message)
            except ValueError:
                continue

    @property
    def started(self) -> bool:
        """Whether the relay runs: python-socketio starts it when the first page connects."""
        return getattr(self, "thread", None) is not None

    def _redis_listen_with_retries(self):  # replaces the library's, for the pause and `listening`
        while True:
            try:
                self._redis_connect()
                self.pubsub.subscribe(self.channel)
                if not self.listening:
                    log.info("socket.io relay subscribed to %s", self.channel)
                self.listening = True
                yield from self.pubsub.listen()
            except Exception as e:  # whatever the client raises, the relay must keep trying
                if self.listening:
                    log.warning("socket.io relay lost Redis (%s); retrying every %g s", e, LISTEN_RETRY_S)
                self.listening = False
                time.sleep(LISTEN_RETRY_S)


class Cluster:
    """The message queue and the leader lock of one dashboard process."""

    def __init__(self, url: str, job: str, ttl_s: float, key: bytes | None = None):
        self.url = url
        self.job = job
        self.queue = RedisQueue(url, job, key)
        self.lock = Leader(url, job, ttl_s, key)
        self.leader = False
        self.changed_at = time.time()  # when this process's role last changed

    @classmethod
    def from_config(cls, config, run_dir: str | None) -> Cluster | None:
        if not config["REDIS_URL"] or not run_dir:
            return None
        if config["LEADER_TTL_S"] < 2 * config["TICK_S"]:
            raise ValueError(
                f"LEADER_TTL_S ({config['LEADER_TTL_S']}) must be at least two ticks (TICK_S "
                f"{config['TICK_S']}): the leader renews its lock once a tick"
            )
        job = config["REDIS_JOB"] or redisbus.job_key(run_dir)
        return cls(config["REDIS_URL"], job, config["LEADER_TTL_S"], redis_key(config))

    @property
    def reachable(self) -> bool:
        return self.lock.error is None

    def step(self) -> bool:
        """Renew or take the leader lock (every tick); whether this process leads now."""
        leads = self.lock.step()
        if leads != self.leader:
            self.leader, self.changed_at = leads, time.time()
            log.warning("rankwatch: this dashboard (%s) %s", self.lock.token, "leads" if leads else "follows")
        return leads

    def release(self) -> None:
        """Hand the lead over at once (a clean shutdown) rather than after the lock's TTL."""
        self.leader = False
        self.lock.release()

    def relaying(self) -> bool:
        """Whether the leader's pushes reach this process's pages (or it has none to reach)."""
        return self.reachable and (self.queue.listening or not self.queue.started)

    def status(self) -> dict:
        """This process's part, for ``GET /api/health``."""
        return {
            "role": "leader" if self.leader else "follower",
            "id": self.lock.token,
            "leader": self.lock.holder(),
            "since": self.changed_at,
            "redis": {
                "url": self.lock.where,
                "reachable": self.reachable,
                "error": self.lock.error,
                "relay": self.queue.listening,
                "signed": self.queue.codec.key is not None,
                "refused": {"queue": self.queue.codec.refused, "queue_last": self.queue.codec.refused_last},
            },
        }


# With a key, a leader lock signed longer ago than its TTL and this (for
# clocks that differ between hosts) was not renewed by its holder.
LOCK_SKEW_S = 30.0


class Leader(redisbus.Guarded):
    """A dashboard process's claim on ``{p}:leader``: ``SET NX PX``, renewed every tick.

    ``step()`` renews the lock when this process holds it and tries to take
    it otherwise, and returns whether this process leads. While Redis is
    unreachable nobody can be elected, so ``step()`` keeps the role it had.
    The lock's value names the holder (``token``): host, pid and a random
    tag; with ``key``, followed by when it was last renewed and a redisbus.signature
    of both, made anew at every renewal.

    **Stale locks.** A dashboard always sets the lock with a TTL of
    ``ttl_s`` and renews it every tick, so a lock that has no TTL, or more
    than ``ttl_s`` left, was not set by a live dashboard of this job (whoever
    can write to Redis could otherwise hold the lead for ever): it is deleted
    and taken over. With ``key``, so is a lock whose value is not redisbus.signed, or
    was redisbus.signed more than ``ttl_s + LOCK_SKEW_S`` ago (a copied value, renewed
    by someone without the key). Every dashboard of a job must therefore use
    the same ``LEADER_TTL_S``.
    """

    # Compare-and-set and compare-and-delete: only the holder's own value is renewed or released.
    _RENEW = (
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1 end return 0"
    )
    _DELETE_IF = (
        "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
    )

    def __init__(self, url: str, job: str, ttl_s: float, key: bytes | None = None, clock=time.time, **kw):
        super().__init__(url, job, **kw)
        self.ttl_s = ttl_s
        self.key = redisbus.own_key(key, redisbus.DASHBOARD)
        self.wall = clock
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.value: str | None = None  # what this process last wrote, while it leads
        self.leads = False
        self.where = redisbus.safe_url(url)
        self.taken_over: str | None = None  # the last stale lock this process replaced, and why

    def _new_value(self) -> str:
        if self.key is None:
            return self.token
        at = f"{self.wall():.0f}"
        return f"{self.token} {at} {redisbus.signature(self.key, 'leader', self.job, at, self.token.encode()).decode()}"

    def _stale(self, client) -> None:
        """Delete the lock if no live dashboard of this job can have set it (see the class)."""
        pipe = client.pipeline()  # one transaction: the TTL is the value's
        pipe.get(self.leader)
        pipe.pttl(self.leader)
        raw, pttl = pipe.execute()
        if raw is None:
            return
        why = None
        if pttl == -1:
            why = "it has no TTL"
        elif pttl > self.ttl_s * 1000:
            why = f"its TTL ({pttl / 1000:.0f} s) is longer than LEADER_TTL_S ({self.ttl_s:g} s)"
        elif self.key is not None:
            parts = raw.split(b" ")
            at = parts[1].decode(errors="replace") if len(parts) == 3 else ""
            if not (
                len(parts) == 3 and redisbus.signed(self.key, "leader", self.job, at, parts[0], parts[2])
            ):
                why = f"it is not signed with {redisbus.REDIS_KEY_ENV}"
            elif not abs(self.wall() - float(at)) <= self.ttl_s + LOCK_SKEW_S:
                why = f"it was signed {self.wall() - float(at):.0f} s ago, not renewed by its holder"
        if why and client.eval(self._DELETE_IF, 1, self.leader, raw):
            self.taken_over = f"{raw.partition(b' ')[0].decode(errors='replace')[:100]!r}: {why}"
            log.warning("rankwatch: took over the leader lock %s", self.taken_over)

    def step(self) -> bool:
        ttl_ms = int(self.ttl_s * 1000)

        def renew_or_take(client) -> bool:
            value = self._new_value()
            if self.leads and self.value is not None:
                if client.eval(self._RENEW, 1, self.leader, self.value, value, ttl_ms):
                    self.value = value
                    return True
                # Expired (a stall longer than the TTL) or Redis restarted empty: try again.
            if not client.set(self.leader, value, nx=True, px=ttl_ms):
                self._stale(client)
                if not client.set(self.leader, value, nx=True, px=ttl_ms):
                    return False
            self.value = value
            return True

        try:
            self.leads = self._call(renew_or_take)
        except redisbus.RedisUnavailable:
            pass
        return self.leads

    def holder(self) -> str | None:
        """The token of the process that holds the lock now (None if nobody, or Redis is down)."""
        try:
            raw = self._call(lambda client: client.get(self.leader))
        except redisbus.RedisUnavailable:
            return None
        return raw.partition(b" ")[0].decode(errors="replace") if raw else None

    def release(self) -> None:
        """Give the lock up (a clean shutdown), so that a follower need not wait for it to expire."""
        if not self.leads:
            return
        self.leads = False
        value, self.value = self.value, None
        if value is None:
            return
        try:
            self._call(lambda client: client.eval(self._DELETE_IF, 1, self.leader, value))
        except redisbus.RedisUnavailable:
            pass
