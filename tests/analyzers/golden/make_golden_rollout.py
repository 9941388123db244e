"""Regenerate the verl 0.9.1 golden fixture for rollout correction, advantage estimators and on-policy
distillation (checked by tests/analyzers/test_analyzers_rollout_parity.py; not a CI dependency).

Runs in the verl side environment (see make_golden.py and tests/support/sideenv.py)::

    export RLVITALS_SIDEENV_DIR=/work/sidenv   # or the default .sidenv/
    PY=$(python -c "from tests.support.sideenv import ensure, VERL; print(ensure('verl', VERL))")
    PYTHONPATH=$(python -c "from tests.support.sideenv import rlvitals_path; print(rlvitals_path())") \\
        $PY tests/analyzers/golden/make_golden_rollout.py

Every expected number comes from verl's own functions:
``rollout_corr_helper.compute_rollout_correction_and_rejection_mask`` and
``compute_rollout_corr_metrics_from_logprobs``, ``utils.debug.metrics.calculate_debug_metrics``, the
registered estimators in ``core_algos`` called as ``ray_trainer.compute_advantage`` calls them (GRPO with
``norm_adv_by_std_in_grpo``, the rest with an ``AlgoConfig``), and
``trainer.distillation.losses.distillation_loss`` with a real ``FSDPActorConfig`` and
``DistillationLossConfig`` (``no_padding_2_padding`` bypassed: the tensors are already padded).
Outputs: ``verl_0_9_1_rollout.safetensors`` (inputs and expected tensors) and ``verl_0_9_1_rollout.json``
(options, expected metrics). Deterministic for a given seed.
"""

from __future__ import annotations

import json
import random
import sys
import types
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from verl_loader import load_verl  # noqa: E402

SEED = 20261201
DTYPES = {"float32": torch.float32, "float64": torch.float64}
MASK_DTYPES = {"bool": torch.bool, "int64": torch.int64, "float32": torch.float32}
IS_OPTIONS = [
    (None, 2.0),
    ("token", 2.0),
    ("token", 1.05),
    ("token", "1.5"),
    ("token", "0.8_1.25"),
    ("sequence", 2.0),
    ("sequence", 5.0),
    ("sequence", "0.5_2.0"),
]
RS_OPTIONS = [
    (None, None),
    ("token_k1", "0.9_1.1"),
    ("token_k1", 1.2),
    ("token_k2", 0.01),
    ("token_k3", 0.005),
    ("seq_sum_k1", "0.5_2.0"),
    ("seq_sum_k2", 0.05),
    ("seq_sum_k3", 0.05),
    ("seq_mean_k1", 1.05),
    ("seq_mean_k2", 0.005),
    ("seq_mean_k3", 0.002),
    ("seq_max_k2", 0.05),
    ("seq_max_k3", 0.02),
    ("token_k1,seq_mean_k3", "0.8_1.25,0.003"),
    ("seq_sum_k1,seq_max_k2,token_k3", "0.3_3.0,0.1,0.02"),
    ("token_k2,seq_mean_k2", 0.02),
    ("token_k3,token_k3", 0.01),
]
ESTIMATORS = [
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "grpo_passk",
    "opo",
    "gpg",
]
DISTILL_MODES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


def _mask(rng: random.Random, g: torch.Generator, b: int, t: int) -> torch.Tensor:
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    if rng.random() < 0.3 and b > 1:
        lengths[torch.rand(b, generator=g) < 0.3] = 0
    if rng.random() < 0.2:
        mask = torch.rand(b, t, generator=g) < 0.7
    else:
        mask = torch.arange(t)[None, :] < lengths[:, None]
    if not bool(mask.any()):
        mask[0, 0] = True
    return mask


def _scalar(value) -> float:
    if hasattr(value, "aggregate"):
        value = value.aggregate()
    return float(value)


