"""Every command and snippet of README.md runs as written.

The README's fenced blocks are read from the file (never copied here), by the section they are in:

- *Try it*: the make targets exist and expand to the scripts the docs name (`make -n`; running them is
  the suite itself and the demo, tested in tests/test_first_hour.py);
- *Install*: each `pip install` line resolves against this checkout (`pip install --dry-run`), and
  `rlvitals --version` / `rlvitals serve` run (serve on a free port: 8000 may be taken on a shared machine);
- *A plain PyTorch loop*: the snippet runs as a script against a real `rlvitals serve` and every sampled
  step's audit agrees with what it reported;
- *A run that was never instrumented*: both import commands run on files made for them (the URL pointed at
  the test's server);
- *verl*, *TRL*, *OpenRLHF*: the Python compiles and the names it imports from rlvitals resolve; the
  verl command names the module and loss that exist. Against the real trainers: tests/test_readme_sideenv.py.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.servers import free_port, start_server

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
VENV_BIN = Path(sys.executable).parent


def blocks(section: str, lang: str) -> list[str]:
    """The ``lang`` fenced blocks under the ``## section`` heading."""
    parts = re.split(r"^## ", README, flags=re.MULTILINE)
    (body,) = [p for p in parts if p.startswith(section)]
    found = re.findall(rf"^```{lang}\n(.*?)^```", body, flags=re.MULTILINE | re.DOTALL)
    assert found, f"no {lang} block under ## {section}"
    return found


def commands(section: str) -> list[str]:
    """The shell commands of a section's bash blocks: comments dropped, continuation lines joined."""
    text = "\n".join(blocks(section, "bash")).replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in text.splitlines() if line.strip() and line[0] != "#"]


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("timeout", 300)
    return subprocess.run(argv, capture_output=True, text=True, **kwargs)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLVITALS_")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return {**env, "PYTHONWARNINGS": "ignore", **extra}


# --- the README's shape --------------------------------------------------------------------------------


def test_the_readme_fits_on_a_few_screens_and_says_what_the_suite_needs():
    assert len(README.splitlines()) <= 300
    assert "about 40 minutes" in README and "../shared/real_logs" in README and "13 " in README
    assert "make test-fast" in README
    for trainer in ("A plain PyTorch loop", "verl 0.9.1", "TRL (`GRPOTrainer`)", "OpenRLHF"):
        assert f"\n## {trainer}\n" in README, trainer
    assert not re.search(r"\bissue \d|wave-\d|before issue", README, flags=re.IGNORECASE)


# --- Try it, Install ---------------------------------------------------------------------------------


def test_the_make_targets_exist():
    for command in commands("Try it"):
        argv = shlex.split(command)
        assert argv[0] == "make", command
        out = run(["make", "-n", *argv[1:]], cwd=REPO, timeout=30)
        assert out.returncode == 0, out.stderr
        assert "scripts/" in out.stdout, out.stdout


def test_make_test_fast_leaves_out_the_side_environments_browser_docker_packaging_and_heavy_tests():
    assert "make test-fast" in README
    out = run(["make", "-n", "test-fast"], cwd=REPO, timeout=30)
    assert out.returncode == 0, out.stderr
    assert (
        'RLVITALS_TEST_MARKERS="not sideenv and not browser and not docker and not slow and not heavy"'
        " bash scripts/test.sh" in out.stdout
    )
    # smaller budgets in the edit-test loop only: `make test` (CI) draws every fuzzer's full budget
    assert "RLVITALS_TEST_EXAMPLES=0.25" in out.stdout and "RLVITALS_FAULT_OUTAGE_S=5" in out.stdout
    full = run(["make", "-n", "test"], cwd=REPO, timeout=30)
    assert full.returncode == 0 and "RLVITALS_TEST_" not in full.stdout and "OUTAGE" not in full.stdout
    script = (REPO / "scripts" / "test.sh").read_text()
    assert 'pytest -m "$RLVITALS_TEST_MARKERS"' in script and "mkdocs build --strict" in script
    markers = (REPO / "pyproject.toml").read_text()
    for marker in ("sideenv:", "browser:", "docker:", "slow:", "heavy:"):
        assert marker in markers, marker  # registered: an unknown mark would only warn
    # `make test` selects no marks: the tests left out of test-fast (`heavy` ones included) all run there
    assert "-m" not in full.stdout.split("scripts/test.sh", 1)[1].split("\n", 1)[0]


