"""Server-side plugins: a package installed with pip declares a policy loss, an aggregation mode, a KL
estimator, an advantage estimator and a health rule as entry points; ``rlvitals serve`` loads them,
says so at start-up, and audits a batch of the custom loss over HTTP like a built-in one.

The plugin (tests/data/plugin_pkg) is installed by pip into a directory of its own that only the server
processes see (``PYTHONPATH``), so the rest of the suite keeps the built-in registries."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tests.service.batchdata import OCTET, make_batch, wait_done

PLUGIN = Path(__file__).parents[1] / "data" / "plugin_pkg"


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("plugin-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(PLUGIN)],
        check=True, capture_output=True, timeout=180,
    )  # fmt: skip
    assert (target / "rlvitals_demo_plugin-0.3.0.dist-info" / "entry_points.txt").is_file()
    return target


def _plugin_module(name: str):
    """The plugin's module, loaded from its source for the expected numbers (registers nothing here)."""
    path = PLUGIN / "rlvitals_demo_plugin" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_demo_plugin_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Config:  # what the plugin's loss reads from verl's config: the global-batch normalisers
    @property
    def global_batch_info(self) -> dict:
        return {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None, "loss_scale_factor": None}


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b, t = 4, 24
    old = -torch.rand(b, t, generator=gen) * 2 - 0.1
    mask = torch.ones(b, t)
    mask[:, 18:] = 0
    rewards = torch.zeros(b, t)
    rewards[:, 17] = torch.tensor([1.0, 0.0, 1.0, 0.5])
    losses = _plugin_module("losses")
    adv, _ = losses.centered_outcome(rewards, mask)
    return {
        "old_log_prob": old,
        "log_prob": old + 0.3 * torch.randn(b, t, generator=gen),
        "ref_log_prob": old + 0.1 * torch.randn(b, t, generator=gen),
        "advantages": adv,
        "token_level_rewards": rewards,
        "response_mask": mask,
    }


CONFIG = {
    "actor_rollout_ref": {
        "actor": {
            "policy_loss": {"loss_mode": "tanh_pg"},
            "loss_agg_mode": "token-sum-half",
            "use_kl_loss": True,
            "kl_loss_type": "k1sq",
            "kl_loss_coef": 0.01,
        }
    },
    "algorithm": {"adv_estimator": "centered_outcome"},
}


def _honest(tensors) -> dict[str, float]:
    losses = _plugin_module("losses")
    mask = tensors["response_mask"]
    pg_loss, metrics = losses.compute_policy_loss_tanh(
        tensors["old_log_prob"], tensors["log_prob"], tensors["advantages"], mask, "token-mean", _Config()
    )
    # the run's agg mode is the plugin's token-sum-half: half the masked token sum
    per_token = -tensors["advantages"] * torch.tanh(
        torch.exp(tensors["log_prob"] - tensors["old_log_prob"]) - 1
    )
    pg_half = float((per_token * mask).sum() / 2)
    kl = float((((tensors["log_prob"] - tensors["ref_log_prob"]) ** 2) * mask).sum() / 2)
    assert pg_loss.item() != pg_half  # token-mean and the plugin's mode differ: the mode is audited
    return {
        "actor/pg_loss": pg_half,
        "actor/ppo_kl": float(metrics["ppo_kl"]),
        "actor/kl_loss": kl,
    }


def _upload(url: str, run_id: int, step: int, tensors, reported) -> dict:
    body = make_batch(step, tensors=tensors, config=CONFIG, reported=reported)
    with httpx.Client(base_url=url, timeout=30) as api:
        response = api.post(f"/api/v1/runs/{run_id}/batches", content=body, headers=OCTET)
        assert response.status_code == 202, response.text
        return wait_done(api, response.json()["id"], timeout=60)


def _run(url: str) -> int:
    response = httpx.post(f"{url}/api/v1/runs", json={"name": "plugin", "config": CONFIG}, timeout=30)
    assert response.status_code == 201, response.text
    return response.json()["id"]


