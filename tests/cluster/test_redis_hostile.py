"""Whoever can write to the Redis the dashboards share (issue 19, items 3 and 4): a real redis-server.

A pickle on the message queue's channel, forged Socket.IO events and
``close_room``, a forged heartbeat with a higher ``seq``, a leader lock
without a TTL, and a Redis that wants a password and an ACL user.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import time

import pytest

from app.cluster import Leader, QueueCodec
from app.config import from_env
from app.run.state import RunState
from tests.helpers.app import TOKEN
from tests.helpers.heartbeats import heartbeat, write_job
from tests.helpers.liveserver import free_port
from tests.helpers.queuepage import PollingPage, emit, get_json, publish, until
from trainer_bridge.beatsink import BeatSink
from trainer_bridge.rundir import redisbus

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")

KEY = "shared-redis-key-for-the-test"


class MakesAFile:
    """Unpickling this creates ``path``: the proof that a pickle was loaded."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_published_on_the_queue_runs_nothing(dashboard, redis_server, run_dir, tmp_path):
    """Without a key, the queue still decodes JSON only: the pickle is refused and counted."""
    server, _page = dashboard(None)
    marker = tmp_path / "pwned"
    publish(redis_server.url, redisbus.job_key(run_dir), pickle.dumps(MakesAFile(marker)))
    health = until(
        lambda: (h := get_json(server.url + "/api/health"))["redis"]["refused"]["queue"] and h,
        "the dashboard refuses the pickle",
    )
    assert health["redis"]["refused"]["queue_last"] == "a message that is not JSON"
    assert not marker.exists()
    assert "summary" in get_json(server.url + "/api/summary")
    assert "socket.io relay refused a message that is not JSON" in server.log()


def test_with_a_key_forged_events_and_close_room_reach_no_page(dashboard, redis_server, run_dir, tmp_path):
    """Unsigned, badly signed and replayed queue messages are dropped; a signed one arrives."""
    server, page = dashboard(KEY)
    job = redisbus.job_key(run_dir)
    marker = tmp_path / "pwned"
    forged_sig = QueueCodec(job, b"not-the-key").dumps(emit("badly_signed"))
    stale = QueueCodec(job, KEY.encode(), clock=lambda: time.time() - 3600).dumps(emit("replayed"))
    for payload in (
        pickle.dumps(MakesAFile(marker)),
        json.dumps(emit("forged")),
        json.dumps({"method": "close_room", "room": None, "namespace": "/", "host_id": "attacker"}),
        forged_sig,
        stale,
    ):
        publish(redis_server.url, job, payload)
    # Another dashboard with the key: its event reaches the page, after all of the above.
    publish(redis_server.url, job, QueueCodec(job, KEY.encode()).dumps(emit("signed_probe")))
    until(lambda: "signed_probe" in page.names(), "the signed event reaches the page")
    assert not {"forged", "badly_signed", "replayed"} & set(page.names()), page.names()
    refused = get_json(server.url + "/api/health")["redis"]["refused"]
    assert refused["queue"] == 5, refused
    assert not marker.exists()
    assert "summary" in get_json(server.url + "/api/summary")


