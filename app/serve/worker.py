"""The server's gunicorn worker: deadlines, connection caps and reserved threads.

**Timeouts (slowloris).** gunicorn's threaded worker hands a connection to a
thread as soon as its first bytes arrive, and the thread then blocks reading
the rest of the request head; a client that sends a header line every few
seconds holds a thread for ever, and a few dozen of them starve every
page. ``Worker`` reads each request head in the main loop's poller instead,
without a thread, and closes a connection whose head is not complete within
``HEADER_TIMEOUT_S`` (the connections that send nothing go the same way).
Only a complete request (its body too, below) reaches a thread, which then
writes the answer under a socket timeout of ``READ_TIMEOUT_S``; a WebSocket keeps
that timeout, which Engine.IO's ping every 25 s keeps from firing while the
page is alive. TLS is not offered (terminate it in a reverse proxy, see the
README's security section), so the head is plain bytes.

**Hostile connections (issue 19, item 8).** Three more bounds, chosen by
measurement (README, "Production server"):

* *Bodies* are read in the poller too, like heads: a request reaches a
  thread only once its whole body (``Content-Length``, at most
  ``MAX_BODY_BYTES``) is in memory. A body not complete within
  ``BODY_TIMEOUT_S`` is answered 408 and dropped; a chunked body gets a
  411, a too large one a 413, before any thread sees them.
* *Per address*: once half of ``MAX_CONNECTIONS`` are open, an address
  that holds ``MAX_CONNS_PER_ADDR`` gets no more (answered 503 and
  closed), so that one address cannot fill the server.
* *Reserved threads*: ``RESERVED_THREADS`` threads serve only requests
  that carry the operator token (``Authorization: Bearer``) and
  ``/api/health``, so the stop and the health check answer when tokenless
  clients (idle WebSockets, long polls) hold every one of the
  ``SERVER_THREADS``. WebSockets may take all of those but
  ``KEEP_FOR_REQUESTS`` (half, with few threads); past that an upgrade is
  answered 503 and the page falls back to long-polling.

Closing a connection never waits in the main loop: gunicorn's graceful close
(half-close, then drain for up to 2 s) happens in the poller.

**A graceful stop (SIGTERM)** lets the requests in flight finish, for up to
gunicorn's ``graceful_timeout``. An open page's WebSocket never finishes, so
it is shut down at once (the page says it lost the dashboard and reconnects
when one is back), and so is a kept-alive connection that has not sent a
byte of its next request: the process does not wait for either.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import selectors
import socket
import time
from collections import Counter
from concurrent import futures
from functools import partial

from gunicorn.workers.gthread import TConn, ThreadWorker

from app.serve.httpwire import CONTINUE, MAX_HEAD_BYTES, RECV_BYTES, TOO_LARGE, Head, answer

log = logging.getLogger(__name__)

# Paths any client may reach on the reserved threads: they answer at once.
RESERVED_PATHS = frozenset({"/api/health"})
# General threads that WebSockets (one per open page, held while it is open) leave to requests.
KEEP_FOR_REQUESTS = 8
# How long a closed connection may drain what its client still sends.
LINGER_S = 2.0


class Conn(TConn):
    """gunicorn's connection, which tells the worker when it closes, and closes without blocking."""

    def __init__(self, worker: Worker, *args):
        super().__init__(*args)
        self.worker = worker
        self.addr = self.client[0] if isinstance(self.client, tuple) else "local"
        self.head: bytearray | None = None  # the request arriving, head then body
        self.parsed: Head | None = None
        self.websocket = False
        self.counted = True

    def close(self, graceful=False):
        if self.counted:
            self.counted = False
            self.worker.closed(self)
        if graceful:
            self.worker.linger(self.sock)
        else:
            super().close()


