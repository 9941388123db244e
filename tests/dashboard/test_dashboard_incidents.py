"""The run page's incident panel in real headless Chromium: incidents with cause, severity, primary rule
and cost, their findings one click away, and new incidents arriving live."""

from __future__ import annotations


def _open(tab, run_id: int) -> None:
    tab.open(f"/runs/{run_id}", ready="window.RLV && RLV.timing.allCharts")


def test_the_run_page_lists_incidents_with_their_findings_one_click_away(api, tab):
    run_id = api.create_run("incident-panel", project="dash", config={"rlvitals": {"gpus": 4}})
    t0 = 1_700_000_000.0
    api.log(
        run_id, [{"step": s, "wall_time": t0 + 36 * s, "metrics": {"actor/pg_loss": 0.1}} for s in range(20)]
    )
    api.log(
        run_id,
        [{"step": s, "wall_time": t0 + 36 * s, "metrics": {"actor/pg_loss": "NaN"}} for s in range(20, 120)],
    )
    api.wait_alert(run_id, "non_finite")
    _open(tab, run_id)
    item = tab.page.locator("#incidents-list li[data-cause='non_finite']")
    item.wait_for(timeout=10_000)
    text = item.inner_text()
    assert "critical" in text and "#1" in text and "since step 20" in text and "non_finite" in text
    assert "GPU-h since onset" in text  # 4 GPUs x 99 steps x 36 s
    assert "0.99 h" not in text and "3.96" in text
    assert not item.locator("table").is_visible()
    item.locator("details.findings summary").click()
    row = item.locator("table tr[data-rule='non_finite']").first
    assert row.is_visible() and "firing" in row.inner_text()
    tab.shot("incidents")
    tab.assert_clean()


def test_a_new_incident_arrives_live(api, tab):
    run_id = api.create_run("incident-live", project="dash")
    api.log(run_id, [{"step": s, "metrics": {"actor/pg_loss": 0.1}} for s in range(10)])
    _open(tab, run_id)
    tab.wait("document.getElementById('live').textContent === 'live'")
    assert tab.js("document.getElementById('incidents-panel').hidden")
    api.log(run_id, [{"step": 10, "metrics": {"actor/pg_loss": "NaN"}}])
    tab.wait("!!document.querySelector('#incidents-list li[data-cause=\"non_finite\"]')", timeout=10.0)
    tab.assert_clean()
