"""mkdocs hooks: tables generated from the registries at build time, so the docs cannot drift.

A page asks for a table with a marker line, replaced when the site is built:

- ``<!-- rlvitals:health-rules-table -->``: every registered health rule (``rlvitals.analyzers.health.RULES``):
  id, default severity, the signal it watches, what fires it, its settings with their defaults, and
  the real run behind it;
- ``<!-- rlvitals:loss-table -->``: every registered policy loss
  (``rlvitals.analyzers.reference.policy_losses.POLICY_LOSSES``): ``loss_mode``, its function, the formula from
  the function's docstring, whether ``loss_agg_mode`` applies and whether it is audited as a range.

A marker that names no known table fails the build (a typo must not leave a page without its table).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# analyzers/, client/ and service/ install as rlvitals.* (setup.py's package_dir): the API reference reads
# them through a tree of links laid out as the installed package is (mkdocs.yml's mkdocstrings paths)
API_TREE = ROOT / "build" / "docs-api"
PACKAGE_DIRS = {"analyzers": "analyzers", "client": "client", "service": "service"}

MARKER = re.compile(r"^<!-- rlvitals:([\w-]+) -->$", re.MULTILINE)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _value(value: object) -> str:
    return (
        f'"{value}"' if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)
    )


def health_rules_table() -> str:
    from rlvitals.analyzers.health import RULES

    rows = [
        "| rule id | default severity | watches | fires when | settings (defaults) | evidence |",
        "|---|---|---|---|---|---|",
    ]
    for rule_id, rule in RULES.items():
        settings = ", ".join(f"`{k}` {_value(v)}" for k, v in rule.defaults.items()) or "—"
        signal = f"`{rule.signal}`" if rule.signal and rule.signal != "*" else "every metric"
        rows.append(
            f"| `{rule_id}` | {rule.severity.value} | {signal} | {_cell(rule.summary)} | {settings} "
            f"| {_cell(rule.evidence_note) or '—'} |"
        )
    return "\n".join(rows)


def _formula(fn) -> str:
    doc = (fn.__doc__ or "").strip().split("\n\n")[0]
    return _cell(doc.replace("``", "`")) or "—"


def loss_table() -> str:
    from rlvitals.analyzers.reference.policy_losses import POLICY_LOSSES

    rows = [
        "| `loss_mode` | function | per-token loss and metrics (from its docstring) | `loss_agg_mode` applies | audited as |",
        "|---|---|---|---|---|",
    ]
    for name, loss in POLICY_LOSSES.items():
        rows.append(
            f"| `{name}` | `{loss.fn.__name__}` | {_formula(loss.fn)} | {'yes' if loss.uses_agg_mode else 'no'} "
            f"| {'a range (random draw)' if loss.random else 'an exact value'} |"
        )
    return "\n".join(rows)


TABLES = {"health-rules-table": health_rules_table, "loss-table": loss_table}


def render(markdown: str) -> str:
    """``markdown`` with every table marker replaced by its table (KeyError on an unknown marker)."""

    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in TABLES:
            raise KeyError(f"unknown rlvitals table marker {name!r}; known: {', '.join(TABLES)}")
        return TABLES[name]()

    return MARKER.sub(replace, markdown)


def _api_tree() -> None:
    package = API_TREE / "rlvitals"
    package.mkdir(parents=True, exist_ok=True)
    links = {name: ROOT / folder for name, folder in PACKAGE_DIRS.items()}
    links.update({f.name: f for f in (ROOT / "src" / "rlvitals").glob("*.py")})
    for name, target in links.items():
        link = package / name
        if link.is_symlink() and link.resolve() == target:
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)


def on_startup(**kwargs) -> None:
    # before any config event: mkdocstrings resolves its search paths when the config is validated
    _api_tree()


def on_page_markdown(markdown: str, **kwargs) -> str:
    return render(markdown)
