"""Where the supervisors of several nodes meet: the run directory they share, or Redis.

``nodes.Nodes`` (the protocol: end records, node 0's plan, its lease) reads
and writes named JSON records through a board and never knows which one:

* ``FileBoard``: one file per record in ``RUN/rankwatch/nodes/``, written
  atomically. The default: the nodes already share the run directory.
* ``RedisBoard``: with ``RANKWATCH_REDIS_URL`` set for ``rankwatch launch``,
  one hash per job, ``rankwatch:{job}:nodes`` (field = the record's name,
  ``{name}:s`` its signature). ``job`` is the heartbeats' job name
  (``RANKWATCH_REDIS_JOB``, else a digest of the run directory's path;
  ``trainer_bridge.rundir.redisbus.job_key``), so nodes that mount the run
  directory at different paths set ``RANKWATCH_REDIS_JOB``. A shared file
  system that is slow to show one node's small write to another (NFS's
  attribute cache) no longer delays the other nodes' reaction to a failure.

Both answer alike when the medium fails: a write raises ``OSError`` (the
caller says so and goes on), a read gives nothing. Both treat what they read
as untrusted: at most ``MAX_RECORD`` bytes and ``MAX_NAMES`` names are read,
a record that is not a JSON object is skipped.

**Signatures.** Anyone who can write to Redis could otherwise write node 0's
plan (it may set only Rankwatch's own variables, ``nodes._carried``, but the
resume step is one). With a key, every record is signed (HMAC-SHA256 bound to
the job and the record's name, ``redisbus.signature``) with the key of the
label ``launch:{job}``, which every node's supervisor holds, and records
without a valid signature are ignored. The key is ``RANKWATCH_LAUNCH_KEY_FILE``
(a file holding the master key or the handed key ``rankwatch redis-keys
--launch`` writes), else ``RANKWATCH_REDIS_KEY`` / ``RANKWATCH_REDIS_KEY_FILE``
when that is the master key or that handed key. A key that cannot sign for the
label (a rank's, an agent's, a file per rank) is refused at the start, with
the reason: a launch that cannot sign would be ignored by its peers.
"""

from __future__ import annotations

import json
import os
import time
from typing import Protocol

from trainer_bridge.rundir import redisbus, runfiles, safedirs, schema

NODES_DIR = f"{runfiles.STATE_DIR}/nodes"
MAX_RECORD = runfiles.MAX_FILE_BYTES
MAX_NAMES = 4 * schema.MAX_RANKS  # bounded scans: a board of a million junk names costs this many
MAX_NAME = 64  # the protocol's names are short (``end_{N}_{k}.json``); longer ones are not its
LAUNCH_KEY_FILE_ENV = "RANKWATCH_LAUNCH_KEY_FILE"
# The hash lives this long past its last write: a run's records outlive any pause between attempts
# (node 0's plan, its backoff), and a run abandoned in Redis does not stay there for ever.
TTL_S = 7 * 24 * 3600
PURPOSE = "nodes"
# After a failed call, reads give nothing for this long without trying: the attempt loop polls the board
# every 0.2 s and must not spend its connect timeout there each time. Writes always try.
READ_RETRY_S = 2.0


class Board(Protocol):
    where: str

    def put(self, name: str, body: dict) -> None: ...

    def get(self, name: str) -> dict | None: ...

    def names(self) -> list[str]: ...

    def read(self, names: list[str]) -> dict[str, dict]: ...

    def drop(self, names: list[str]) -> None: ...


def for_run(run_dir: str) -> Board:
    """The board of ``rankwatch launch``'s environment; ValueError (the reason) for an unusable key."""
    url = os.environ.get(redisbus.REDIS_URL_ENV, "").strip()
    if not url:
        return FileBoard(run_dir)
    job = redisbus.job_key(run_dir)
    return RedisBoard(url, job, launch_key(job))


def launch_key(job: str) -> bytes | None:
    """The key that signs the nodes' records of ``job`` (see the module's docstring); None without one."""
    path = os.environ.get(LAUNCH_KEY_FILE_ENV, "").strip()
    try:
        raw = redisbus.read_key_file(path) if path else redisbus.env_key()
        return redisbus.own_key(raw, redisbus.launch_label(job))
    except (OSError, ValueError) as e:
        raise ValueError(
            f"with {redisbus.REDIS_URL_ENV} the nodes' supervisors meet in Redis and sign what they write "
            f"there, but their key is unusable ({e}); give rankwatch launch {LAUNCH_KEY_FILE_ENV}: the "
            "master key's file, or the launch key `rankwatch redis-keys --launch` writes"
        ) from None


def _parse(data) -> dict | None:
    if not isinstance(data, bytes | str) or len(data) > MAX_RECORD:
        return None
    try:
        got = json.loads(data)
    except ValueError:
        return None
    return got if isinstance(got, dict) else None


