"""The mismatch page in real headless Chromium: a run's gap over steps, where it lives in the chosen
batch, its worst sequences and the alert naming the cause; and two runs compared."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from tests.support.mismatch_runs import run as train

STEPS = 10


@cache
def _steps(kind: str) -> tuple:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return tuple(train(kind, steps=STEPS, sync_until=4))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(api) -> dict[str, int]:
    ids = {}
    for kind in ("bf16", "stale"):
        run = api.create_run(f"mismatch-{kind}", project="dash")
        audits = []
        for s in _steps(kind):
            api.log(run, [{"step": s.step, "metrics": {"actor/lr": 1e-3, "critic/score/mean": s.reward}}])
            audits.append(api.upload_batch(run, s.tensors, step=s.step, config={}, reported={}))
        for audit_id in audits:
            assert api.wait_audit(audit_id)["status"] == "done"
        ids[kind] = run
    api.wait_alert(ids["stale"], "mismatch_trend")
    # the compare view quotes the bf16 run's cause: wait until its rules got there (a loaded machine
    # evaluates the last audits after the page would otherwise have been read)
    api.wait_alert(ids["bf16"], None, timeout=60, says="precision")
    return ids


def test_run_page_shows_the_gap_where_it_lives_and_the_cause(tab, runs):
    run = runs["stale"]
    tab.open(f"/runs/{run}/mismatch", ready="window.RLV && RLV.timing.drawn")
    gap = tab.js("document.getElementById('mm-gap').data.map(t => [t.name, t.x.length])")
    assert gap == [["mean |gap|", STEPS], ["p99 |gap|", STEPS]]
    assert tab.js("document.getElementById('mm-tmpe').data[0].x.length") == STEPS
    # the latest batch in detail: buckets by position, probability, length, group; worst sequences
    assert tab.js("document.getElementById('mm-detail-title').textContent").startswith(
        f"Batch of step {STEPS - 1}"
    )
    assert len(tab.js("document.getElementById('mm-position').data[0].y")) >= 2
    assert len(tab.js("document.getElementById('mm-prob').data[0].y")) == 6
    assert tab.js("document.querySelectorAll('#mm-worst-body tr').length") == 5
    assert tab.js("document.getElementById('mm-tokens').data.length") == 5
    alert = tab.js("document.getElementById('mm-alerts').textContent")
    assert "weight sync" in alert
    # another batch from the picker: the one right after the sync stopped
    options = tab.js("[...document.querySelectorAll('#mm-audit option')].map(o => [o.value, o.textContent])")
    assert len(options) == STEPS
    value = next(v for v, text in options if text.startswith("step 4 "))
    tab.page.select_option("#mm-audit", value)
    tab.wait("document.getElementById('mm-detail-title').textContent.startsWith('Batch of step 4 ')")
    assert f"audit={value}" in tab.page.url
    tab.page.select_option("#mm-audit", options[-1][0])
    tab.wait(
        f"document.getElementById('mm-detail-title').textContent.startsWith('Batch of step {STEPS - 1} ')"
    )
    tab.shot("mismatch-page")
    tab.assert_clean()


def test_compare_view_overlays_runs(tab, runs):
    tab.open(f"/mismatch?runs={runs['bf16']},{runs['stale']}", ready="window.RLV && RLV.timing.drawn")
    names = tab.js("document.getElementById('mm-tmpe').data.map(t => t.name)")
    assert names == [f"mismatch-bf16 (#{runs['bf16']})", f"mismatch-stale (#{runs['stale']})"]
    assert tab.js("document.getElementById('mm-compare-position').data.length") == 2
    assert tab.js("document.getElementById('mm-detail').hidden") is True
    assert "precision" in tab.js("document.getElementById('mm-alerts').textContent")
    tab.shot("mismatch-compare")
    tab.assert_clean()
