"""The floor plan of analyzers/ holds: lint-imports checks the contracts of pyproject.toml
([tool.importlinter]: the one-way layers contract -> reference -> fast -> verdicts, health reading the
contract only, no import cycle, no web stack). The lint step runs it too; this keeps `pytest` honest alone."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_import_contracts_of_analyzers_hold():
    lint_imports = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run(
        [str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout
