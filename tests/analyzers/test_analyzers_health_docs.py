"""The health-rules docs cover every built-in rule (docs/health-rules.md: its settings, defaults, advice;
docs/health.md as built: its row in the generated overview table), the common settings and every alias."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rlvitals.analyzers.health import ALIASES, RULES, RuleId
from rlvitals.analyzers.health.registry import COMMON_DEFAULTS

DOC = Path(__file__).resolve().parents[2] / "docs" / "health.md"
REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "health-rules.md"


def _sections() -> dict[str, str]:
    text = REFERENCE.read_text()
    parts = re.split(r"^#### `([a-z_]+)`\s*$", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1].split("\n### ")[0] for i in range(1, len(parts), 2)}


def test_every_builtin_rule_has_a_section():
    assert set(_sections()) == {rule.value for rule in RuleId}


@pytest.mark.parametrize("rule_id", [rule.value for rule in RuleId])
def test_rule_section_documents_each_setting_and_advice(rule_id):
    section = _sections()[rule_id]
    for key, default in RULES[rule_id].defaults.items():
        assert f"`{key}`" in section, f"{rule_id}: setting {key} undocumented"
        if isinstance(default, str):
            shown = {f"`{default}`", f'`"{default}"`'}
        else:  # 0.001 may be written 1e-3
            shown = {f"{default:g}", re.sub(r"e([+-])0(\d)", r"e\1\2", f"{default:.0e}")}
        assert any(form in section for form in shown), f"{rule_id}: default {key}={default} not shown"
    assert "*Advice.*" in section and "*Watches*" in section
    assert f"**{RULES[rule_id].severity.value}**" in section
    assert RULES[rule_id].advice.split(":")[0] in section


def test_rule_ids_appear_in_the_overview_table():
    from scripts.docs_hooks import render

    table = render(DOC.read_text()).split("## The built-in rules")[1].split("\n## ")[0]
    for rule in RuleId:
        assert f"| `{rule.value}` |" in table


def test_common_settings_and_every_alias_are_documented():
    text = DOC.read_text()
    for key in COMMON_DEFAULTS:
        assert f"`{key}`" in text
    for signal, raws in ALIASES.items():
        assert f"`{signal}`" in text
        for raw in raws:
            assert f"`{raw}`" in text, raw


def test_user_rule_snippet_runs_as_documented():
    from rlvitals.analyzers import HealthMonitor
    from rlvitals.analyzers.health import unregister_rule

    block = DOC.read_text().split("## Your own rules")[1].split("```python")[1].split("```")[0]
    namespace: dict = {}
    exec(compile(block, str(DOC), "exec"), namespace)
    try:
        monitor = HealthMonitor(settings={"grad_norm_high": {"threshold": 2.0}})
        findings = [f for step in range(5) for f in monitor.observe(step, {"actor/grad_norm": 3.0})]
        assert [(f.rule, f.state, f.step, f.onset_step) for f in findings] == [
            ("grad_norm_high", "firing", 2, 0)
        ]
        assert findings[0].advice == "Lower the learning rate or tighten gradient clipping."
    finally:
        unregister_rule("grad_norm_high")
