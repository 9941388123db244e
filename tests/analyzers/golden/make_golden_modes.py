"""Regenerate the verl 0.9.1 golden fixture for every policy loss mode (test_analyzers_parity.py).

Needs the real verl 0.9.1 in its side environment (never the project's .venv)::

    RLVITALS_SIDEENV_DIR=/work/sidenv .venv/bin/python -c \\
        "from tests.support.sideenv import ensure, VERL; print(ensure('verl', VERL))"
    PYTHONPATH=.sidenv-src /work/sidenv/verl/bin/python tests/analyzers/golden/make_golden_modes.py

Every case goes through verl's own ``workers.utils.losses.ppo_loss`` with a real ``FSDPActorConfig``
whose ``policy_loss`` is a real ``PolicyLossConfig`` (only ``no_padding_2_padding`` is bypassed: the
tensors are already padded). The grid: every registered loss mode x every agg mode x float32/float64 x
with/without ``rollout_is_weights`` x local/global normalisation (480 cases), small ragged batches.
``clip_cov`` draws with ``torch.randperm``: each case stores the seed set right before verl's call.
Then what lies under the mask (rlvitals' sparse and dense batches): every loss mode x token-mean /
seq-mean-token-mean x float32/float64 x two kinds of garbage in the padding of right-padded rows,
finite values whose loss overflows (A = -max/2 against r = e^5, logp = -4) and NaN in every input (96
cases, tagged ``garbage:mask-overflow`` / ``garbage:mask-nan``). Those were appended on 2026-12-03 to
the stored first 480, whose inputs a rerun reproduces bit for bit and whose verl numbers only to
float32 rounding (torch's reductions depend on the thread count). Outputs, next to this script:
``verl_0_9_1_modes.safetensors`` and ``verl_0_9_1_modes.json``.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from verl_loader import load_verl  # noqa: E402

SEED = 20261201
AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
]
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _mask(
    rng: random.Random, g: torch.Generator, b: int, t: int, allow_empty: bool
) -> tuple[torch.Tensor, str]:
    kind = rng.choice(
        ["ragged", "ragged", "scattered", "full", "empty-rows"] + (["empty"] if allow_empty else [])
    )
    if kind == "full":
        return torch.ones(b, t, dtype=torch.bool), kind
    if kind == "empty":
        return torch.zeros(b, t, dtype=torch.bool), kind
    if kind == "scattered":
        mask = torch.rand(b, t, generator=g) < rng.uniform(0.3, 0.9)
    else:
        lengths = torch.randint(1, t + 1, (b,), generator=g)
        if kind == "empty-rows":
            lengths[0] = 0
        mask = torch.arange(t)[None, :] < lengths[:, None]
    if not bool(mask.any()):
        mask[-1, 0] = True
    return mask, kind


def _tensors(rng: random.Random, g: torch.Generator, mode: str) -> tuple[dict[str, torch.Tensor], str]:
    b, t = rng.randint(2, 6), rng.choice([3, 8, 17, 24])
    mask, kind = _mask(rng, g, b, t, allow_empty=mode != "bypass_mode")  # verl's bypass refuses it
    f64 = torch.float64
    log_prob = -torch.rand(b, t, generator=g, dtype=f64) * rng.choice([0.5, 3.0])
    spread = rng.choice([0.02, 0.2, 0.6])
    if mode in ("clip_cov", "kl_cov"):  # covariances inside (lb, ub) = (1, 5) need spread-out values
        log_prob = -torch.rand(b, t, generator=g, dtype=f64) * 6.0
    old = log_prob + torch.randn(b, t, generator=g, dtype=f64) * spread
    scale = 3.0 if mode in ("clip_cov", "kl_cov") else rng.choice([0.5, 1.0, 2.0])
    if rng.random() < 0.5:  # GRPO: one advantage per response
        adv = (torch.randn(b, 1, generator=g, dtype=f64) * scale).expand(b, t).clone()
    else:
        adv = torch.randn(b, t, generator=g, dtype=f64) * scale
    out = {
        "log_prob": log_prob,
        "old_log_prob": old,
        "advantages": adv,
        "response_mask": mask,
        "ref_log_prob": log_prob + torch.randn(b, t, generator=g, dtype=f64) * 0.3,
        "entropy": torch.rand(b, t, generator=g, dtype=f64) * 3,
    }
    return out, kind


def _garbage_tensors(g: torch.Generator, dtype: torch.dtype, garbage: str) -> dict[str, torch.Tensor]:
    """Right-padded rows (one full, padding that fills whole groups of 8 tokens and padding that does
    not, one empty row, whose padding verl's seq-mean modes leave out) with garbage in the padding."""
    b, t, f64 = 5, 24, torch.float64
    log_prob = -torch.rand(b, t, generator=g, dtype=f64) * 3.0
    out = {
        "log_prob": log_prob,
        "old_log_prob": log_prob + torch.randn(b, t, generator=g, dtype=f64) * 0.2,
        "advantages": torch.randn(b, t, generator=g, dtype=f64),
        "ref_log_prob": log_prob + torch.randn(b, t, generator=g, dtype=f64) * 0.3,
        "entropy": torch.rand(b, t, generator=g, dtype=f64) * 3,
    }
    mask = torch.arange(t)[None, :] < torch.tensor([24, 8, 16, 11, 0])[:, None]
    padding = ~mask
    padding[-1] = False
    if garbage == "overflow":  # finite, but -A r and -A logp overflow (-max/2 is exact in both dtypes)
        out["advantages"] = out["advantages"].masked_fill(padding, -0.5 * float(torch.finfo(dtype).max))
        out["log_prob"] = out["log_prob"].masked_fill(padding, -4.0)
        out["old_log_prob"] = out["old_log_prob"].masked_fill(padding, -9.0)
    else:
        out = {k: v.masked_fill(padding, math.nan) for k, v in out.items()}
    out = {k: v.to(dtype) for k, v in out.items()}
    out["response_mask"] = mask
    return out


def _config(rng: random.Random, mode: str, agg: str, mask: torch.Tensor, use_global: bool) -> dict:
    dp_size = rng.choice([1, 2, 4]) if use_global else 1
    n_tokens, n_seqs = int(mask.sum()), int((mask.sum(-1) > 0).sum())
    low = rng.choice([None, 0.1, 0.2])
    high = rng.choice([None, 0.28, 0.3])
    cfg = {
        "clip_ratio": rng.choice([0.1, 0.2]),
        "clip_ratio_low": low,
        "clip_ratio_high": high,
        "clip_ratio_c": rng.choice([3.0, 10.0, 20.0]) if mode.startswith("dppo") else rng.choice([3.0, 10.0]),
        "loss_agg_mode": agg,
        "loss_scale_factor": rng.choice([None, 16]),
        "dp_size": dp_size,
        "batch_num_tokens": n_tokens * dp_size + rng.randint(0, 20) if use_global else None,
        "global_batch_size": n_seqs * dp_size + rng.randint(0, 3) if use_global else None,
        "use_kl_loss": rng.random() < 0.5,
        "kl_loss_type": rng.choice(["low_var_kl", "k1", "k2"]),
        "kl_loss_coef": rng.choice([0.001, 0.1]),
        "entropy_coeff": rng.choice([0.0, 0.01]),
        "loss_mode": mode,
        "clip_cov_ratio": rng.choice([0.0002, 0.1, 0.3]),
        "clip_cov_lb": 1.0,
        "clip_cov_ub": 5.0,
        "kl_cov_ratio": rng.choice([0.0002, 0.1, 0.3]),
        "ppo_kl_coef": rng.choice([0.1, 1.0]),
        "dro_beta": rng.choice([0.1, 0.5, 2.0]) if mode == "dro" else None,
        "tau_pos": rng.choice([1.0, 1.5]),
        "tau_neg": rng.choice([1.05, 2.0]),
        "rollout_correction": None,
    }
    if mode == "bypass_mode":
        cfg["rollout_correction"] = {
            "loss_type": rng.choice(["ppo_clip", "reinforce"]),
            "rollout_is": rng.choice([None, "sequence", "token"]),
            "rollout_is_threshold": 2.0,
        }
    return cfg


def _verl_metrics(verl, cfg: dict, tensors: dict[str, torch.Tensor], seed: int) -> dict[str, float]:
    core_algos, losses, _ = verl
    from tensordict import TensorDict
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    rc = RolloutCorrectionConfig(**cfg["rollout_correction"]) if cfg["rollout_correction"] else None
    policy_loss = PolicyLossConfig(
        loss_mode=cfg["loss_mode"],
        clip_cov_ratio=cfg["clip_cov_ratio"],
        clip_cov_lb=cfg["clip_cov_lb"],
        clip_cov_ub=cfg["clip_cov_ub"],
        kl_cov_ratio=cfg["kl_cov_ratio"],
        ppo_kl_coef=cfg["ppo_kl_coef"],
        dro_beta=cfg["dro_beta"],
        **({"rollout_correction": rc} if rc is not None else {}),
    )
    actor = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=cfg["clip_ratio"],
        clip_ratio_low=cfg["clip_ratio_low"],
        clip_ratio_high=cfg["clip_ratio_high"],
        clip_ratio_c=cfg["clip_ratio_c"],
        loss_agg_mode=cfg["loss_agg_mode"],
        loss_scale_factor=cfg["loss_scale_factor"],
        entropy_coeff=cfg["entropy_coeff"],
        use_kl_loss=cfg["use_kl_loss"],
        kl_loss_type=cfg["kl_loss_type"],
        kl_loss_coef=cfg["kl_loss_coef"],
        tau_pos=cfg["tau_pos"],
        tau_neg=cfg["tau_neg"],
        policy_loss=policy_loss,
    )
    mask = tensors["response_mask"]
    fields = {
        "response_mask": mask,
        "old_log_probs": tensors["old_log_prob"],
        "advantages": tensors["advantages"],
        "ref_log_prob": tensors["ref_log_prob"],
    }
    if "rollout_is_weights" in tensors:
        fields["rollout_is_weights"] = tensors["rollout_is_weights"]
    data = TensorDict(fields, batch_size=[mask.shape[0]])
    tu.assign_non_tensor(
        data,
        dp_size=cfg["dp_size"],
        batch_num_tokens=cfg["batch_num_tokens"],
        global_batch_size=cfg["global_batch_size"],
    )
    output = {"log_probs": tensors["log_prob"], "entropy": tensors["entropy"]}
    torch.manual_seed(seed)
    with torch.no_grad():
        policy_loss_value, metrics = losses.ppo_loss(actor, output, data)
    out = {}
    for key, value in metrics.items():
        if key == "kl_coef":
            continue
        name = key if key.startswith("rollout_corr/") else key.split("/")[-1]
        out[name] = float(value.aggregate())
    out["policy_loss"] = float(policy_loss_value)
    if not cfg["use_kl_loss"]:  # rlvitals reports kl_loss whenever ref_log_prob is given
        kld = core_algos.kl_penalty(tensors["log_prob"], tensors["ref_log_prob"], cfg["kl_loss_type"])
        out["kl_loss"] = float(
            core_algos.agg_loss(kld, mask, cfg["loss_agg_mode"], **actor.global_batch_info)
        )
    return out


