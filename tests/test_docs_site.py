"""The documentation site (mkdocs.yml, docs/) builds strictly, with its generated parts.

One strict build of the real site, checked for what cannot drift: every registered health rule and
policy loss in the generated tables, the API reference rendered from the docstrings. Then, on a copy of
the site's sources, what the docs promise a contributor (docs/development.md): a new page under docs/
is in the site without a nav edit, and a broken link or an unknown table marker fails the build.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rlvitals.analyzers.health import RULES
from rlvitals.analyzers.reference.policy_losses import POLICY_LOSSES

# builds the site several times (in make test-fast, the lint step builds it once, strictly)
pytestmark = pytest.mark.heavy

REPO = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).with_name("mkdocs")


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(site)],
        cwd=root, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = build(REPO, out)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def _text(page: Path) -> str:
    return re.sub(r"<[^>]+>", "", page.read_text())


def test_the_generated_tables_hold_every_registered_rule_and_loss(site):
    health = _text(site / "health" / "index.html")
    for rule_id, rule in RULES.items():
        assert re.search(rf"{rule_id}\s*{rule.severity.value}", health), rule_id
    audits = _text(site / "audits" / "index.html")
    for name, loss in POLICY_LOSSES.items():
        assert name in audits and loss.fn.__name__ in audits, name
    assert "<!-- rlvitals:" not in (site / "health" / "index.html").read_text()


def test_the_api_reference_is_rendered_from_the_docstrings(site):
    api = _text(site / "reference" / "api" / "index.html")
    import rlvitals.client.run as run

    assert "log_batch" in api and run.Run.log_batch.__doc__.split("``")[0].split()[0] in api
    assert "HealthMonitor" in api and "LossConfig" in api and "Settings" in api


@pytest.fixture
def sources(tmp_path) -> Path:
    """The site's sources in a scratch folder (the packages linked, as the API reference reads them)."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copytree(REPO / "docs", root / "docs")
    shutil.copy(REPO / "mkdocs.yml", root)
    (root / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "docs_hooks.py", root / "scripts")
    for name in ("analyzers", "client", "service", "src"):
        (root / name).symlink_to(REPO / name)
    return root


def test_a_new_page_is_in_the_site_without_a_nav_edit_and_broken_things_fail(sources, tmp_path):
    (sources / "docs" / "zz-new-page.md").write_text("# A page added later\n\nSee [the client](client.md).\n")
    done = build(sources, tmp_path / "ok")
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "ok" / "zz-new-page" / "index.html").exists()
    assert 'href="zz-new-page/"' in (tmp_path / "ok" / "index.html").read_text()  # in the navigation

    (sources / "docs" / "zz-new-page.md").write_text("# A page\n\n[gone](no-such-page.md)\n")
    broken = build(sources, tmp_path / "broken")
    assert broken.returncode != 0 and "no-such-page.md" in broken.stderr, broken.stderr[-2000:]

    (sources / "docs" / "zz-new-page.md").write_text("# A page\n\n<!-- rlvitals:no-such-table -->\n")
    unknown = build(sources, tmp_path / "unknown")
    assert unknown.returncode != 0 and "no-such-table" in unknown.stderr, unknown.stderr[-2000:]
