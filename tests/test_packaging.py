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
    code = "import importlib.util as u; print([n for n in ('client','service','analyzers') if u.find_spec(n)])"
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