class FileBoard:
    """One file per record in ``RUN/rankwatch/nodes/`` (the nodes share the run directory)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.folder = runfiles.state_dir(run_dir) / "nodes"
        self.where = f"the run directory ({self.folder})"

    def put(self, name: str, body: dict) -> None:
        safedirs.makedirs(self.run_dir, NODES_DIR)
        runfiles.atomic_write_json(self.folder / name, body, root=self.run_dir)

    def get(self, name: str) -> dict | None:
        got = runfiles.read_json_or_none(self.folder / name)  # regular files only, at most 64 KiB
        return got if isinstance(got, dict) else None

    def names(self) -> list[str]:
        try:
            entries, _ = safedirs.scan_regular(self.folder, MAX_NAMES)
        except OSError:
            return []
        return [e.name for e in entries if len(e.name) <= MAX_NAME]

    def read(self, names: list[str]) -> dict[str, dict]:
        out = {}
        for name in names:
            got = self.get(name)
            if got is not None:
                out[name] = got
        return out

    def drop(self, names: list[str]) -> None:
        for name in names:
            try:
                os.unlink(self.folder / name)
            except OSError:
                pass


# Reads bounded on the server's side: a field past the limit comes back as nil, never as its bytes.
_READ = """
local out = {}
for i, name in ipairs(ARGV) do
  if i > 1 then
    local body, sig = false, false
    if redis.call('HSTRLEN', KEYS[1], name) <= tonumber(ARGV[1]) then
      body = redis.call('HGET', KEYS[1], name)
      if redis.call('HSTRLEN', KEYS[1], name .. ':s') <= 128 then
        sig = redis.call('HGET', KEYS[1], name .. ':s')
      end
    end
    table.insert(out, body)
    table.insert(out, sig)
  end
end
return out
"""
_NAMES = """
local out = {}
for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
  if #out >= tonumber(ARGV[1]) then break end
  if #name <= tonumber(ARGV[2]) and string.sub(name, -2) ~= ':s' then table.insert(out, name) end
end
return out
"""


class BoardUnavailable(OSError):
    """Redis could not be reached or erred (an ``OSError``, as a file board's write would raise)."""


class RedisBoard:
    """One hash per job in Redis; see the module's docstring."""

    def __init__(self, url: str, job: str, key: bytes | None = None):
        self.url = url
        self.job = job
        self.key = key
        self.hash = f"rankwatch:{job}:nodes"
        self.where = f"Redis at {redisbus.safe_url(url)} ({self.hash})"
        self._client = None
        self._down_until = 0.0

    def _call(self, fn, read: bool = False):
        import redis

        if read and time.monotonic() < self._down_until:
            raise BoardUnavailable(f"{self.where} unreachable")
        try:
            if self._client is None:
                self._client = redisbus.connect(self.url)
            got = fn(self._client)
        except (redis.RedisError, OSError) as e:
            self._client = None  # a fresh connection at the next call
            self._down_until = time.monotonic() + READ_RETRY_S
            raise BoardUnavailable(f"{self.where} unreachable: {e}") from None
        self._down_until = 0.0  # back (a write got through): reads try again at once
        return got

    def put(self, name: str, body: dict) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        fields = {name: data}
        if self.key is not None:
            fields[f"{name}:s"] = redisbus.signature(self.key, PURPOSE, self.job, name, data)

        def send(client):
            pipe = client.pipeline(transaction=True)
            pipe.hset(self.hash, mapping=fields)
            pipe.expire(self.hash, TTL_S)
            pipe.execute()

        self._call(send)

    def get(self, name: str) -> dict | None:
        return self.read([name]).get(name)

    def names(self) -> list[str]:
        try:
            got = self._call(lambda c: c.eval(_NAMES, 1, self.hash, MAX_NAMES, MAX_NAME), read=True)
        except BoardUnavailable:
            return []
        return [n.decode(errors="replace") for n in got if isinstance(n, bytes)]

    def read(self, names: list[str]) -> dict[str, dict]:
        names = [n for n in names if len(n) <= MAX_NAME][:MAX_NAMES]
        if not names:
            return {}
        try:
            got = self._call(lambda c: c.eval(_READ, 1, self.hash, MAX_RECORD, *names), read=True)
        except BoardUnavailable:
            return {}
        out = {}
        for name, data, sig in zip(names, got[0::2], got[1::2], strict=False):
            if data is None or not redisbus.signed(self.key, PURPOSE, self.job, name, data, sig):
                continue
            body = _parse(data)
            if body is not None:
                out[name] = body
        return out

    def drop(self, names: list[str]) -> None:
        try:
            self._call(lambda c: c.hdel(self.hash, *names, *(f"{n}:s" for n in names)))
        except BoardUnavailable:
            pass