class Worker(ThreadWorker):
    """gunicorn's threaded worker, with deadlines on heads and bodies, per-address caps and reserved threads.

    Overrides the points where a connection enters or leaves the thread
    pool: ``accept`` (the per-address cap), ``enqueue_req`` (every new
    connection and every kept-alive one that becomes readable passes there:
    its request is read in the poller), ``handle_request`` (a thread starts
    serving a complete request) and ``finish_request``; ``murder_keepalived``,
    called once per loop turn, also ends the heads and bodies that ran out of time.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.app.flask_app.config
        self.header_timeout_s = config["HEADER_TIMEOUT_S"]
        self.body_timeout_s = config["BODY_TIMEOUT_S"]
        self.read_timeout_s = config["READ_TIMEOUT_S"]
        self.max_body = config["MAX_BODY_BYTES"]
        self.max_per_addr = config["MAX_CONNS_PER_ADDR"]
        self.reserved_threads = config["RESERVED_THREADS"]
        self.max_websockets = max(self.cfg.threads // 2, self.cfg.threads - KEEP_FOR_REQUESTS)
        self.token = config["TOKEN"].encode()
        # Connections whose head (or body) is still arriving, oldest first: every
        # one in a dict has the same timeout, so insertion order is deadline order.
        self.heads: dict[Conn, float] = {}
        self.bodies: dict[Conn, float] = {}
        self.lingering: dict[socket.socket, float] = {}
        self.per_addr: Counter[str] = Counter()
        self.websockets: set[Conn] = set()  # handed to a thread, upgraded: held until the page goes
        self.refused: Counter[str] = Counter()  # why connections were refused, for the log

    def init_process(self):
        self.reserved = futures.ThreadPoolExecutor(self.reserved_threads, thread_name_prefix="reserved")
        super().init_process()

    def run(self):
        # gunicorn made its poller in init_process, and nothing is registered in it yet.
        self.poller.close()
        self.poller = Poller()
        super().run()

    def handle_exit(self, sig, frame):
        super().handle_exit(sig, frame)
        # In the signal handler: shutdown() is one system call, and the WebSocket's reader thread
        # then reads its end, its handler returns, and the stop no longer waits for it.
        for conn in list(self.websockets):
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        # The idle connections are in the poller: closed on the main loop's thread, which this wakes
        # (SimpleQueue.put, under defer, may be called from a signal handler).
        self.method_queue.defer(self._close_idle)

    def _close_idle(self) -> None:
        """At a graceful stop: close the connections that have not sent a byte of a next request.

        gunicorn would keep them open for 2 s, for a request that may be on its way; we are
        stopping, and a browser sends an idempotent request again on a fresh connection.
        """
        super().murder_keepalived(force=True)  # gunicorn's kept-alive ones alone: not our heads and bodies
        for conn in list(self.heads):
            if conn.head is not None and not conn.head:
                self._drop(conn)

    def handle_quit(self, sig, frame):
        self.reserved.shutdown(wait=False)
        super().handle_quit(sig, frame)

    # -- accepting ------------------------------------------------------------

    def accept(self, listener):
        try:
            sock, client = listener.accept()
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        addr = client[0] if isinstance(client, tuple) else "local"
        # Only when busy: behind a proxy every client shares one address, which is harmless until then.
        if self.per_addr[addr] >= self.max_per_addr and self.nr_conns >= self.worker_connections // 2:
            self._refuse_socket(
                sock,
                answer(503, "Service Unavailable", f"too many connections from {addr} (MAX_CONNS_PER_ADDR)"),
                "per-address",
            )
            return
        self.nr_conns += 1
        self.per_addr[addr] += 1
        sock.setblocking(True)
        self.enqueue_req(Conn(self, self.cfg, sock, client, listener.getsockname()))

    def closed(self, conn: Conn) -> None:
        """``conn`` is closing: it no longer counts against its address."""
        self.per_addr[conn.addr] -= 1
        if self.per_addr[conn.addr] <= 0:
            del self.per_addr[conn.addr]

    # -- reading a request without a thread --------------------------------------

    def enqueue_req(self, conn):
        # A pipelined request may already be read ahead: it goes through the same checks.
        ahead = conn.parser.unreader.take_buffered() if conn.initialized else b""
        conn.head = bytearray(ahead)
        conn.parsed = None
        self.heads[conn] = time.monotonic() + self.header_timeout_s
        conn.sock.setblocking(False)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_data, conn))
        if ahead:
            self._advance(conn)

    def _on_data(self, conn, sock):
        data = _recv(sock)
        if data is None:
            return
        if not data:  # the client went away
            self._drop(conn)
            return
        if conn.head is None:  # refused: drain until the client closes or the deadline
            return
        conn.head += data
        self._advance(conn)

    def _advance(self, conn) -> None:
        """Route the request once its head is in; hand it to a thread once its body is too."""
        if conn.parsed is None:
            parsed = Head.parse(conn.head)
            if parsed is None:
                if len(conn.head) > MAX_HEAD_BYTES:
                    self._refuse(conn, TOO_LARGE, "head too large")
                return
            conn.parsed = parsed
            if parsed.chunked:
                self._refuse(
                    conn,
                    answer(411, "Length Required", "send the body with a Content-Length, not chunked"),
                    "chunked",
                )
                return
            if parsed.length is not None and parsed.length > self.max_body:
                self._refuse(
                    conn,
                    answer(413, "Content Too Large", f"the body is larger than {self.max_body} bytes"),
                    "body too large",
                )
                return
            if parsed.websocket and len(self.websockets) >= self.max_websockets:
                self._refuse(
                    conn,
                    answer(503, "Service Unavailable", "too many WebSockets open: use long-polling"),
                    "websockets",
                )
                return
            if parsed.length and len(conn.head) < parsed.size + parsed.length:
                # The body's own deadline, from the end of the head.
                del self.heads[conn]
                self.bodies[conn] = time.monotonic() + self.body_timeout_s
                if parsed.expect_continue:
                    try:
                        conn.sock.send(CONTINUE)
                    except OSError:
                        pass
        if len(conn.head) < conn.parsed.size + (conn.parsed.length or 0):
            return
        self._hand_over(conn)

    def _hand_over(self, conn) -> None:
        self.poller.unregister(conn.sock)
        self.heads.pop(conn, None)
        self.bodies.pop(conn, None)
        parsed = conn.parsed
        conn.init()  # the parser (once per connection); sets the socket blocking
        conn.sock.setblocking(True)
        conn.parser.unreader.unread(bytes(conn.head))
        conn.head = conn.parsed = None
        if parsed.websocket:
            conn.websocket = True
            self.websockets.add(conn)
        pool = self.reserved if self._privileged(parsed) else self.tpool
        fs = pool.submit(self.handle, conn)
        fs.add_done_callback(lambda fut: self.method_queue.defer(self.finish_request, conn, fut))

    def _privileged(self, head: Head) -> bool:
        """Whether a request may use the reserved threads: ``/api/health``, or the operator token."""
        if head.websocket:
            return False
        if head.path in RESERVED_PATHS:
            return True
        # The app checks the token again (and counts failures); here it only routes.
        return head.bearer is not None and hmac.compare_digest(head.bearer, self.token)

    def _refuse(self, conn, reply: bytes, why: str) -> None:
        """Answer ``reply``, then drain until the client closes or the deadline.

        Closing at once with unread input would reset the connection and lose the answer.
        """
        conn.head = None
        self._count_refusal(why)
        try:
            conn.sock.send(reply)
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._drop(conn)

    def _refuse_socket(self, sock, reply: bytes, why: str) -> None:
        self._count_refusal(why)
        try:
            sock.setblocking(False)
            sock.send(reply)
        except OSError:
            pass
        self.linger(sock)

    def _count_refusal(self, why: str) -> None:
        self.refused[why] += 1
        if self.refused[why] == 1:
            log.warning("rankwatch: refusing connections (%s); counted from now on", why)

    def _drop(self, conn):
        self.heads.pop(conn, None)
        self.bodies.pop(conn, None)
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        self.nr_conns -= 1
        conn.close()

    # -- closing without waiting ---------------------------------------------------

    def linger(self, sock) -> None:
        """Close ``sock`` after its client stops sending, or after LINGER_S, in the poller."""
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.setblocking(False)
            self.poller.register(sock, selectors.EVENT_READ, self._on_linger)
        except (OSError, ValueError, KeyError):
            sock.close()
            return
        self.lingering[sock] = time.monotonic() + LINGER_S

    def _on_linger(self, sock):
        if _recv(sock) == b"":
            self._unlinger(sock)

    def _unlinger(self, sock):
        self.lingering.pop(sock, None)
        try:
            self.poller.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass
        sock.close()

    # -- deadlines -------------------------------------------------------------------

    def murder_keepalived(self, force=False):
        super().murder_keepalived(force)
        now = time.monotonic()
        for conn, deadline in list(self.heads.items()):
            if not force and deadline > now:
                break
            self._drop(conn)
        late = answer(
            408, "Request Timeout", f"the request body did not arrive within {self.body_timeout_s:g} s"
        )
        for conn, deadline in list(self.bodies.items()):
            if not force and deadline > now:
                break
            if conn.head is not None and not force:
                self._count_refusal("slow body")
                try:
                    conn.sock.send(late)
                except OSError:
                    pass
            self._drop(conn)
        for sock, deadline in list(self.lingering.items()):
            if not force and deadline > now:
                break
            self._unlinger(sock)

    def finish_request(self, conn, fs):
        if conn.websocket:
            conn.websocket = False
            self.websockets.discard(conn)
            # Closed here, never kept alive nor lingered in the poller: simple-websocket's reader
            # thread closes this same socket object when it ends, which may be after its handler
            # has returned, and a socket closed while in the poller leaves its descriptor's number
            # registered there (the poller, below, survives that; the close handshake is done).
            self.nr_conns -= 1
            conn.close()
            return
        super().finish_request(conn, fs)

    def handle_request(self, req, conn):
        # Bounds the answer's writes and a WebSocket's silence (the body is already in memory).
        conn.sock.settimeout(self.read_timeout_s)
        return super().handle_request(req, conn)


def _recv(sock) -> bytes | None:
    """What a readable socket holds: ``b""`` once its client is gone, None when nothing is there after all."""
    try:
        return sock.recv(RECV_BYTES)
    except BlockingIOError:
        return None
    except OSError:
        return b""


class Poller(selectors.DefaultSelector):
    """The worker's poller, which outlives a socket closed behind its back.

    When a thread closes a socket that is still registered, the kernel frees its number and the
    next ``accept`` may get it back; registering that new socket then raised ``KeyError: ... is
    already registered`` in the main loop, which killed the worker and every open page's session
    with it (seen once, a page reloaded while its WebSocket was being closed). A closed socket can
    never be readable again, so its stale entry is dropped and the new socket takes the number.
    """

    def register(self, fileobj, events, data=None):
        try:
            return super().register(fileobj, events, data)
        except KeyError:
            stale = self.get_map().get(fileobj.fileno())
            if stale is None or stale.fileobj is fileobj or _is_open(stale.fileobj):
                raise
            log.info("rankwatch: forgot a closed socket still in the poller (descriptor %d)", stale.fd)
            self.unregister(stale.fileobj)  # found by identity; epoll dropped it at the close
            return super().register(fileobj, events, data)


def _is_open(fileobj) -> bool:
    try:
        return fileobj.fileno() >= 0
    except (OSError, ValueError):
        return False
