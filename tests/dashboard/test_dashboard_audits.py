"""The audits page in real headless Chromium: reported vs recomputed, explanations, counterfactuals,
histograms of the batch, and audits arriving live."""

from __future__ import annotations

import time

import pytest

from tests.dashboard.dashdata import AGG_MODES, CONFIG, batch, reported


@pytest.fixture(scope="module")
def audited(api) -> dict:
    run = api.create_run("audited-run", project="dash")
    good = batch(1)
    bad = batch(2)
    wrong = dict(reported(bad))
    wrong["pg_loss"] *= 8  # what a dp_size=8 token-mean mix-up looks like
    ok_id = api.upload_batch(run, good, step=100, config=CONFIG, reported=reported(good))
    bad_id = api.upload_batch(run, bad, step=200, config=CONFIG, reported=wrong)
    api.wait_audit(ok_id)
    assert api.wait_audit(bad_id)["status"] == "done"
    return {"run": run, "ok": ok_id, "bad": bad_id, "bad_tensors": bad}


def test_mismatches_are_highlighted_with_their_explanation(tab, audited):
    tab.open(f"/runs/{audited['run']}/audits", ready="window.RLV && RLV.timing.rendered")
    assert tab.js("document.getElementById('audit-count').textContent") == "2 audits, 1 mismatched"
    bad_rows = tab.js(
        "id => [...document.querySelectorAll(`#audits-body tr.mismatch[data-audit-id='${id}']`)].map(r => r.dataset.metric)",
        str(audited["bad"]),
    )
    assert bad_rows == ["pg_loss"]
    assert (
        tab.js(
            "id => document.querySelectorAll(`#audits-body tr.mismatch[data-audit-id='${id}']`).length",
            str(audited["ok"]),
        )
        == 0
    )
    explanation = tab.js(
        "id => document.querySelector(`#audits-body tr.explain[data-audit-id='${id}']`).textContent",
        str(audited["bad"]),
    )
    assert explanation.startswith("1 of 5 reported metrics disagree (pg_loss)")
    tab.assert_clean()


def test_verl_prefixed_names_share_one_row_per_metric_and_one_folded_explanation(api, tab):
    """A trainer reporting verl's names (actor/pg_loss) with the wrong aggregation mode."""
    from rlvitals.analyzers import LossConfig, recompute

    run = api.create_run("prefixed-names", project="dash")
    tensors = batch(4)
    wrong_mode = recompute(LossConfig(**{**CONFIG, "loss_agg_mode": "seq-mean-token-mean"}), **tensors)
    prefixed = {f"actor/{k}": v for k, v in wrong_mode.items()} | {"actor/grad_norm": 1.5}
    audit_id = api.upload_batch(run, tensors, step=10, config=CONFIG, reported=prefixed)
    assert api.wait_audit(audit_id)["status"] == "done"
    tab.open(f"/runs/{run}/audits", ready="window.RLV && RLV.timing.rendered")
    rows = tab.js(
        """() => [...document.querySelectorAll('#audits-body tr.clickable')].map(r => ({
               metric: r.dataset.metric, cells: [...r.querySelectorAll('td')].map(td => td.textContent)}))"""
    )
    metrics = [r["metric"] for r in rows]
    audited_rows = [m for m in metrics if m]
    assert len(set(audited_rows)) == len(audited_rows) and "pg_loss" in audited_rows  # one row per metric
    pg = next(r for r in rows if r["metric"] == "pg_loss")["cells"][-6:]  # metric, reported, recomputed, …
    assert "reported as actor/pg_loss" in pg[0], rows
    assert pg[1] not in ("", "–") and pg[2] not in ("", "–")  # reported and recomputed on the same row
    assert not any(r["metric"] == "" and "actor/pg_loss" in r["cells"][0] for r in rows)
    assert any(
        "actor/grad_norm" in " ".join(r["cells"]) and "not audited" in " ".join(r["cells"]) for r in rows
    )
    explain = tab.js("[...document.querySelectorAll('#audits-body tr.explain')].map(r => r.innerText)")
    assert len(explain) == 1
    summary = tab.js("document.querySelector('#audits-body tr.explain .summary').textContent")
    assert "seq-mean-token-mean" in summary and "config says token-mean" in summary and len(summary) < 200
    assert tab.js("document.querySelector('#audits-body tr.explain details').open") is False
    tab.page.click("#audits-body tr.explain details summary")
    assert "pg_loss" in tab.js("document.querySelector('#audits-body tr.explain details ul').innerText")
    tab.shot("audits-prefixed")
    tab.assert_clean()


def test_the_run_page_keeps_latest_audits_folded(api, tab, audited):
    tab.open(f"/runs/{audited['run']}", ready="window.RLV && RLV.timing.allCharts")
    tab.wait("!document.getElementById('audits-mini').hidden")
    assert tab.js("document.getElementById('audits-mini').open") is False
    assert "mismatched" in tab.js("document.getElementById('audits-mini-count').textContent")
    height = tab.js("document.getElementById('audits-mini').getBoundingClientRect().height")
    assert height < 60, height  # one line until opened
    tab.assert_clean()


def test_counterfactuals_and_histograms_of_a_batch(tab, audited):
    tab.open(
        f"/runs/{audited['run']}/audits?audit={audited['bad']}", ready="window.RLV && RLV.timing.histograms"
    )
    cf = tab.js("document.getElementById('counterfactuals').textContent")
    for mode in AGG_MODES:
        assert mode in cf
    assert "symmetric" in cf and "clip-higher" in cf

    mask = audited["bad_tensors"]["response_mask"]
    ratio = tab.js(
        """() => { const gd = document.getElementById('hist-ratio');
                   return {sum: gd.data[0].y.reduce((a, b) => a + b, 0),
                           lines: gd.layout.shapes.map(s => [s.name, s.x0])}; }"""
    )
    note = tab.js("document.getElementById('hist-note').textContent")
    outside = int(note.split("; ", 1)[1].split(" ", 1)[0]) if "beyond" in note else 0
    assert ratio["sum"] + outside == int(mask.sum())
    assert dict(ratio["lines"]) == pytest.approx({"clip-low": 0.8, "clip-high": 1.28})
    adv = tab.js("document.getElementById('hist-adv').data[0].y.reduce((a, b) => a + b, 0)")
    assert adv == int(mask.sum())
    tab.shot("audits-page")
    tab.assert_clean()


def test_a_new_audit_appears_live(api, tab, audited):
    tab.open(f"/runs/{audited['run']}/audits", ready="window.RLV && RLV.timing.rendered")
    tab.wait("document.getElementById('live').textContent === 'live'")
    tensors = batch(3)
    sent = time.monotonic()
    audit_id = api.upload_batch(audited["run"], tensors, step=300, config=CONFIG, reported=reported(tensors))
    tab.wait(
        "id => [...document.querySelectorAll(`#audits-body tr[data-audit-id='${id}'] .badge`)].some(b => b.textContent === 'match')",
        str(audit_id),
        timeout=20,
        interval=0.01,
    )
    shown = time.monotonic() - sent
    finished = api.get(f"/api/v1/audits/{audit_id}")
    print(
        f"\nlive audit: upload -> result on the page in {shown * 1000:.0f} ms "
        f"(server audit took {1000 * (finished['finished_at'] - finished['created_at']):.0f} ms)"
    )
    assert shown < 10.0  # sanity only: under a second on an idle machine (bench/latency.py, "live audit")
    tab.assert_clean()
