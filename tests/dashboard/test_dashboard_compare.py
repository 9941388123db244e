"""The compare page in real headless Chromium: chosen runs overlaid on the same metrics, live."""

from __future__ import annotations


def test_compare_overlays_runs_matched_by_signal_and_extends_live(api, tab):
    verl = api.create_run("compare-verl", project="cmp")
    openrlhf = api.create_run("compare-openrlhf", project="cmp")
    # the same signal under each trainer's own name: one panel
    api.log(
        verl,
        [{"step": s, "metrics": {"actor/ppo_kl": 1e-3 * s, "actor/pg_clipfrac": 0.2}} for s in range(30)],
    )
    api.log(
        openrlhf, [{"step": s, "metrics": {"ppo_kl": 2e-3 * s, "ppo_clip_ratio": 0.25}} for s in range(40)]
    )

    tab.open(f"/compare?runs={verl},{openrlhf}", ready="window.RLV && RLV.timing.drawn")
    panels = tab.js("[...document.querySelectorAll('#panels .panel')].map(p => p.dataset.metric)")
    assert panels[:2] == ["ppo_kl", "pg_clipfrac"]
    traces = tab.js(
        """() => document.querySelector('#panels .panel[data-metric="ppo_kl"] .plot').data
                 .map(t => [t.name, t.x.length])"""
    )
    assert traces == [[f"compare-verl (#{verl})", 30], [f"compare-openrlhf (#{openrlhf})", 40]]
    band = tab.js(
        """() => document.querySelector('#panels .panel[data-metric="pg_clipfrac"] .plot').layout.shapes
                 .map(s => [s.name, s.y0, s.y1])"""
    )
    assert band == [["healthy-band", 0.1, 0.3]]

    tab.wait("document.getElementById('live').textContent === 'live'")
    api.log(openrlhf, [{"step": 40, "metrics": {"ppo_kl": 0.5}}])
    tab.wait(
        """() => { const t = document.querySelector('#panels .panel[data-metric="ppo_kl"] .plot').data[1];
                   return t.x.length === 41 && t.y[40] === 0.5; }""",
        timeout=5,
    )
    assert (
        tab.js("document.querySelector('#panels .panel[data-metric=\"ppo_kl\"] .plot').data[0].x.length")
        == 30
    )

    # choosing metrics and runs from the pickers
    tab.page.uncheck("#metric-picker input[data-metric='pg_clipfrac']")
    assert "pg_clipfrac" not in tab.js(
        "[...document.querySelectorAll('#panels .panel')].map(p => p.dataset.metric)"
    )
    tab.page.uncheck(f"#run-picker input[data-run-id='{verl}']")
    tab.wait("document.querySelector('#panels .panel .plot').data.length === 1")
    assert "runs=" + str(openrlhf) in tab.page.url
    tab.shot("compare-page")
    tab.assert_clean()