def _record(
    store: dict,
    cases: list,
    name: str,
    dtype_name: str,
    tensors: dict,
    cfg: dict,
    seed: int,
    expected: dict,
    tags: list[str],
) -> None:
    """One case into the fixture: its tensors under ``name.*`` and its metadata (``expected:nan`` added
    to ``tags`` where verl gave a NaN)."""
    for key, value in tensors.items():
        store[f"{name}.{key}"] = value.contiguous()
    if any(math.isnan(v) for v in expected.values()):
        tags = [*tags, "expected:nan"]
    cases.append(
        {
            "id": name,
            "dtype": dtype_name,
            "config": cfg,
            "seed": seed,
            "expected": expected,
            "tags": sorted(tags),
        }
    )


def main() -> None:
    verl = load_verl()
    verl[1].no_padding_2_padding = lambda tensor, data: tensor
    modes = list(verl[0].POLICY_LOSS_REGISTRY)
    rng = random.Random(SEED)
    g = torch.Generator().manual_seed(SEED)
    store: dict[str, torch.Tensor] = {}
    cases = []
    grid = itertools.product(modes, AGG_MODES, DTYPES, (False, True), (False, True))
    for i, (mode, agg, dtype_name, with_is, use_global) in enumerate(grid):
        tensors, mask_kind = _tensors(rng, g, mode)
        if with_is:
            w = torch.rand(tensors["log_prob"].shape, generator=g, dtype=torch.float64) * 1.5 + 0.5
            tensors["rollout_is_weights"] = w
        cfg = _config(rng, mode, agg, tensors["response_mask"], use_global)
        tensors = {k: v.to(DTYPES[dtype_name]) if v.is_floating_point() else v for k, v in tensors.items()}
        seed = rng.randrange(2**31)
        expected = _verl_metrics(verl, cfg, tensors, seed)
        tags = [f"loss_mode:{mode}", f"mode:{agg}", f"dtype:{dtype_name}", f"is:{with_is}"]
        tags += [f"global:{use_global}", f"mask:{mask_kind}"]
        _record(store, cases, f"mode{i:04d}", dtype_name, tensors, cfg, seed, expected, tags)
    grid = itertools.product(modes, ("token-mean", "seq-mean-token-mean"), DTYPES, ("overflow", "nan"))
    for j, (mode, agg, dtype_name, garbage) in enumerate(grid):
        tensors = _garbage_tensors(g, DTYPES[dtype_name], garbage)
        cfg = _config(rng, mode, agg, tensors["response_mask"], False)
        seed = rng.randrange(2**31)
        expected = _verl_metrics(verl, cfg, tensors, seed)
        tags = [f"loss_mode:{mode}", f"mode:{agg}", f"dtype:{dtype_name}", "is:False", "global:False"]
        tags += [f"garbage:mask-{garbage}", "mask:ragged"]
        _record(store, cases, f"mask{j:04d}", dtype_name, tensors, cfg, seed, expected, tags)
    save_file(store, str(HERE / "verl_0_9_1_modes.safetensors"))
    meta = {"verl_version": "0.9.1", "torch_version": torch.__version__, "seed": SEED, "cases": cases}
    (HERE / "verl_0_9_1_modes.json").write_text(json.dumps(meta, indent=0, sort_keys=True) + "\n")
    size = sum((HERE / f).stat().st_size for f in ("verl_0_9_1_modes.safetensors", "verl_0_9_1_modes.json"))
    print(f"{len(cases)} cases over {len(modes)} loss modes, {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