def _rollout_cases(rc, debug, rng, g, store) -> list[dict]:
    cases = []
    i = 0
    combos = [
        (is_opt, rs_opt, norm) for is_opt in IS_OPTIONS for rs_opt in RS_OPTIONS for norm in (False, True)
    ]
    rng.shuffle(combos)
    # every IS option with every RS option at least once; batch normalisation on half of them
    for is_opt, rs_opt, norm in combos:
        if norm and is_opt[0] is None:
            continue
        if rng.random() < 0.55 and not (rs_opt[0] is None or is_opt[0] is None):
            continue
        b, t = rng.randint(1, 6), rng.randint(2, 12)
        dtype_name = rng.choice(list(DTYPES))
        dtype = DTYPES[dtype_name]
        old = -(torch.rand(b, t, generator=g, dtype=torch.float64) * 3 + 0.01)
        scale = rng.choice([0.003, 0.03, 0.1, 0.4, 3.0])
        rollout = old + scale * torch.randn(b, t, generator=g, dtype=torch.float64)
        old, rollout = old.to(dtype), rollout.to(dtype)
        mask_name = rng.choice(list(MASK_DTYPES))
        mask = _mask(rng, g, b, t).to(MASK_DTYPES[mask_name])
        kwargs = {
            "rollout_is": is_opt[0],
            "rollout_is_threshold": is_opt[1],
            "rollout_is_batch_normalize": norm,
            "rollout_rs": rs_opt[0],
            "rollout_rs_threshold": rs_opt[1],
        }
        name = f"rc{i:03d}"
        try:
            with torch.no_grad():
                weights, new_mask, metrics = rc.compute_rollout_correction_and_rejection_mask(
                    old_log_prob=old, rollout_log_prob=rollout, response_mask=mask, **kwargs
                )
        except ZeroDivisionError:  # IcePop zeroed every weight: verl's ESS divides by 0.0 (a Python float)
            store[f"{name}.old_log_prob"] = old.contiguous()
            store[f"{name}.rollout_log_prob"] = rollout.contiguous()
            store[f"{name}.response_mask"] = mask.contiguous()
            cases.append({"id": name, "dtype": dtype_name, "mask_dtype": mask_name, "kwargs": kwargs,
                          "verl_raises": "ZeroDivisionError"})  # fmt: skip
            i += 1
            continue
        with torch.no_grad():
            corr = rc.compute_rollout_corr_metrics_from_logprobs(old, rollout, mask)
            batch = {"rollout_log_probs": rollout, "old_log_probs": old, "response_mask": mask,
                     "responses": torch.zeros(b, t, dtype=torch.int64)}  # fmt: skip
            dbg = debug.calculate_debug_metrics(types.SimpleNamespace(batch=batch))
        store[f"{name}.old_log_prob"] = old.contiguous()
        store[f"{name}.rollout_log_prob"] = rollout.contiguous()
        store[f"{name}.response_mask"] = mask.contiguous()
        store[f"{name}.expected_mask"] = new_mask.contiguous()
        if weights is not None:
            store[f"{name}.expected_weights"] = weights.batch["rollout_is_weights"].contiguous()
        cases.append(
            {
                "id": name,
                "dtype": dtype_name,
                "mask_dtype": mask_name,
                "kwargs": kwargs,
                "weights": weights is not None,
                "metrics": {k: _scalar(v) for k, v in metrics.items()},
                "corr_metrics": {k: _scalar(v) for k, v in corr.items()},
                "debug_metrics": {k: _scalar(v) for k, v in dbg.items()},
            }
        )
        i += 1
    return cases