@pytest.mark.heavy
def test_a_plugin_loss_is_audited_over_http_and_its_rule_fires(serve, plugin_dir, database_url):
    server = serve(database_url, env={"PYTHONPATH": str(plugin_dir)})
    banner = server.log()
    for entry in ("policy_losses:tanh_pg", "agg_modes:token-sum-half", "kl_estimators:k1sq",
                  "adv_estimators:centered_outcome", "health_rules:pg_loss_far_negative"):  # fmt: skip
        assert f"{entry} (rlvitals-demo-plugin 0.3.0)" in banner, banner
    run_id = _run(server.url)
    tensors = _tensors()
    honest = _honest(tensors)
    good = _upload(server.url, run_id, 1, tensors, honest)
    assert good["status"] == "done" and good["ok"] is True, good.get("explanation")
    assert {"pg_loss", "ppo_kl", "kl_loss"} <= set(good["verdicts"])
    assert all(v["ok"] for v in good["verdicts"].values()), good["verdicts"]
    # the plugin's advantage estimator reproduces the sent advantages
    assert good["advantages"]["estimator"] == "centered_outcome" and good["advantages"]["ok"] is True
    # a trainer that aggregated with token-mean instead of the configured plugin mode is caught
    tampered = {
        **honest,
        "actor/pg_loss": honest["actor/pg_loss"] * 2 / float(tensors["response_mask"].sum()),
    }
    bad = _upload(server.url, run_id, 2, tensors, tampered)
    assert bad["ok"] is False and not bad["verdicts"]["pg_loss"]["ok"]
    assert "pg_loss: reported" in bad["explanation"]
    # the plugin's health rule runs on the server like a built-in one
    with httpx.Client(base_url=server.url, timeout=30) as api:
        steps = [{"step": s, "metrics": {"actor/pg_loss": -50.0}} for s in range(3, 6)]
        assert api.post(f"/api/v1/runs/{run_id}/metrics", json={"steps": steps}).status_code == 200
        alerts = api.get(f"/api/v1/runs/{run_id}/alerts", params={"state": "firing"}).json()["data"]
    assert "pg_loss_far_negative" in {a["rule"] for a in alerts}, alerts


def test_without_the_plugin_the_custom_loss_is_refused_at_the_door(serve, plugin_dir):
    server = serve(env={"PYTHONPATH": str(plugin_dir), "RLVITALS_PLUGINS": "0"})
    assert "plugins off" in server.log()
    response = httpx.post(f"{server.url}/api/v1/runs", json={"name": "p", "config": CONFIG}, timeout=30)
    if response.status_code == 201:  # the run config is not audited at creation: the batch is refused
        body = make_batch(1, tensors=_tensors(), config=CONFIG, reported={"actor/pg_loss": 0.0})
        response = httpx.post(
            f"{server.url}/api/v1/runs/{response.json()['id']}/batches",
            content=body,
            headers=OCTET,
            timeout=30,
        )
    assert response.status_code == 422, response.text
    assert "token-sum-half" in response.json()["error"]["message"]


@pytest.mark.heavy
def test_a_broken_plugin_stops_the_server_with_the_reason(tmp_path, plugin_dir):
    broken = tmp_path / "broken"
    dist = broken / "broken_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[rlvitals.policy_losses]\nvanilla = json:loads\n")
    result = subprocess.run(
        [sys.executable, "-m", "rlvitals.cli", "serve", "--port", "0",
         "--database-url", f"sqlite:///{tmp_path / 'b.db'}"],
        env={**__import__("os").environ, "PYTHONPATH": str(broken)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "broken-plugin 1.0" in result.stderr and "'vanilla' is already registered" in result.stderr


def test_load_plugins_is_idempotent_and_reports_the_distribution(plugin_dir):
    script = (
        "from rlvitals.analyzers.plugins import load_plugins\n"
        "from rlvitals.analyzers.reference.policy_losses import POLICY_LOSSES\n"
        "first = load_plugins(); second = load_plugins()\n"
        "assert [str(p) for p in first] == [str(p) for p in second], (first, second)\n"
        "assert 'tanh_pg' in POLICY_LOSSES\n"
        "print(len(first))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env={**__import__("os").environ, "PYTHONPATH": str(plugin_dir)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "5"
