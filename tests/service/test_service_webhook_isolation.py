"""Alert delivery that one bad destination cannot slow down, that does not spam, and that Slack
cannot be tricked by (issue 13, item 4). Every listener is a real HTTP server on 127.0.0.1.

Before: all URLs shared two sender threads, so a hanging URL held them and a healthy one got about
one delivery per timeout; a flapping rule sent every transition; Slack text interpolated run names
raw (``<!channel>`` pinged the channel).
"""

from __future__ import annotations

import time

from rlvitals.service.storage import repository as repo

FINITE = [{"step": s, "metrics": {"actor/pg_loss": 0.1}} for s in range(14)]


def flap(api, run_id: int, cycles: int, first_step: int = 0) -> int:
    """``cycles`` episodes of ``non_finite``: a NaN fires it, 14 finite steps resolve it (each write
    answered once its rules ran, so the transitions follow the writes' timing)."""
    step = first_step
    rules = {"params": {"wait": "rules"}}
    for _ in range(cycles):
        assert (
            api.log(run_id, [{"step": step, "metrics": {"actor/pg_loss": "NaN"}}], **rules).status_code == 200
        )
        steps = [{"step": step + 1 + s["step"], "metrics": s["metrics"]} for s in FINITE]
        assert api.log(run_id, steps, **rules).status_code == 200
        step += 1 + len(FINITE)
    return step


def test_a_hanging_a_failing_and_a_redirecting_url_do_not_delay_a_healthy_one(app_client, tmp_path, hooks):
    healthy, hanging, failing, redirecting = hooks(), hooks(delay=20.0), hooks(status=500), hooks(status=302)
    api = app_client(
        f"sqlite:///{tmp_path}/iso.db",
        webhook_urls=[
            hanging.url("/hang"),
            failing.url("/fail"),
            redirecting.url("/moved"),
            healthy.url("/ok"),
        ],
        webhook_timeout=2.0,
        webhook_backoff=0.2,
        webhook_rule_limit=0,
    )
    run_id = api.create_run("flappy")
    started = time.monotonic()
    flap(api, run_id, cycles=4)
    got = healthy.wait_for(8, timeout=6.0)  # 4 firings + 4 resolutions
    took = time.monotonic() - started
    assert took < 4.0, f"the healthy URL waited {took:.1f} s behind the others"
    assert got[-1]["body"]["event"] == "alert.resolved"  # each says the state when it was sent
    assert hanging.received == []  # still stuck on the first one (20 s > timeout)
    with api.services.db.read() as session:
        deliveries = repo.list_deliveries(session=session)
        moved = [d for d in deliveries if d["url"].endswith("/moved")]
        attempts = [a for d in moved for a in repo.list_attempts(session=session, delivery_id=d["id"])]
    assert attempts and all(a["status_code"] == 302 and not a["ok"] for a in attempts)  # never followed
    assert {r["path"] for r in redirecting.received} == {"/moved"}


def test_a_flapping_rule_is_rate_limited_and_the_next_notification_carries_a_digest(
    app_client, tmp_path, hooks
):
    hook = hooks()
    api = app_client(
        f"sqlite:///{tmp_path}/limit.db",
        webhook_urls=[hook.url("/generic")],
        slack_webhook_urls=[hook.url("/slack")],
        webhook_rule_limit=2,
        webhook_rule_window=1.5,
    )
    run_id = api.create_run("flappy")
    step = flap(api, run_id, cycles=5)  # 10 transitions
    hook.wait_for(4)  # 2 transitions x 2 URLs
    got = hook.wait_for(6)  # + one catch-up per URL once the window has room, saying the state then
    generic = next(r["body"] for r in got[4:] if r["path"] == "/generic")
    slack = next(r["body"] for r in got[4:] if r["path"] == "/slack")
    # the transitions between the state the last one showed and this one's (how many: when it went out)
    assert generic["event"] == "alert.resolved" and 1 <= generic["suppressed"] <= 8
    assert "*resolved*" in slack["text"] and "more transition(s)" in slack["text"]
    time.sleep(1.6)  # the window passes
    assert len(hook.received) == 6
    api.log(run_id, [{"step": step, "metrics": {"actor/pg_loss": "NaN"}}])
    got = hook.wait_for(8)
    generic = next(r["body"] for r in got[6:] if r["path"] == "/generic")
    assert generic["event"] == "alert.firing" and generic["suppressed"] == 0
    with api.services.db.read() as session:
        assert len(repo.list_deliveries(session=session)) == 8


def test_slack_text_escapes_names_and_messages(app_client, tmp_path, hooks):
    hook = hooks()
    api = app_client(f"sqlite:///{tmp_path}/slack.db", slack_webhook_urls=[hook.url("/slack")])
    run_id = api.create_run("<!channel> <https://evil.example|Click> & co", project="<@U123>")
    api.log(run_id, [{"step": 0, "metrics": {"actor/pg_loss": "NaN"}}])
    text = hook.wait_for(1)[0]["body"]["text"]
    assert "&lt;!channel&gt; &lt;https://evil.example|Click&gt; &amp; co" in text
    assert "&lt;@U123&gt;" in text
    assert "<!" not in text and "<http" not in text and "<@" not in text


def test_deliveries_queued_for_a_url_dropped_from_the_settings_are_still_sent(app_client, tmp_path, hooks):
    hook = hooks()
    url = f"sqlite:///{tmp_path}/dropped.db"
    api = app_client(url, webhook_urls=[hook.url("/old")], webhook_workers=0)  # queued, not sent
    run_id = api.create_run()
    api.log(run_id, [{"step": 0, "metrics": {"actor/pg_loss": "NaN"}}])
    api.stop()
    later = app_client(url)  # restarted without that URL
    assert hook.wait_for(1)[0]["path"] == "/old"
    assert later.services.webhooks.urls == [hook.url("/old")]
