"""The dashboard's pages in real headless Chromium: served, clean, sick runs first, run data as text."""

from __future__ import annotations

from importlib import resources

import httpx

XSS = "<script>alert(1)</script>"
XSS_IMG = '<img src=x onerror="alert(2)">'


def _healthy(step: int) -> dict:
    return {"actor/ppo_kl": 1e-3, "actor/pg_clipfrac": 0.2, "actor/entropy": 1.0}


def test_pages_and_assets_are_served_with_a_strict_policy(server):
    with httpx.Client(base_url=server.url) as client:
        for path in ("/", "/runs/1", "/runs/1/audits", "/alerts", "/compare"):
            resp = client.get(path)
            assert resp.status_code == 200, path
            assert resp.headers["content-type"].startswith("text/html")
            assert "script-src 'self'" in resp.headers["content-security-policy"]
            assert "<script>" not in resp.text  # no inline script anywhere
        page = client.get("/runs/1").text
        plotly_url = page.split('<meta name="rlv-plotly" content="', 1)[1].split('"', 1)[0]
        assert plotly_url.startswith("/static/vendor/plotly.min.js?v=")
        shipped = (resources.files("plotly") / "package_data" / "plotly.min.js").read_bytes()
        resp = client.get(plotly_url)
        assert resp.status_code == 200 and resp.content == shipped  # the installed package's file, no CDN
        assert "immutable" in resp.headers["cache-control"]
        missing = client.get("/static/../settings.py")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "not_found"


def test_runs_page_puts_sick_runs_first_and_filters(api, tab):
    healthy = api.create_run("pages-healthy", project="alpha", tags=["baseline"])
    api.log(healthy, [{"step": s, "metrics": _healthy(s)} for s in range(20)])
    sick = api.create_run("pages-sick", project="beta", tags=["lr-sweep"])
    api.log(sick, [{"step": s, "metrics": _healthy(s)} for s in range(20)])
    api.log(sick, [{"step": 20, "metrics": {"actor/pg_loss": "NaN"}}])  # non_finite: critical
    api.wait_alert(sick, "non_finite")

    tab.open("/", ready="window.RLV && RLV.timing.rendered")
    rows = tab.js(
        "[...document.querySelectorAll('#runs-body tr')].map(r => [r.dataset.runId, r.dataset.status])"
    )
    ids = [r[0] for r in rows]
    assert ids.index(str(sick)) < ids.index(str(healthy))
    assert rows[0][1] == "critical"
    sick_row = tab.page.locator(f"#runs-body tr[data-run-id='{sick}']")
    assert sick_row.locator(".badge").inner_text().lower() == "critical"
    assert "non_finite" in sick_row.inner_text()

    tab.page.select_option("#project-filter", "alpha")
    shown = tab.js("[...document.querySelectorAll('#runs-body tr')].map(r => r.dataset.runId)")
    assert shown == [str(healthy)]
    tab.page.select_option("#project-filter", "")
    tab.page.fill("#search", "lr-sweep")  # tags are searched too
    shown = tab.js("[...document.querySelectorAll('#runs-body tr')].map(r => r.dataset.runId)")
    assert shown == [str(sick)]
    tab.shot("runs-page")
    tab.assert_clean()


def test_hostile_names_tags_config_and_metrics_render_as_text(api, tab):
    run = api.create_run(
        XSS, project=f"<b>{XSS}</b>", tags=[XSS_IMG], config={"note": XSS_IMG, "nested": {XSS: XSS}}
    )
    api.log(run, [{"step": s, "metrics": {"actor/ppo_kl": 1e-3, XSS_IMG: 1.0}} for s in range(10)])
    api.log(run, [{"step": 10, "metrics": {XSS_IMG: "NaN"}}])  # an alert message that quotes the name
    api.wait_alert(run, "non_finite")

    tab.open("/", ready="window.RLV && RLV.timing.rendered")
    link = tab.page.locator(f"#runs-body tr[data-run-id='{run}'] a.run-name")
    assert link.inner_text() == XSS

    tab.open(f"/runs/{run}", ready="window.RLV && RLV.timing.allCharts")
    assert tab.js("document.getElementById('run-name').textContent") == XSS
    assert tab.js("document.title").startswith(XSS)
    assert tab.js("document.querySelector('#run-tags .tag').textContent") == XSS_IMG
    titles = tab.js("[...document.querySelectorAll('.panel-title')].map(t => t.firstChild.textContent)")
    assert XSS_IMG in titles
    # a custom diagnostic's NaN alone is an info alert: a note, not in the Firing box
    assert XSS_IMG in tab.js("document.getElementById('notes-list').textContent")
    tab.page.click("#config-box summary")
    assert XSS_IMG in tab.js("document.getElementById('config-table').textContent")
    # nothing was parsed as markup: no element from the data, no handler ran, no dialog opened
    assert tab.js("document.querySelectorAll('img[src=x], main script, b script').length") == 0
    assert not tab.dialogs
    legend_names = tab.js(
        "[...document.querySelectorAll('.panel')].flatMap(p => (p.querySelector('.plot').data || []).map(t => t.name))"
    )
    assert "&lt;img src=x onerror=&quot;alert(2)&quot;&gt;" in legend_names  # plotly shows entities as text

    tab.open("/alerts", ready="window.RLV && RLV.timing.rendered")
    assert tab.page.locator(f"#alerts-body tr a.run-name[href='/runs/{run}']").first.inner_text() == XSS
    tab.open(f"/compare?runs={run}", ready="window.RLV && RLV.timing.drawn")
    tab.shot("xss-run")
    assert not tab.dialogs  # an alert() from the data would have opened one
    tab.assert_clean()
