"""The install layout: rlvitals.* namespaces, and no bare top-level client/service modules."""

from __future__ import annotations

import importlib.util
import subprocess
import sys


def test_parts_import_under_the_rlvitals_namespace():
    for name in ("rlvitals", "rlvitals.analyzers", "rlvitals.client", "rlvitals.service"):
        assert importlib.util.find_spec(name) is not None, name


def test_no_generic_top_level_modules_are_installed():
    # Run outside the repo so the checkout itself is not on sys.path.
    code = (
        "import importlib.util as u; print([n for n in ('client','service','analyzers') if u.find_spec(n)])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_wheel_ships_templates_migrations_and_the_demo_trainer(tmp_path):
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(root)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("rlvitals-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "rlvitals/cli.py",
        "rlvitals/analyzers/losses.py",
        "rlvitals/client/run.py",
        "rlvitals/service/app.py",
        "rlvitals/service/alembic.ini",
        "rlvitals/examples/tiny_grpo.py",
    ):
        assert needed in names, needed
    assert any(n.startswith("rlvitals/service/migrations/versions/") for n in names)
    assert any(n.startswith("rlvitals/service/dashboard/templates/") for n in names)
    assert any(n.startswith("rlvitals/service/dashboard/static/") for n in names)
    assert not any(n.split("/")[0] in {"client", "service", "analyzers", "examples", "tests"} for n in names)