def test_with_a_key_a_forged_heartbeat_cannot_silence_the_real_ones(redis_server, run_dir, monkeypatch):
    """The issue's attack: republish a rank's heartbeat with a higher seq. Signed beats make it fail."""
    write_job(run_dir, 2)
    job = redisbus.job_key(run_dir)
    monkeypatch.setenv(redisbus.REDIS_URL_ENV, redis_server.url)
    monkeypatch.setenv(redisbus.REDIS_KEY_ENV, KEY)
    sink = BeatSink(run_dir, 0, 2)  # the bridge takes the key from the environment
    assert sink.publisher.key == KEY.encode()
    sink.close()
    # The ranks (no heartbeat files, so that only Redis speaks for them).
    ranks = redisbus.Publisher(redis_server.url, job, 2, key=redisbus.env_key())

    def beat(r, seq):
        assert ranks.publish(r, json.dumps(heartbeat(r, 2, seq=seq, now=now + seq)).encode())

    config = from_env({}) | {"REDIS_KEY": KEY}
    state = RunState(run_dir, config, redis=redisbus.Subscriber(redis_server.url, job, key=KEY.encode()))
    now = time.time()
    beat(0, 1), beat(1, 1)
    state.scan(now + 1)
    assert [row["seq"] for row in state.snapshot(now + 1)["ranks"]] == [1, 1]

    # The attacker: rank 1 at seq 10**9, unsigned, then with a made-up signature,
    # then with rank 0's valid signature of the same bytes.
    import redis

    client = redis.Redis.from_url(redis_server.url)
    stream, latest, _ = redisbus.keys(job)
    forged = json.dumps(heartbeat(1, 2, seq=10**6, now=now)).encode()
    client.xadd(stream, {"r": 1, "hb": forged})
    client.xadd(stream, {"r": 1, "hb": forged, "s": "0" * 64})
    client.xadd(stream, {"r": 1, "hb": forged, "s": redisbus.signature(KEY.encode(), "hb", job, "0", forged)})
    beat(0, 2), beat(1, 2), beat(0, 3), beat(1, 3)
    state.scan(now + 3)
    snap = state.snapshot(now + 3)
    assert [row["seq"] for row in snap["ranks"]] == [3, 3]
    assert "3 heartbeat(s) refused as unsigned or badly signed" in snap["run"]["message"]

    # A dashboard that starts now resynchronises from the hash, whose rank 1 is forged.
    client.hset(latest, mapping={"1": forged})
    fresh = RunState(run_dir, config, redis=redisbus.Subscriber(redis_server.url, job, key=KEY.encode()))
    fresh.scan(now + 3)
    assert [row["seq"] for row in fresh.snapshot(now + 3)["ranks"]] == [3, None]  # rank 1 not heard yet
    beat(1, 4)
    fresh.scan(now + 4)
    assert [row["seq"] for row in fresh.snapshot(now + 4)["ranks"]] == [3, 4]
    ranks.close()


def test_a_leader_lock_without_ttl_or_with_a_huge_one_is_taken_over(redis_server):
    """Someone sets the lock for ever (no TTL) or for a day: a live dashboard takes it over."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    _, _, key = redisbus.keys("job")
    dash = Leader(redis_server.url, "job", 2.0)
    client.set(key, "attacker")  # no TTL
    assert dash.step() is True and dash.holder() == dash.token
    assert 0 < client.pttl(key) <= 2000
    dash.release()
    client.set(key, "attacker", ex=86_400)
    assert dash.step() is True and dash.holder() == dash.token
    # A rightful holder (TTL within bounds) is left alone.
    other = Leader(redis_server.url, "job", 2.0)
    assert other.step() is False and dash.step() is True


def test_with_a_key_an_unsigned_or_copied_leader_lock_is_taken_over(redis_server):
    """Someone without the key renews a lock with a normal TTL: unsigned, or a value copied from a dashboard."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    _, _, key = redisbus.keys("job")
    dash = Leader(redis_server.url, "job", 2.0, key=KEY.encode())
    client.set(key, "attacker", px=2000)
    assert dash.step() is True and "not signed" in dash.taken_over
    value = client.get(key)
    token, at, sig = value.split(b" ")
    assert token.decode() == dash.token and dash.holder() == dash.token
    dash.release()
    # A signed value, copied: its signature dates from a renewal 100 s ago.
    old = Leader(redis_server.url, "job", 2.0, key=KEY.encode(), clock=lambda: time.time() - 100)
    assert old.step() is True
    copied = client.get(key)
    old.leads = False  # that dashboard is gone; the attacker renews its value without the key
    client.set(key, copied, px=2000)
    assert dash.step() is True and "signed 100 s ago" in dash.taken_over
    # The leader itself re-signs at every renewal, so it keeps the lead.
    before = client.get(key)
    later = Leader(redis_server.url, "job", 2.0, key=KEY.encode())
    assert later.step() is False and dash.step() is True and dash.step() is True
    assert client.get(key).split(b" ")[0] == before.split(b" ")[0]


def _pings(client) -> bool:
    import redis

    try:
        return client.ping()
    except redis.RedisError:  # not listening yet
        return False


@pytest.fixture
def locked_redis(tmp_path):
    """redis-server with a password for ``default`` and an ACL user limited to Rankwatch's keys."""
    port = free_port()
    acl = tmp_path / "users.acl"
    acl.write_text(
        "user default on >default-pass ~* &* +@all\n"
        "user rankwatch on >rw-pass ~rankwatch:* &rankwatch:* +@all -@dangerous +info\n"
    )
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        + ["--aclfile", str(acl)],
        stdout=open(tmp_path / "redis.log", "ab"),
        stderr=subprocess.STDOUT,
    )
    import redis

    until(lambda: _pings(redis.Redis(port=port, password="default-pass")), "redis-server answers", timeout=20)
    yield port
    proc.kill()
    proc.wait()


def test_a_password_and_an_acl_user_in_the_url_work_and_never_show(locked_redis, run_dir):
    port = locked_redis
    write_job(run_dir, 1)
    job = redisbus.job_key(run_dir)
    anonymous = redisbus.Publisher(f"redis://127.0.0.1:{port}/0", job, world_size=1)
    assert not anonymous.publish(0, b"{}")
    assert "unreachable" in anonymous.error
    url = f"redis://rankwatch:rw-pass@127.0.0.1:{port}/0"
    pub = redisbus.Publisher(url, job, world_size=1, key=KEY.encode())
    sub = redisbus.Subscriber(url, job, key=KEY.encode())
    beat = json.dumps(heartbeat(0, 1, seq=1)).encode()
    assert pub.publish(0, beat), pub.error
    assert sub.poll() == [(0, beat)]
    lead = Leader(url, job, 5.0)
    assert lead.step() is True and lead.error is None
    assert lead.where == f"redis://rankwatch:***@127.0.0.1:{port}/0"
    # The ACL user reaches only Rankwatch's keys.
    wrong = redisbus.Publisher(url, job, world_size=1)
    wrong.stream = "other:beats"
    assert not wrong.publish(0, beat) and "no permissions" in wrong.error
    assert "rw-pass" not in wrong.error


@pytest.fixture
def tls_redis(tmp_path):
    """redis-server on TLS only, with an ACL user; certificates made here with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path / "tls"
    d.mkdir()

    def openssl(*args):
        if args[0] == "req":
            args = (*args, "-subj", "/CN=127.0.0.1", *(("-days", "2") if "-x509" in args else ()))
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(
        *("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial"),
        *("-out", "server.pem", "-days", "2", "-extfile", "ext.cnf"),
    )
    (d / "users.acl").write_text(
        "user default off\nuser rankwatch on >rw-pass ~rankwatch:* &rankwatch:* +@all -@dangerous +info\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", ""]
        + ["--tls-cert-file", "server.pem", "--tls-key-file", "server.key", "--tls-ca-cert-file", "ca.pem"]
        + ["--tls-auth-clients", "no", "--aclfile", "users.acl"],
        cwd=d,
        stdout=open(tmp_path / "redis-tls.log", "ab"),
        stderr=subprocess.STDOUT,
    )
    url = f"rediss://rankwatch:rw-pass@127.0.0.1:{port}/0?ssl_ca_certs={d / 'ca.pem'}&ssl_cert_reqs=required"
    import redis

    until(lambda: _pings(redis.Redis.from_url(url)), "redis-server answers on TLS", timeout=20)
    yield url, port
    proc.kill()
    proc.wait()


def test_a_dashboard_and_a_rank_over_tls_with_an_acl_user_and_a_key(
    tls_redis, run_dir, tmp_path, start_server
):
    """rediss:// with an ACL user, end to end: a signed heartbeat, the relay and the lead."""
    url, port = tls_redis
    write_job(run_dir, 1)
    plain = redisbus.Publisher(f"redis://rankwatch:rw-pass@127.0.0.1:{port}/0", "job", world_size=1)
    assert not plain.publish(0, b"{}")  # TLS only
    server = start_server(
        run_dir,
        tmp_path / "dashboard.log",
        env={"RANKWATCH_REDIS_URL": url, "RANKWATCH_REDIS_KEY": KEY, "RANKWATCH_TOKEN": TOKEN},
    )
    page = PollingPage(server.url)
    try:
        health = until(
            lambda: (
                (h := get_json(server.url + "/api/health"))["redis"]["relay"] and h["role"] == "leader" and h
            ),
            "the dashboard leads and relays over TLS",
        )
        assert health["redis"]["signed"] and "rw-pass" not in json.dumps(health)
        assert health["redis"]["url"].startswith("rediss://rankwatch:***@127.0.0.1")
        rank = redisbus.Publisher(url, redisbus.job_key(run_dir), world_size=1, key=KEY.encode())
        assert rank.publish(0, json.dumps(heartbeat(0, 1, seq=7)).encode()), rank.error
        until(
            lambda: get_json(server.url + "/api/ranks")["ranks"][0]["seq"] == 7,
            "the signed heartbeat is read over TLS",
        )
        assert "rw-pass" not in server.log()
    finally:
        page.close()
