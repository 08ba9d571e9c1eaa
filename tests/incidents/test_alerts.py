"""Webhook alerts against a real HTTP receiver on a loopback port.

The sender's retries, a receiver down for 10 s, the grouping of a job-wide
stall into one summary (1,024 ranks through the real watcher tick), stop
alerts sent once across a dashboard restart.
"""

from __future__ import annotations

import threading
import time

import pytest

from app import create_app
from app.incidents.alerts import AlertDesk, ranks_text
from app.incidents.webhooks import WebhookSender, parse_urls, redact
from tests.helpers.app import AUTH, FAST_SETTINGS, TOKEN, wait_for
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.helpers.incidents import Sent
from tests.helpers.receiver import Receiver, quiet_port


def sender_for(tmp_path, *urls, give_up_s=120.0):
    return WebhookSender(
        list(urls),
        tmp_path / "audit.sqlite3",
        timeout_s=2.0,
        give_up_s=give_up_s,
        retry_max_s=4.0,
        start_task=lambda target, *args: threading.Thread(target=target, args=args, daemon=True).start(),
    )


def test_urls_are_checked_and_shown_without_their_secret():
    assert parse_urls(" http://a/x , https://b:8443/hooks/T0/B0/SECRET ") == [
        "http://a/x",
        "https://b:8443/hooks/T0/B0/SECRET",
    ]
    assert redact("https://user:pw@hooks.example.com/services/T0/SECRET?x=1") == "https://hooks.example.com/…"
    assert redact("http://127.0.0.1:9000") == "http://127.0.0.1:9000"
    with pytest.raises(ValueError, match="WEBHOOK_URL"):
        parse_urls("ftp://a/b")
    with pytest.raises(ValueError, match="WEBHOOK_URL"):
        create_app({"RUN_DIR": "/tmp", "WEBHOOK_URL": "not a url"})


def test_ranks_text_compresses_runs():
    assert ranks_text([7, 0, 2, 3, 4]) == "0, 2-4, 7"
    assert ranks_text(range(1024)) == "0-1023"
    assert ranks_text([0, 2, 4, 6, 8], limit=2) == "0, 2 and 3 more"


def test_an_alert_reaches_every_receiver_and_every_attempt_is_logged(tmp_path):
    with Receiver() as one, Receiver() as two:
        sender = sender_for(tmp_path, one.url, two.url)
        desk = AlertDesk(sender, "/runs/a", group_s=0, summary_over=5, rate_per_min=20)
        desk.verdict(3, "stalled", "no step finished for over 5 s", now=100.0)
        assert desk.flush(100.0) == 1
        for receiver in (one, two):
            got = receiver.wait_for(lambda p: p, "the stalled alert")[0]
            assert got["event"] == "verdict" and got["rank"] == 3 and got["health"] == "stalled"
            assert got["text"] == "Rankwatch /runs/a: rank 3 stalled: no step finished for over 5 s"
            assert got["job"] == "/runs/a" and isinstance(got["at"], float)
        rows = wait_for(lambda: len(sender.rows()) == 2 and sender.rows(), "two logged attempts")
        assert {r["outcome"] for r in rows} == {"delivered (HTTP 200)"}
        assert all("secret" not in r["target"] for r in rows)
        sender.close()


def test_deliveries_survive_the_receiver_being_down_for_10_s(tmp_path):
    receiver = Receiver(quiet_port())  # not started: the port refuses connections
    sender = sender_for(tmp_path, receiver.url)
    sender.send({"event": "verdict", "text": "rank 1 stalled", "job": "j", "at": 1.0})
    first = wait_for(lambda: sender.recent(), "the first failed attempt")[-1]
    assert first["outcome"].startswith("failed:") and "retry in" in first["outcome"]
    # Stay down for 10 s of the sender's retries, then come up.
    wait_for(lambda: time.time() - first["at"] >= 10.0, "10 s of the receiver being down", timeout=30)
    assert sum(r["outcome"].startswith("failed") for r in sender.recent()) >= 3
    with receiver:  # up now
        got = receiver.wait_for(lambda p: p, "the alert after the receiver came back", timeout=30)
        assert got == [{"event": "verdict", "text": "rank 1 stalled", "job": "j", "at": 1.0}]
        delivered = wait_for(
            lambda: [r for r in sender.recent() if r["outcome"].startswith("delivered")], "the log"
        )
        assert delivered[0]["attempt"] >= 4
    sender.close()


def test_a_refused_alert_is_given_up_at_once(tmp_path):
    with Receiver(status=404) as receiver:
        sender = sender_for(tmp_path, receiver.url)
        sender.send({"event": "verdict", "text": "t", "job": "j", "at": 1.0})
        row = wait_for(lambda: sender.recent(), "the attempt")[0]
        assert row["outcome"].startswith("gave up: HTTP 404") and row["attempt"] == 1
        assert len(receiver.events()) == 1
        sender.close()


