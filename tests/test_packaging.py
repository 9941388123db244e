"""The package: the install layout (rlvitals.* namespaces, no bare top-level client/service modules), one
`python -m build` (sdist, and the wheel built from it) that `twine check` passes, and that wheel and sdist
installed into fresh virtual environments — the sdist with no C compiler — where `rlvitals --version`,
`rlvitals serve`, the demo and an import run."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import httpx
import pytest
import tomllib

from tests.support.servers import free_port

REPO = Path(__file__).resolve().parents[1]
# the build compiles the token passes and each fresh venv installs torch: minutes on a loaded 2-core machine
pytestmark = [pytest.mark.timeout(2400), pytest.mark.slow]


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


# --- one build, reused: sdist and wheel (the wheel built from the sdist, as `python -m build` does) ------


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(REPO)],
        capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (sdist,) = out.glob("rlvitals-*.tar.gz")
    (wheel,) = out.glob("rlvitals-*.whl")
    return {"sdist": sdist, "wheel": wheel}


def test_the_version_is_one_number_everywhere():
    import rlvitals

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert rlvitals.__version__ == project["version"]
    assert f"## [{project['version']}]" in (REPO / "CHANGELOG.md").read_text()
    out = subprocess.run([sys.executable, "-m", "rlvitals.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"rlvitals {project['version']}", out


def test_sdist_and_wheel_pass_twine_check(dist):
    out = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(dist["sdist"]), str(dist["wheel"])],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    with tarfile.open(dist["sdist"]) as sdist:
        names = sdist.getnames()
    root = dist["sdist"].name.removesuffix(".tar.gz")
    for needed in ("README.md", "CHANGELOG.md", "pyproject.toml", "setup.py", "analyzers/csrc/_fused.c"):
        assert f"{root}/{needed}" in names, needed


def test_wheel_ships_templates_migrations_and_the_demo_trainer(dist):
    names = set(zipfile.ZipFile(dist["wheel"]).namelist())
    for needed in (
        "rlvitals/cli.py",
        "rlvitals/analyzers/reference/losses.py",
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
    assert any(
        n.startswith("rlvitals/analyzers/_fused") and n.endswith(".so") for n in names
    )  # compiled here


# --- fresh virtual environments: the wheel as built, and the sdist without a C compiler -------------


def _fresh_venv(folder: Path, *install: str, env: dict[str, str] | None = None) -> Path:
    """A new venv (no site packages of this one) with ``install`` pip-installed; returns its bin/."""
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True, timeout=300)
    bin_dir = folder / "bin"
    # torch first, CPU, as the README says (the machine's pip config finds the local CPU wheel)
    for step in (["torch==2.13.0"], list(install)):
        out = subprocess.run(
            [str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", *step],
            capture_output=True, text=True, timeout=1200, env={**os.environ, **(env or {})},
        )  # fmt: skip
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return bin_dir


def _smoke(bin_dir: Path, tmp_path: Path) -> dict[str, str]:
    """`rlvitals --version`, `serve` (until /healthz answers), the demo (2 steps) and a .gz import."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLVITALS_", "PYTHON"))}
    env.update(HOME=str(tmp_path), PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")
    rlvitals = str(bin_dir / "rlvitals")
    version = subprocess.run([rlvitals, "--version"], capture_output=True, text=True, env=env, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("rlvitals "), version
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        serve = subprocess.Popen([rlvitals, "serve", "--port", str(port)], cwd=tmp_path, env=env,
                                 stdout=sink, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                if health.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert serve.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "rlvitals serve never answered /healthz"
            time.sleep(0.5)
        gz = tmp_path / "exp.jsonl.gz"
        lines = [{"step": s, "data": {"actor/ppo_kl": 0.001, "actor/entropy": 1.0}} for s in range(1, 21)]
        gz.write_bytes(gzip.compress("".join(json.dumps(line) + "\n" for line in lines).encode()))
        imported = subprocess.run(
            [rlvitals, "import", "verl-jsonl", str(gz), "--url", f"http://127.0.0.1:{port}"],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert imported.returncode == 0, imported.stdout + imported.stderr
        assert f"dashboard: http://127.0.0.1:{port}/runs/" in imported.stdout, imported.stdout
    finally:
        serve.terminate()
        serve.wait(timeout=30)
    demo = subprocess.run(
        [rlvitals, "demo", "--steps", "2", "--no-keep-serving", "--port", str(free_port())],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "Dashboard: http://" in demo.stdout, demo.stdout
    native = subprocess.run(
        [str(bin_dir / "python"), "-c", "from rlvitals.analyzers.fast import native; print(native.STATUS)"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert native.returncode == 0, native.stderr
    return {"native": native.stdout.strip()}


@pytest.mark.sideenv  # builds fresh virtual environments: minutes
def test_the_wheel_installs_in_a_fresh_venv_and_serves(dist, tmp_path):
    bin_dir = _fresh_venv(tmp_path / "venv", f"{dist['wheel']}[server]")
    assert _smoke(bin_dir, tmp_path)["native"].startswith("compiled"), "the wheel's token passes"


@pytest.mark.sideenv
def test_the_sdist_installs_without_a_c_compiler(dist, tmp_path):
    no_cc = {"CC": "/bin/false", "CXX": "/bin/false", "LDSHARED": "/bin/false"}
    bin_dir = _fresh_venv(tmp_path / "venv", f"{dist['sdist']}[server]", env=no_cc)
    # built without the compiled passes: the audit runs torch ops, and says so
    assert _smoke(bin_dir, tmp_path)["native"].startswith("not built"), "no compiler, no extension"
