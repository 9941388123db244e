"""Side environments: the real third-party libraries the tests run against, each in its own venv.

TRL, verl, OpenRLHF and the peer monitors (rldoctor, rlwatch, rlprobe) pin versions of transformers,
numpy and friends that must never leak into the project's ``.venv``. Each lives in ``.sidenv/<name>/``
at the repository root, built by the test command itself (CI starts from a fresh clone)::

    py = ensure("trl", [["torch==2.13.0"], ["trl==1.16.0", "-c", "{constraints}"]])
    subprocess.run([str(py), script, ...], check=True, env={**os.environ, "PYTHONPATH": str(rlvitals_path())})

``steps`` are pip argument lists run in order; ``{constraints}`` in an argument is replaced by a
constraints file pinning ``torch==2.13.0`` (an unpinned torch would pull a multi-GB CUDA build). The env
is rebuilt only when its steps change (a stamp holds their hash) and built once when several pytest
processes ask at the same time (a file lock). A failed build raises :class:`SideEnvError` with pip's
output: the tests that need the library fail, they never skip.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIDE_ENVS = Path(os.environ.get("RLVITALS_SIDEENV_DIR", ROOT / ".sidenv"))
TORCH = "torch==2.13.0"


# Shared recipes: several test modules use the same library, so they share one env (same name, same steps).
VERL = (
    (TORCH,),
    ("verl==0.9.1", "--no-deps"),
    (
        "numpy",
        "packaging",
        "tensordict==0.10.0",
        "transformers==5.10.4",
        "omegaconf",
        "codetiming",
        "orjson",
        "safetensors",
        "-c",
        "{constraints}",
    ),
)
# httpx: the one dependency of rlvitals.client that TRL does not bring (the side env imports this checkout)
TRL = ((TORCH,), ("trl==1.16.0", "httpx", "-c", "{constraints}"))
# the peer training monitors bench/detection.py runs beside rlvitals' rules, on the same inputs
PEERS = (("rldoctor==0.2.0", "rlwatch==0.5.1", "rlprobe==0.1.0", "-c", "{constraints}"),)


class SideEnvError(RuntimeError):
    """A side environment could not be built (the message carries pip's output)."""


def _base_python() -> str:
    # The interpreter the project's venv was made from (a venv's python can't always seed another one).
    return getattr(sys, "_base_executable", None) or shutil.which("python3") or sys.executable


def _run(cmd: list[str], log: Path) -> None:
    with log.open("a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = log.read_text()[-4000:]
        raise SideEnvError(f"side environment step failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")


def _torch_args(args: list[str]) -> list[str]:
    """``torch==2.13.0`` from the local wheel folder when it has one, else PyTorch's CPU index."""
    if TORCH in args and not list(Path("/opt/wheels").glob("torch-2.13.0+cpu-*.whl")):
        return [*args, "--index-url", "https://download.pytorch.org/whl/cpu"]
    return args


def ensure(name: str, steps: Sequence[Sequence[str]]) -> Path:
    """Build (once) and return the python executable of side environment ``name``."""
    env = SIDE_ENVS / name
    python = env / "bin" / "python"
    spec = json.dumps([list(s) for s in steps])
    want = hashlib.sha256(spec.encode()).hexdigest()
    stamp = env / ".rlvitals-sideenv.sha"
    SIDE_ENVS.mkdir(parents=True, exist_ok=True)
    with (SIDE_ENVS / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if python.exists() and stamp.exists() and stamp.read_text() == want:
            return python
        if env.exists():
            shutil.rmtree(env)
        env.mkdir(parents=True)
        log = env / "build.log"
        constraints = env / "constraints.txt"
        constraints.write_text(TORCH + "\n")
        _run([_base_python(), "-m", "venv", str(env)], log)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        for step in steps:
            args = [a.replace("{constraints}", str(constraints)) for a in step]
            _run(pip + _torch_args(args), log)
        stamp.write_text(want)
        return python


def rlvitals_path() -> Path:
    """A folder to put on a side env's ``PYTHONPATH`` so that it imports *this checkout's* rlvitals.

    The project maps top-level folders onto the ``rlvitals`` namespace (see setup.py); a symlink farm
    reproduces that mapping without installing anything into the side env (which several checkouts may
    share through ``RLVITALS_SIDEENV_DIR``).
    """
    farm = ROOT / ".sidenv-src"
    pkg = farm / "rlvitals"
    pkg.mkdir(parents=True, exist_ok=True)
    links = {p.name: p for p in (ROOT / "src" / "rlvitals").iterdir() if p.name != "__pycache__"}
    links.update({n: ROOT / n for n in ("analyzers", "client", "service", "examples")})
    for name, target in links.items():
        link = pkg / name
        if not link.is_symlink():
            if link.exists():
                shutil.rmtree(link) if link.is_dir() else link.unlink()
            link.symlink_to(target)
    return farm
