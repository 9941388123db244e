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
    assert explanation.startswith("pg_loss")
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
        timeout=10,
        interval=0.01,
    )
    shown = time.monotonic() - sent
    finished = api.get(f"/api/v1/audits/{audit_id}")
    print(
        f"\nlive audit: upload -> result on the page in {shown * 1000:.0f} ms "
        f"(server audit took {1000 * (finished['finished_at'] - finished['created_at']):.0f} ms)"
    )
    assert shown < 1.0
    tab.assert_clean()
