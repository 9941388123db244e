"""Regenerate the verl 0.9.1 golden fixture that test_analyzers_parity.py checks rlvitals against.

Needs the real verl 0.9.1 in a separate environment (never the project's .venv)::

    python3 -m venv /work/verl-venv
    /work/verl-venv/bin/pip install torch==2.13.0
    /work/verl-venv/bin/pip install verl==0.9.1 --no-deps numpy packaging tensordict==0.10.0 \\
        transformers==5.10.4 omegaconf codetiming orjson safetensors
    /work/verl-venv/bin/pip install -e . --no-deps
    /work/verl-venv/bin/python tests/analyzers/golden/make_golden.py

Every loss case goes through verl's own ``workers.utils.losses.ppo_loss`` with a real
``FSDPActorConfig`` (only ``no_padding_2_padding`` is bypassed: the tensors are already padded), so the
expected numbers include verl's global_batch_info plumbing. Outputs, next to this script:
``verl_0_9_1.safetensors`` (inputs and GRPO advantages) and ``verl_0_9_1.json`` (configs, expected
metrics, coverage tags). Deterministic: the same seed gives the same files.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rlvitals.analyzers.contract.config import AggMode, KLType, LossConfig  # noqa: E402
from verl_loader import load_verl  # noqa: E402

SEED = 20260512
N_LOSS_CASES = 480
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _mask(rng: random.Random, g: torch.Generator, b: int, t: int, tags: set[str]) -> torch.Tensor:
    kind = rng.choice(["ragged", "ragged", "ragged", "scattered", "full", "empty", "empty-rows"])
    if kind == "full":
        mask = torch.ones(b, t, dtype=torch.bool)
    elif kind == "empty":
        mask = torch.zeros(b, t, dtype=torch.bool)
    elif kind == "scattered":
        mask = torch.rand(b, t, generator=g) < rng.uniform(0.2, 0.9)
    else:
        lengths = torch.randint(1, t + 1, (b,), generator=g)
        if kind == "empty-rows" or rng.random() < 0.3:
            lengths[torch.rand(b, generator=g) < 0.4] = 0
            kind = "empty-rows"
        mask = torch.arange(t)[None, :] < lengths[:, None]
    if not bool(mask.any()):
        kind = "empty"
    tags.add(f"mask:{kind}")
    return mask


def _config(rng: random.Random, mask: torch.Tensor, tags: set[str]) -> LossConfig:
    mode = rng.choice(list(AggMode))
    kl_type = rng.choice(list(KLType))
    clip_ratio = rng.choice([0.1, 0.2, 0.28, 0.3])
    low = rng.choice([None, None, 0.1, 0.2, 0.3])
    high = rng.choice([None, None, 0.2, 0.28, 0.4])
    dp_size = rng.choice([1, 1, 1, 2, 4, 8])
    use_global = dp_size > 1 or rng.random() < 0.3
    n_tokens, n_seqs = int(mask.sum()), int((mask.sum(-1) > 0).sum())
    batch_num_tokens = n_tokens * dp_size + rng.randint(0, 50) if use_global else None
    global_batch_size = n_seqs * dp_size + rng.randint(0, 4) if use_global else None
    if use_global and rng.random() < 0.5:  # the other rank's micro-batches can be anything
        batch_num_tokens = rng.randint(1, 4096)
        global_batch_size = rng.randint(1, 64)
    cfg = LossConfig(
        clip_ratio=clip_ratio,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=rng.choice([1.5, 3.0, 10.0]),
        loss_agg_mode=mode,
        loss_scale_factor=rng.choice([None, None, 16, 4096, 2.5]),
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        use_kl_loss=rng.random() < 0.6,
        kl_loss_type=kl_type,
        kl_loss_coef=rng.choice([0.001, 0.01, 0.1, -0.05]),
        entropy_coeff=rng.choice([0.0, 0.0, 0.001, 0.01, -0.01]),
    )
    tags.update({f"mode:{mode.value}", f"kl:{kl_type.value}", f"dp:{dp_size}", f"global:{use_global}"})
    if cfg.clip_low != cfg.clip_high:
        tags.add("clip:asymmetric")
    return cfg


def _tensors(rng: random.Random, g: torch.Generator, tags: set[str]) -> dict[str, torch.Tensor]:
    b, t = rng.randint(1, 8), rng.choice([1, 2, 3, 7, 16, 31, 48])
    mask = _mask(rng, g, b, t, tags)
    f64 = torch.float64
    log_prob = -torch.rand(b, t, generator=g, dtype=f64) * rng.choice([0.5, 3.0, 10.0])
    spread = rng.choice([0.0, 0.02, 0.2, 0.6, 2.0, 30.0])  # 30: the +-20 log-ratio clamp is hit
    ref_spread = rng.choice([0.05, 0.5, 3.0, 40.0])  # 40: k3's +-20 and +-10 clamps are hit
    old = log_prob + torch.randn(b, t, generator=g, dtype=f64) * spread
    adv = torch.randn(b, t, generator=g, dtype=f64) * rng.choice([0.1, 1.0, 5.0])
    if rng.random() < 0.3:  # GRPO-style: one advantage per response, some exactly zero
        adv = torch.randn(b, 1, generator=g, dtype=f64).expand(b, t).clone()
        adv[torch.rand(b, generator=g) < 0.3] = 0.0
        tags.add("adv:per-sequence")
    out = {
        "log_prob": log_prob,
        "old_log_prob": old,
        "advantages": adv,
        "response_mask": mask,
        "ref_log_prob": log_prob + torch.randn(b, t, generator=g, dtype=f64) * ref_spread,
        "entropy": torch.rand(b, t, generator=g, dtype=f64) * 3,
    }
    if spread >= 20:
        tags.add("clamp:log_ratio")
    if ref_spread >= 20:
        tags.add("clamp:k3")
    garbage = rng.random()
    if garbage < 0.15:
        for name in ("log_prob", "old_log_prob", "advantages", "ref_log_prob", "entropy"):
            out[name] = out[name].masked_fill(~mask, rng.choice([1e4, -777.0, 3.5]))
        tags.add("garbage:finite")
    elif garbage < 0.22:
        name = rng.choice(["log_prob", "advantages", "entropy", "ref_log_prob"])
        out[name] = out[name].masked_fill(~mask, rng.choice([math.nan, math.inf]))
        tags.add("garbage:nonfinite")
    if rng.random() < 0.15:
        del out["entropy"]
    if rng.random() < 0.1:
        out["response_mask"] = mask.to(torch.int64)
        tags.add("mask:int")
    return out


def _verl_metrics(verl, cfg: LossConfig, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    core_algos, losses, _ = verl
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig

    actor = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=cfg.clip_ratio,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
        loss_agg_mode=cfg.loss_agg_mode.value,
        loss_scale_factor=cfg.loss_scale_factor,
        entropy_coeff=cfg.entropy_coeff,
        use_kl_loss=cfg.use_kl_loss,
        kl_loss_type=cfg.kl_loss_type.value,
        kl_loss_coef=cfg.kl_loss_coef,
    )
    mask = tensors["response_mask"]
    fields = {
        "response_mask": mask,
        "old_log_probs": tensors["old_log_prob"],
        "advantages": tensors["advantages"],
    }
    fields["ref_log_prob"] = tensors["ref_log_prob"]
    data = TensorDict(fields, batch_size=[mask.shape[0]])
    tu.assign_non_tensor(
        data,
        dp_size=cfg.dp_size,
        batch_num_tokens=cfg.batch_num_tokens,
        global_batch_size=cfg.global_batch_size,
    )
    output = {"log_probs": tensors["log_prob"]}
    if "entropy" in tensors:
        output["entropy"] = tensors["entropy"]
    with torch.no_grad():
        policy_loss, metrics = losses.ppo_loss(actor, output, data)
    out = {key.split("/")[-1]: float(value.aggregate()) for key, value in metrics.items() if key != "kl_coef"}
    out["policy_loss"] = float(policy_loss)
    if not cfg.use_kl_loss:  # rlvitals reports kl_loss whenever ref_log_prob is given
        kld = core_algos.kl_penalty(tensors["log_prob"], tensors["ref_log_prob"], cfg.kl_loss_type.value)
        out["kl_loss"] = float(
            core_algos.agg_loss(kld, mask.to(torch.bool), cfg.loss_agg_mode.value, **actor.global_batch_info)
        )
    return out


def _grpo_cases(verl, rng: random.Random, g: torch.Generator, store: dict[str, torch.Tensor]) -> list[dict]:
    core_algos = verl[0]
    import numpy as np

    cases = []
    for i in range(40):
        b, t = rng.randint(1, 16), rng.randint(1, 12)
        n_groups = rng.randint(1, b)
        ids = [rng.randrange(n_groups) for _ in range(b)]
        use_str = rng.random() < 0.5
        index = [f"uid-{x}" for x in ids] if use_str else ids
        kind = rng.choice(["binary", "binary", "continuous", "tied"])
        if kind == "binary":
            scores = torch.randint(0, 2, (b,), generator=g).to(torch.float64)
        elif kind == "tied":
            scores = torch.full((b,), rng.choice([0.0, 1.0, 0.5]), dtype=torch.float64)
        else:
            scores = torch.randn(b, generator=g, dtype=torch.float64)
        lengths = torch.randint(1, t + 1, (b,), generator=g)
        mask = torch.arange(t)[None, :] < lengths[:, None]
        rewards = torch.zeros(b, t, dtype=torch.float64)
        rewards[torch.arange(b), lengths - 1] = scores
        dtype_name = rng.choice(["float32", "float32", "float64", "bfloat16"])
        rewards = rewards.to(DTYPES[dtype_name])
        norm = rng.random() < 0.8
        adv, _ = core_algos.compute_grpo_outcome_advantage(
            rewards.clone(), mask, np.array(index, dtype=object), epsilon=1e-6, norm_adv_by_std_in_grpo=norm
        )
        name = f"grpo{i:03d}"
        store[f"{name}.token_level_rewards"] = rewards.contiguous()
        store[f"{name}.response_mask"] = mask.contiguous()
        store[f"{name}.expected_advantages"] = adv.contiguous()
        cases.append(
            {"id": name, "index": index, "norm_adv_by_std_in_grpo": norm, "dtype": dtype_name, "kind": kind}
        )
    return cases


def main() -> None:
    verl = load_verl()
    # the inputs are already padded (batch, response_len): skip verl's unpadded-to-padded slicing
    verl[1].no_padding_2_padding = lambda tensor, data: tensor
    rng = random.Random(SEED)
    g = torch.Generator().manual_seed(SEED)
    store: dict[str, torch.Tensor] = {}
    cases = []
    dtype_cycle = ["float32", "float64", "float32", "float64", "bfloat16", "float16"]
    for i in range(N_LOSS_CASES):
        tags: set[str] = set()
        tensors = _tensors(rng, g, tags)
        cfg = _config(rng, tensors["response_mask"].bool(), tags)
        dtype_name = dtype_cycle[i % len(dtype_cycle)]
        tags.add(f"dtype:{dtype_name}")
        tensors = {k: v.to(DTYPES[dtype_name]) if v.is_floating_point() else v for k, v in tensors.items()}
        expected = _verl_metrics(verl, cfg, tensors)
        name = f"loss{i:04d}"
        for key, value in tensors.items():
            store[f"{name}.{key}"] = value.contiguous()
        if any(math.isnan(v) for v in expected.values()):
            tags.add("expected:nan")
        cases.append(
            {
                "id": name,
                "dtype": dtype_name,
                "config": cfg.to_dict(),
                "tensors": sorted(tensors),
                "expected": expected,
                "tags": sorted(tags),
            }
        )
    grpo = _grpo_cases(verl, rng, g, store)
    save_file(store, str(HERE / "verl_0_9_1.safetensors"))
    meta = {
        "verl_version": "0.9.1",
        "torch_version": torch.__version__,
        "seed": SEED,
        "loss_cases": cases,
        "grpo_cases": grpo,
    }
    (HERE / "verl_0_9_1.json").write_text(json.dumps(meta, indent=0, sort_keys=True) + "\n")
    size = sum((HERE / f).stat().st_size for f in ("verl_0_9_1.safetensors", "verl_0_9_1.json"))
    print(f"{len(cases)} loss cases, {len(grpo)} GRPO cases, {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
