"""The Docker image's build stage can build the package from exactly what it copies.

No Docker engine runs here, so the test does what `docker build` would do with the files: it makes the
build context (the checkout minus .dockerignore), replays the build stage's COPY lines into an empty
folder, and builds the wheel there (`pip wheel --no-deps`, the same setup.py the image's
`pip install ".[server]"` runs). The wheel must hold every file the checkout's own wheel holds: a
package directory that setup.py maps but the Dockerfile forgets (examples/ once) fails here.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.service.test_service_compose import dockerfile_instructions

pytestmark = pytest.mark.slow  # builds the wheel (minutes)

REPO = Path(__file__).resolve().parents[1]


def _ignore_patterns() -> list[re.Pattern]:
    """.dockerignore as Docker reads it: paths from the context root, `**` any number of folders,
    `*` and `?` within one name; an excluded folder excludes everything under it."""
    patterns = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        assert not line.startswith("!"), "exceptions are not modelled here; extend the test"
        rx = ""
        for part in re.split(r"(\*\*/|\*\*|\*|\?)", line.strip("/")):
            rx += {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(part, re.escape(part))
        patterns.append(re.compile(rx + "(?:/.*)?"))
    return patterns


def _context(dest: Path, *, dockerignore: bool = True) -> Path:
    """The build context Docker would send: every file of the checkout that .dockerignore keeps."""
    patterns = _ignore_patterns() if dockerignore else []
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for rel in tracked:
        if any(p.fullmatch(rel) for p in patterns) or not (REPO / rel).is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel)
    return dest


def _build_stage_copies() -> list[list[str]]:
    """The COPY lines of the stage that builds the package (the one whose RUN installs "."), in order."""
    stage: list[tuple[str, str]] = []
    for op, args in dockerfile_instructions():
        if op == "FROM":
            stage = []
        stage.append((op, args))
        if op == "RUN" and re.search(r"pip install [\"']?\.(\[|[\"' ]|$)", args):
            return [shlex.split(a) for o, a in stage if o == "COPY" and "--from" not in a]
    raise AssertionError("no build stage runs `pip install .`")


def _replay(context: Path, dest: Path) -> Path:
    """COPY src... dst relative to WORKDIR (a folder source copies its contents, as Docker does)."""
    for *sources, target in _build_stage_copies():
        for src in sources:
            origin = context / src
            assert origin.exists(), f"COPY {src}: not in the build context (.dockerignore excludes it?)"
            where = dest / target
            if origin.is_dir():
                shutil.copytree(origin, where, dirs_exist_ok=True)
            else:
                where = where / origin.name if target.endswith("/") else where
                where.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, where)
    return dest


def _wheel_names(source: Path, out: Path) -> set[str]:
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, f"pip wheel failed in {source}:\n{build.stdout}\n{build.stderr}"
    (wheel,) = out.glob("rlvitals-*.whl")
    return {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}


def test_the_wheel_builds_from_exactly_the_files_the_dockerfile_copies(tmp_path):
    context = _context(tmp_path / "context")
    image_src = _replay(context, tmp_path / "src")
    from_image = _wheel_names(image_src, tmp_path / "wheel-image")
    from_checkout = _wheel_names(
        _context(tmp_path / "checkout", dockerignore=False), tmp_path / "wheel-checkout"
    )
    assert "rlvitals/examples/tiny_grpo.py" in from_image  # `rlvitals demo` runs inside the image
    assert "rlvitals/service/dashboard/static/js/run.js" in from_image
    assert any(n.startswith("rlvitals/service/migrations/versions/") for n in from_image)
    assert from_checkout - from_image == set(), "the image's wheel lacks files the checkout's has"