# ------------------------------------------------------------------ the desk's filters


def desk(**kw) -> tuple[AlertDesk, Sent]:
    sent = Sent()
    options = {"group_s": 2.0, "summary_over": 5, "rate_per_min": 20, **kw}
    return AlertDesk(sent, "j", clock=lambda: 0.0, **options), sent


def test_changes_are_grouped_and_many_become_one_summary():
    d, sent = desk()
    for r in range(1024):
        d.verdict(r, "stalled", "no step", now=10.0 + r / 1024)  # over a second, as a hang spreads
    assert d.flush(11.0) == 0  # still inside the group window
    assert d.flush(12.5) == 1
    (summary,) = sent.payloads
    assert summary["event"] == "verdicts" and summary["count"] == 1024
    assert summary["changes"] == {"stalled": list(range(1024))}
    assert "1024 ranks changed verdict: 1024 stalled (ranks 0-1023)" in summary["text"]
    # The same verdict again is no news.
    d.verdict(5, "stalled", "no step", now=20.0)
    assert d.flush(30.0) == 0


def test_few_changes_go_one_by_one_and_recovery_follows_an_announced_problem():
    d, sent = desk()
    d.verdict(0, "healthy", "training", now=0.0)  # first sight, healthy: nothing to say
    d.verdict(1, "stalled", "process 9 is stopped", now=0.0)
    d.flush(5.0)
    d.verdict(1, "healthy", "training", now=6.0)
    d.verdict(0, "healthy", "training", now=6.0)
    d.flush(9.0)
    assert [(p["event"], p["rank"], p["health"]) for p in sent.payloads] == [
        ("verdict", 1, "stalled"),
        ("verdict", 1, "healthy"),
    ]
    assert (
        sent.payloads[1]["previous"] == "stalled"
        and "healthy again (was stalled)" in sent.payloads[1]["text"]
    )


def test_a_flap_inside_the_group_window_cancels_out():
    d, sent = desk()
    d.verdict(2, "healthy", "training", now=0.0)
    d.verdict(2, "straggler", "slow", now=1.0)
    d.verdict(2, "healthy", "training", now=1.5)
    d.flush(10.0)
    assert sent.payloads == []


def test_the_rate_limit_folds_a_storm_into_summaries():
    d, sent = desk(group_s=0.0, rate_per_min=3, summary_over=5)
    for i in range(3):
        d.verdict(i, "dead", "gone", now=float(i))
        d.flush(float(i))
    d.verdict(10, "dead", "gone", now=5.0)
    d.verdict(11, "dead", "gone", now=5.0)
    assert d.flush(5.0) == 0  # three sent this minute: the rest waits
    assert d.flush(61.0) == 1  # the minute moved on: one summary of what waited
    assert [p["event"] for p in sent.payloads] == ["verdict"] * 3 + ["verdicts"]
    assert sent.payloads[-1]["changes"] == {"dead": [10, 11]}


# ------------------------------------------------------------------ through the watcher


@pytest.fixture
def receiver():
    with Receiver() as r:
        yield r


def make_app(run_dir, receiver, **extra):
    return create_app(
        {
            "RUN_DIR": str(run_dir),
            "TESTING": True,
            "TOKEN": TOKEN,
            **FAST_SETTINGS,
            "WEBHOOK_URL": receiver.url,
            "ALERT_GROUP_S": 1.0,
            **extra,
        }
    )


def test_1024_ranks_stalling_together_send_one_summary(run_dir, receiver):
    n, t0 = 1024, time.time()
    write_job(run_dir, n)
    for r in range(n):
        write_heartbeat(run_dir, heartbeat(r, n, now=t0), history=False)
    app = make_app(run_dir, receiver)
    watcher = app.extensions["rankwatch"].watcher
    watcher.clock = lambda: t0 + 0.2
    watcher.tick()
    assert app.extensions["rankwatch"].state.summary(t0)["summary"]["counts"]["healthy"] == n
    # Every rank keeps writing heartbeats but finishes no step: a job-wide hang in a collective.
    for r in range(n):
        write_heartbeat(run_dir, heartbeat(r, n, seq=2, now=t0 + 8.0 + r / n, last_step_at=t0), history=False)
    for dt in (9.2, 9.7, 10.2, 10.7, 11.2, 20.0):
        watcher.clock = lambda dt=dt: t0 + dt
        watcher.tick()
    # Sending only queues, in the tick: what the ticks raised is known now.
    assert app.extensions["rankwatch"].incidents.alerts.sender.raised == 1
    got = receiver.wait_for(lambda p: p, "the summary")
    app.extensions["rankwatch"].incidents.alerts.sender.close()
    assert [p["event"] for p in got] == ["verdicts"], got
    assert got[0]["count"] == n and got[0]["changes"] == {"stalled": list(range(n))}
    assert "1024 stalled (ranks 0-1023)" in got[0]["text"]


def test_stop_alerts_are_sent_once_even_across_a_restart(run_dir, receiver):
    write_job(run_dir, 1)
    write_heartbeat(run_dir, heartbeat(0, 1))
    app = make_app(run_dir, receiver)
    client = app.test_client()
    r = client.post(
        "/api/exit",
        json={"reason": "npu 3 ECC errors", "who": "alice"},
        headers=AUTH,
    )
    rid = r.get_json()["request_id"]
    app.extensions["rankwatch"].watcher.tick()
    got = receiver.wait_for(lambda p: p, "the stop request alert")
    assert got[0]["event"] == "stop_requested" and got[0]["request_id"] == rid
    assert got[0]["text"].endswith(f"graceful stop requested by alice: npu 3 ECC errors ({rid})")
    wait_for(lambda: app.extensions["rankwatch"].incidents.alerts.sender.rows(), "the delivery log row")
    # A restarted dashboard on the same run sees the same request: no second alert.
    again = make_app(run_dir, receiver)
    again.extensions["rankwatch"].watcher.tick()
    again.extensions["rankwatch"].watcher.tick()
    assert again.extensions["rankwatch"].incidents.alerts.sender.raised == 0
    assert len(receiver.events("stop_requested")) == 1
    body = client.get("/api/alerts").get_json()
    assert body["enabled"] and body["rows"][0]["event"] == "stop_requested"
    assert body["targets"] == [f"http://127.0.0.1:{receiver.port}/…"]
    for a in (app, again):
        a.extensions["rankwatch"].incidents.alerts.sender.close()


# ------------------------------------------------------------------ hostile text, redirects


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_a_failed_delivery_and_is_not_followed(tmp_path, status):
    with Receiver() as target, Receiver(status=status, location=target.url) as redirecting:
        sender = sender_for(tmp_path, redirecting.url)
        sender.send({"event": "verdict", "text": "rank 1 stalled", "job": "j", "at": 1.0})
        row = wait_for(lambda: sender.recent(), "the attempt")[0]
        sender.close()
        assert row["outcome"].startswith(f"gave up: HTTP {status}"), row
        assert "redirect to http://127.0.0.1" in row["outcome"] and "not followed" in row["outcome"]
        assert "secret-part" not in row["outcome"], "the Location is shown without its path"
        assert row["attempt"] == 1 and len(redirecting.events()) == 1
        assert target.events() == [], "nothing reached the redirect's target"
        # The delivery log's row is written just after the in-memory one.
        assert wait_for(lambda: sender.rows(), "the logged attempt")[0]["outcome"] == row["outcome"]


def test_rank_written_text_arrives_without_mentions_or_links(run_dir, receiver):
    """A failed rank's error text reaches the receiver through the real watcher tick, neutralised."""
    hostile = (
        "<!channel> <!here> <@U024BE7LH> see <https://evil.example/x|the runbook> & "
        '<at user_id="all">所有人</at> @all @Here'
    )
    write_job(run_dir, 2)
    write_heartbeat(run_dir, heartbeat(0, 2))
    write_heartbeat(run_dir, heartbeat(1, 2, host="<!everyone>", state="failed", error=hostile))
    app = make_app(run_dir, receiver)
    watcher, t0 = app.extensions["rankwatch"].watcher, time.time()
    for dt in (0.2, 1.5, 3.0):  # past the 1 s group window
        watcher.clock = lambda dt=dt: t0 + dt
        watcher.tick()
    got = receiver.wait_for(lambda p: [x for x in p if x.get("rank") == 1], "rank 1's failure")[0]
    app.extensions["rankwatch"].incidents.alerts.sender.close()
    for field in ("text", "reason"):
        text = got[field]
        assert "<" not in text and ">" not in text, text
        assert "&lt;!channel&gt; &lt;!here&gt; &lt;@U024BE7LH&gt;" in text, text
        assert "&lt;https://evil.example/x|the runbook&gt; &amp; " in text
        assert '&lt;at user_id="all"&gt;所有人&lt;/at&gt;' in text
        assert "@\u200ball @\u200bHere" in text and "@all" not in text
    # The delivery log keeps the text as the rank wrote it.
    logged = wait_for(
        lambda: [
            r for r in app.extensions["rankwatch"].incidents.alerts.sender.rows() if "rank 1" in r["text"]
        ],
        "the log row",
    )
    assert "<!channel>" in logged[0]["text"]
