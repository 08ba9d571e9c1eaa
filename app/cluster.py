"""Several dashboard processes behind one Redis (opt-in: ``REDIS_URL``).

Each process serves its own pages and JSON API. The Redis that carries the
heartbeats (``trainer_bridge/redisbus.py``) is also Flask-SocketIO's message
queue: an event one process emits reaches the pages connected to every
process (``RedisQueue``, on the channel ``rankwatch:{job}:socketio``).

Exactly one process, the leader, does what must happen once per job: push
the rank deltas and the stop lifecycle, record a completed stop and re-arm
the flag, raise alerts and run the stop policy. Leadership is redis-py's
lock (``redisbus.Leader``: ``SET key token NX PX ttl`` on
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
"""

from __future__ import annotations

import logging
import time

import socketio

from trainer_bridge import redisbus

log = logging.getLogger(__name__)

# After the queue's subscription fails, try again this often (python-socketio's
# own pause doubles up to 60 s, during which a follower's pages would hear
# nothing after Redis returned).
LISTEN_RETRY_S = 1.0


def channel(job: str) -> str:
    """The Socket.IO message queue's pub/sub channel of ``job``."""
    return f"rankwatch:{job}:socketio"


class RedisQueue(socketio.RedisManager):
    """python-socketio's Redis manager with short connect timeouts; says whether it listens.

    ``listening`` is True while the relay subscription is up, so that the
    watcher knows whether the leader's pushes reach this process's pages.
    """

    def __init__(self, url: str, job: str):
        super().__init__(
            url,
            channel=channel(job),
            # No socket_timeout: the subscription blocks on its read between messages.
            redis_options={
                "socket_connect_timeout": redisbus.SOCKET_TIMEOUT_S,
                "socket_keepalive": True,
            },
        )
        self.listening = False

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

    def __init__(self, url: str, job: str, ttl_s: float):
        self.url = url
        self.job = job
        self.queue = RedisQueue(url, job)
        self.lock = redisbus.Leader(url, job, ttl_s)
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
        return cls(config["REDIS_URL"], job, config["LEADER_TTL_S"])

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
            },
        }