@pytest.mark.heavy
def test_the_install_lines_resolve_and_the_commands_run(tmp_path):
    cmds = commands("Install")
    pips = [c for c in cmds if c.startswith("pip install")]
    assert len(pips) == 3 and "torch==2.13.0" in pips[0], pips
    for command in pips:
        # --dry-run --no-deps: what pip would install from this line, without touching the venv
        argv = [sys.executable, "-m", *shlex.split(command), "--dry-run", "--no-deps", "--no-build-isolation"]
        out = run(argv, cwd=REPO, env=_env())
        assert out.returncode == 0, (command, out.stdout[-2000:], out.stderr[-2000:])
        want = "torch" if "torch" in command else "rlvitals"
        assert re.search(rf"(Would install|already satisfied).*{want}", out.stdout, re.I), out.stdout
    assert "rlvitals --version" in cmds
    version = run(shlex.split("rlvitals --version"), env=_env(), timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("rlvitals 0."), version
    (serve,) = [c for c in cmds if c.startswith("rlvitals serve")]
    port = free_port()
    proc = subprocess.Popen(
        [*shlex.split(serve), "--port", str(port)], cwd=tmp_path, env=_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None, "rlvitals serve did not start"
                time.sleep(0.2)
        assert (tmp_path / ".rlvitals" / "rlvitals.db").exists()  # where the README says the data goes
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# --- A plain PyTorch loop, against a real server -------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("readme-server")
    proc = start_server(database_url=f"sqlite:///{work / 'r.db'}", workdir=work)
    yield proc
    proc.stop()


def _audits(url: str, run_id: int, want: int) -> list[dict]:
    deadline = time.monotonic() + 120
    while True:
        data = httpx.get(f"{url}/api/v1/runs/{run_id}/audits", timeout=10).json()["data"]
        if len(data) >= want and all(a["status"] in ("done", "error") for a in data):
            return data
        assert time.monotonic() < deadline, data
        time.sleep(0.5)


@pytest.mark.heavy
def test_the_plain_loop_runs_as_written_and_its_audits_agree(server, tmp_path):
    (code,) = blocks("A plain PyTorch loop", "python")
    script = tmp_path / "plain_loop.py"
    script.write_text(code)
    out = run([sys.executable, str(script)], cwd=tmp_path, env=_env(RLVITALS_URL=server.url), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = httpx.get(f"{server.url}/api/v1/runs", params={"include": "config"}, timeout=10).json()["data"]
    (info,) = [r for r in runs if r["name"] == "plain-loop"]
    assert info["last_step"] == 29 and info["config"]["loss_agg_mode"] == "token-mean"
    assert f"{server.url}/runs/{info['id']}/audits" in out.stdout
    audits = _audits(server.url, info["id"], want=3)
    assert sorted(a["step"] for a in audits) == [0, 10, 20]
    for audit in audits:
        assert audit["status"] == "done", audit
        assert set(audit["verdicts"]) == {"pg_loss", "pg_clipfrac", "ppo_kl"}
        assert all(v["ok"] for v in audit["verdicts"].values()), audit
    # the later updates of a rollout are off-policy: the example shows clipping, not a trivial audit
    assert any(a["reported"]["pg_clipfrac"] > 0 for a in audits)


# --- A run that was never instrumented ----------------------------------------------------------------


def test_the_import_commands_run_on_the_files_they_name(server, tmp_path):
    cmds = commands("A run that was never instrumented")
    assert len(cmds) == 2
    steps = [{"step": s, "data": {"actor/ppo_kl": 0.001, "actor/entropy": 1.0}} for s in range(1, 30)]
    with gzip.open(tmp_path / "exp.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(s) + "\n" for s in steps)
    state = tmp_path / "out" / "checkpoint-500" / "trainer_state.json"
    state.parent.mkdir(parents=True)
    history = [
        {"step": s, "loss": 0.1, "kl": 0.001, "entropy": 1.0, "clip_ratio/region_mean": 0.1}
        for s in range(1, 30)
    ]
    state.write_text(json.dumps({"log_history": history, "logging_steps": 1}))
    for command in cmds:
        argv = shlex.split(command.replace("http://127.0.0.1:8000", server.url))
        out = run(argv, cwd=tmp_path, env=_env(), timeout=180)
        assert out.returncode == 0, (command, out.stdout[-2000:], out.stderr[-2000:])
        if "--url" in argv:  # the upload says where to look
            assert re.search(rf"^dashboard: {re.escape(server.url)}/runs/\d+$", out.stdout, re.M), out.stdout
    runs = httpx.get(f"{server.url}/api/v1/runs", timeout=10).json()["data"]
    assert any(r["last_step"] == 29 and r["name"] != "plain-loop" for r in runs), runs  # the upload


# --- verl, TRL, OpenRLHF: compiled, imports resolved --------------------------------------------------


def _imports(code: str) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom):
            found.append((node.module, [a.name for a in node.names]))
    return found


@pytest.mark.parametrize("section", ["TRL (`GRPOTrainer`)", "OpenRLHF"])
def test_the_trainer_snippets_compile_and_import_what_exists_here(section):
    (code,) = blocks(section, "python")
    compile(code, f"README.md ({section})", "exec")
    ours = [(m, names) for m, names in _imports(code) if m.startswith("rlvitals")]
    assert ours
    for module, names in ours:
        imported = __import__(module, fromlist=names)
        for name in names:  # a name built on first use needs the trainer (the side env test resolves it)
            assert name in getattr(imported, "__all__", ()) or hasattr(imported, name), f"{module}.{name}"


def test_the_verl_command_names_a_module_that_exists_here():
    cmds = commands("verl 0.9.1")
    (exports,) = [c for c in cmds if "VERL_USE_EXTERNAL_MODULES" in c]
    module = exports.split("=", 1)[1]
    from rlvitals.client.integrations import verl

    assert module == verl.__name__ and verl.LOSS_MODE == "rlvitals"
    (launch,) = [c for c in cmds if c.startswith("python -m verl.trainer.main_ppo")]
    assert f"actor_rollout_ref.actor.policy_loss.loss_mode={verl.LOSS_MODE}" in launch
    assert """trainer.logger='["console","file"]'""" in launch  # the file logger the import tails
    (follow,) = [c for c in cmds if c.startswith("rlvitals import")]
    from rlvitals.cli import build_parser

    args = build_parser().parse_args(shlex.split(follow)[1:])  # it tails forever: parsed, not run
    (logger_path,) = [c.split("=", 1)[1] for c in cmds if c.startswith("export VERL_FILE_LOGGER_PATH=")]
    assert args.follow and args.file == logger_path and args.name == "exp-42" and args.project == "grpo"