def _advantage_cases(core_algos, rng, g, store) -> list[dict]:
    from verl.trainer.config import AlgoConfig

    cases = []
    i = 0
    for estimator in ESTIMATORS:
        for dtype_name in DTYPES:
            for norm in (True, False):
                for _ in range(3):
                    b, t = rng.randint(2, 12), rng.randint(2, 10)
                    size = rng.choice([2, 3, 4]) if estimator == "grpo_passk" else rng.choice([1, 2, 3, 4])
                    ids = [k // size for k in range(b)]
                    if estimator == "grpo_passk" and b % size == 1:
                        ids[-1] = ids[-2]
                    rng.shuffle(ids)
                    index = [f"uid-{x}" for x in ids]
                    mask = _mask(rng, g, b, t)
                    mask[:, 0] = True  # at least two valid tokens for the whitening estimators
                    mask_name = rng.choice(["int64", "float32"])
                    mask = mask.to(MASK_DTYPES[mask_name])
                    lengths = mask.sum(-1).clamp(min=1).long()
                    kind = rng.choice(["binary", "continuous", "tied", "dense"])
                    rewards = torch.zeros(b, t, dtype=torch.float64)
                    if kind == "dense":
                        rewards = torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
                    else:
                        scores = {
                            "binary": torch.randint(0, 2, (b,), generator=g).double(),
                            "continuous": torch.randn(b, generator=g, dtype=torch.float64),
                            "tied": torch.full((b,), rng.choice([0.0, 1.0]), dtype=torch.float64),
                        }[kind]
                        rewards[torch.arange(b), lengths - 1] = scores
                    rewards = rewards.to(DTYPES[dtype_name])
                    gamma = rng.choice([1.0, 0.9]) if estimator == "reinforce_plus_plus" else 1.0
                    config = AlgoConfig(gamma=gamma, norm_adv_by_std_in_grpo=norm, adv_estimator=estimator)
                    uid = np.array(index, dtype=object)
                    with torch.no_grad():
                        if estimator == "grpo":  # ray_trainer.compute_advantage's GRPO branch
                            adv, ret = core_algos.compute_grpo_outcome_advantage(
                                token_level_rewards=rewards.clone(), response_mask=mask, index=uid,
                                norm_adv_by_std_in_grpo=norm,
                            )  # fmt: skip
                        else:
                            fn = core_algos.get_adv_estimator_fn(estimator)
                            adv, ret = fn(token_level_rewards=rewards.clone(), response_mask=mask, config=config,
                                          index=uid)  # fmt: skip
                    name = f"adv{i:03d}"
                    store[f"{name}.token_level_rewards"] = rewards.contiguous()
                    store[f"{name}.response_mask"] = mask.contiguous()
                    store[f"{name}.expected_advantages"] = adv.contiguous()
                    if ret is not adv:  # most estimators return one tensor twice
                        store[f"{name}.expected_returns"] = ret.contiguous()
                    cases.append({"id": name, "estimator": estimator, "dtype": dtype_name, "index": index,
                                  "gamma": gamma, "norm_adv_by_std_in_grpo": norm, "kind": kind})  # fmt: skip
                    i += 1
    return cases


def _distillation_cases(rng, g, store) -> list[dict]:
    from tensordict import TensorDict
    from verl.trainer.distillation import losses as dl
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import DistillationLossConfig, FSDPActorConfig

    dl.no_padding_2_padding = lambda tensor, data: tensor
    cases = []
    i = 0
    for mode in DISTILL_MODES:
        for use_pg in (True, False):
            if mode == "k1" and not use_pg:  # verl's DistillationLossConfig refuses it
                continue
            for dtype_name in DTYPES:
                b, t = rng.randint(1, 6), rng.randint(2, 12)
                dtype = DTYPES[dtype_name]
                student = -(torch.rand(b, t, generator=g, dtype=torch.float64) * 3 + 0.01)
                teacher = student + rng.choice([0.1, 1.0, 8.0]) * torch.randn(
                    b, t, generator=g, dtype=torch.float64
                )
                old = student + 0.05 * torch.randn(b, t, generator=g, dtype=torch.float64)
                student, teacher, old = student.to(dtype), teacher.to(dtype), old.to(dtype)
                mask = _mask(rng, g, b, t)
                agg = rng.choice(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"])
                clamp = rng.choice([10.0, 0.5, None])
                loss_cfg = DistillationLossConfig(
                    loss_mode=mode, use_policy_gradient=use_pg, loss_max_clamp=clamp
                )
                actor = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                                        loss_agg_mode=agg)  # fmt: skip
                data = TensorDict(
                    {"response_mask": mask, "teacher_logprobs": teacher.unsqueeze(-1), "old_log_probs": old},
                    batch_size=[b],
                )
                tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
                with torch.no_grad():
                    loss, metrics = dl.distillation_loss(
                        actor, types.SimpleNamespace(distillation_loss=loss_cfg), {"log_probs": student}, data
                    )
                name = f"dist{i:03d}"
                store[f"{name}.student_log_prob"] = student.contiguous()
                store[f"{name}.teacher_log_prob"] = teacher.contiguous()
                store[f"{name}.old_log_prob"] = old.contiguous()
                store[f"{name}.response_mask"] = mask.contiguous()
                expected = {k: _scalar(v) for k, v in metrics.items()}
                expected["distillation/loss"] = float(loss)
                cases.append({"id": name, "dtype": dtype_name, "loss_mode": mode, "use_policy_gradient": use_pg,
                              "loss_max_clamp": clamp, "loss_agg_mode": agg, "expected": expected})  # fmt: skip
                i += 1
    return cases


def main() -> None:
    core_algos, _, _ = load_verl()
    from verl.trainer.ppo import rollout_corr_helper as rc
    from verl.utils.debug import metrics as debug

    rng = random.Random(SEED)
    g = torch.Generator().manual_seed(SEED)
    store: dict[str, torch.Tensor] = {}
    meta = {
        "verl_version": "0.9.1",
        "torch_version": torch.__version__,
        "seed": SEED,
        "rollout_cases": _rollout_cases(rc, debug, rng, g, store),
        "advantage_cases": _advantage_cases(core_algos, rng, g, store),
        "distillation_cases": _distillation_cases(rng, g, store),
    }
    save_file(store, str(HERE / "verl_0_9_1_rollout.safetensors"))
    (HERE / "verl_0_9_1_rollout.json").write_text(json.dumps(meta, indent=0, sort_keys=True) + "\n")
    size = sum(
        (HERE / f).stat().st_size for f in ("verl_0_9_1_rollout.safetensors", "verl_0_9_1_rollout.json")
    )
    counts = {k: len(v) for k, v in meta.items() if k.endswith("_cases")}
    print(f"{counts}, {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
