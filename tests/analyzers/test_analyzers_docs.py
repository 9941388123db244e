"""The loss-audit page of the docs site (docs/audits.md, as built: its generated tables included)
documents every setting, metric, mode and TRL loss type."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from rlvitals.analyzers import LossConfig
from rlvitals.analyzers.contract.config import AggMode
from rlvitals.analyzers.reference.trl import TRL_LOSS_TYPES
from rlvitals.analyzers.verdicts.auditing import METRICS

from scripts.docs_hooks import render

ROOT = Path(__file__).resolve().parents[2]
DOC = render((ROOT / "docs" / "audits.md").read_text())


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(LossConfig)])
def test_every_loss_config_field_is_documented(name: str) -> None:
    assert f"`{name}`" in DOC


@pytest.mark.parametrize("name", METRICS)
def test_every_metric_has_a_row_with_meaning_range_and_advice(name: str) -> None:
    rows = [line for line in DOC.splitlines() if line.startswith(f"| `{name}` |")]
    assert rows and rows[0].count("|") == 5


@pytest.mark.parametrize("name", [m.value for m in AggMode] + [f"`{t}`" for t in TRL_LOSS_TYPES])
def test_every_mode_and_trl_loss_type_is_documented(name: str) -> None:
    assert name in DOC


def test_every_loss_mode_has_a_formula_row_in_the_loss_pages() -> None:
    from rlvitals.analyzers.reference.policy_losses import LossMode

    losses_doc = (ROOT / "docs" / "losses.md").read_text()
    for mode in LossMode:
        assert any(line.startswith(f"| `{mode.value}`") for line in losses_doc.splitlines()), mode
        assert any(line.startswith(f"| `{mode.value}` |") for line in DOC.splitlines()), mode
        assert "(losses.md)" in DOC
