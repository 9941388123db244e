"""README.md's verl, TRL and OpenRLHF examples against the real trainers, in the side environments.

The side environments (tests/support/sideenv.py: verl 0.9.1, TRL 1.16, OpenRLHF 0.11.2 on CPU torch,
shared with the integration tests, so CI builds each once) import this checkout. In them: the TRL
snippet's imports resolve and `GRPOConfig`/`GRPOTrainer` take the arguments it passes; the verl command's
`VERL_USE_EXTERNAL_MODULES` module registers the `rlvitals` loss it selects in verl's own registry; the
OpenRLHF snippet wraps a real `PolicyLoss`. The trainings themselves need a model download or a GPU and
do not run here (tests/client/test_client_integrations_*.py train through the same hooks).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.sideenv import TRL, VERL, ensure, rlvitals_path
from tests.test_readme import blocks, commands

pytestmark = pytest.mark.timeout(1200)  # a cold side env build on a 2-core machine
GOLDEN = Path(__file__).resolve().parent / "analyzers" / "golden"  # verl_loader: inert stand-ins


def _side(python: Path, code: str, **extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(rlvitals_path()), "PYTHONWARNINGS": "ignore", **extra}
    return subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True, timeout=600)


def test_the_trl_snippet_resolves_against_the_real_trl():
    (code,) = blocks("TRL (`GRPOTrainer`)", "python")
    imports = "\n".join(line for line in code.splitlines() if line.startswith(("from ", "import ")))
    check = imports + (
        "\nimport inspect\n"
        "GRPOConfig(output_dir='out', run_name='grpo-len', max_steps=20, bf16=False)  # no GPU here\n"
        "params = inspect.signature(GRPOTrainer.__init__).parameters\n"
        "assert {'model', 'reward_funcs', 'args', 'train_dataset', 'callbacks'} <= set(params), params\n"
        "print('ok')\n"
    )
    out = _side(ensure("trl", TRL), check)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_the_verl_command_registers_its_loss_in_the_real_verl():
    (exports,) = [c for c in commands("verl 0.9.1") if c.startswith("export VERL_USE_EXTERNAL_MODULES=")]
    module = exports.split("=", 1)[1]
    code = (
        f"import sys, types, importlib.machinery; sys.path.insert(0, {str(GOLDEN)!r})\n"
        "import verl_loader\n"
        "verl_loader._STUBBED = (*verl_loader._STUBBED, 'peft', 'accelerate', 'uvicorn', 'fastapi', 'torchdata', 'cachetools')\n"
        "sys.modules['psutil'] = p = types.ModuleType('psutil')\n"
        "p.__spec__ = importlib.machinery.ModuleSpec('psutil', None)\n"
        "core_algos, _, _ = verl_loader.load_verl()  # `import verl` imports VERL_USE_EXTERNAL_MODULES\n"
        "assert 'rlvitals' in core_algos.POLICY_LOSS_REGISTRY, sorted(core_algos.POLICY_LOSS_REGISTRY)\n"
        "print('ok')\n"
    )
    out = _side(ensure("verl", VERL), code, VERL_USE_EXTERNAL_MODULES=module)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_the_openrlhf_snippet_resolves_against_the_real_openrlhf():
    from tests.client.test_client_integrations_openrlhf import OPENRLHF

    (code,) = blocks("OpenRLHF", "python")
    check = code + (
        f"\nimport sys; sys.path.insert(0, {str(GOLDEN)!r})\n"
        "import verl_loader\n"
        "verl_loader._STUBBED = ('deepspeed', 'peft', 'transformers', 'flash_attn', 'ray', 'vllm', 'aiohttp',"
        " 'pylatexenc', 'torchdata', 'PIL', 'tqdm', 'packaging')\n"
        "sys.meta_path.insert(0, verl_loader._InertFinder())\n"
        "from openrlhf.models import PolicyLoss\n"
        "class T:\n"
        "    actor_loss_fn = PolicyLoss()\n"
        "    global_step = 3\n"
        "t = T()\n"
        "logger = instrument(t)\n"
        "assert type(t.actor_loss_fn).__name__ == 'RecordingPolicyLoss' and logger is not None\n"
        "print('ok')\n"
    )
    out = _side(ensure("openrlhf", OPENRLHF), check)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
