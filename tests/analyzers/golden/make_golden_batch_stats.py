"""Regenerate the verl 0.9.1 golden fixture for the estimators that normalise over the whole batch
(checked by tests/analyzers/test_analyzers_batch_statistics.py; not a CI dependency).

Runs in the verl side environment, like make_golden_rollout.py::

    export RLVITALS_SIDEENV_DIR=/work/sidenv   # or the default .sidenv/
    PY=$(python -c "from tests.support.sideenv import ensure, VERL; print(ensure('verl', VERL))")
    $PY tests/analyzers/golden/make_golden_batch_stats.py

``reinforce_plus_plus`` and ``reinforce_plus_plus_baseline`` whiten over the batch they are given
(``verl_F.masked_whiten``), ``gpg`` scales by ``batch / non-zero scores`` counted over it: verl's driver
calls them on the whole training batch (``ray_trainer.compute_advantage``), while a client uploads a
micro-batch of it. Each case here is one whole batch of ``PROMPTS x N`` responses with verl's own
advantages and returns, and the whole batch's statistics read from verl's ``masked_mean`` /
``masked_var`` (whitening) or recomputed as verl's ``alpha`` (gpg), so the test can take any part of the
batch and know what its advantages must be. Outputs: ``verl_0_9_1_batch_stats.safetensors`` and
``verl_0_9_1_batch_stats.json``. Deterministic for a given seed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from verl_loader import load_verl  # noqa: E402

SEED = 20261202
PROMPTS, N, LENGTH = 16, 4, 24  # data.train_batch_size, actor_rollout_ref.rollout.n, response length
ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg")
DTYPES = {"float32": (torch.float32, torch.float32), "float64": (torch.float64, torch.int64)}  # rewards, mask


def main() -> None:
    core_algos, _, verl_F = load_verl()
    from verl.trainer.config import AlgoConfig

    g = torch.Generator().manual_seed(SEED)
    store: dict[str, torch.Tensor] = {}
    cases = []
    batch = PROMPTS * N
    for estimator in ESTIMATORS:
        for dtype_name, (dtype, mask_dtype) in DTYPES.items():
            lengths = torch.randint(3, LENGTH + 1, (batch,), generator=g)
            mask = (torch.arange(LENGTH).unsqueeze(0) < lengths.unsqueeze(1)).to(mask_dtype)
            rewards = torch.zeros(batch, LENGTH, dtype=torch.float64)
            if estimator == "reinforce_plus_plus":  # a dense process reward plus an outcome score
                rewards = torch.randn(batch, LENGTH, generator=g, dtype=torch.float64) * 0.1 * mask
            scores = torch.randint(0, 2, (batch,), generator=g).double()  # binary outcome, ties in groups
            scores[::7] = 0.5  # a partial-credit score here and there
            rewards[torch.arange(batch), lengths - 1] += scores
            rewards = rewards.to(dtype)
            uid = np.array([f"p{i // N}" for i in range(batch)], dtype=object)
            gamma = 0.95 if estimator == "reinforce_plus_plus" else 1.0
            config = AlgoConfig(gamma=gamma, adv_estimator=estimator)
            with torch.no_grad():
                fn = core_algos.get_adv_estimator_fn(estimator)
                adv, ret = fn(
                    token_level_rewards=rewards.clone(), response_mask=mask, config=config, index=uid
                )
                if estimator == "gpg":
                    s = rewards.sum(-1)
                    stats = {"scale": float(batch / torch.count_nonzero(s).clamp(min=1))}
                else:  # what masked_whiten divided by: the whole batch's mean and sqrt(var + 1e-8)
                    whitened = ret if estimator == "reinforce_plus_plus" else None
                    if whitened is None:  # baseline: rebuild the tiled group-centred scores verl whitened
                        s = rewards.sum(-1)
                        centred = s.clone()
                        for p in range(PROMPTS):
                            centred[p * N : (p + 1) * N] -= s[p * N : (p + 1) * N].mean()
                        whitened = centred.unsqueeze(-1).tile([1, LENGTH]) * mask
                    mean = verl_F.masked_mean(whitened, mask)
                    std = torch.sqrt(verl_F.masked_var(whitened, mask) + 1e-8)
                    # the statistics reproduce verl's advantages (the fixture checks itself)
                    assert torch.allclose((whitened - mean) / std * mask, adv, rtol=1e-5, atol=1e-6)
                    stats = {"mean": float(mean), "std": float(std)}
            name = f"{estimator}.{dtype_name}"
            store[f"{name}.token_level_rewards"] = rewards.contiguous()
            store[f"{name}.response_mask"] = mask.contiguous()
            store[f"{name}.advantages"] = adv.contiguous()
            cases.append({"id": name, "estimator": estimator, "dtype": dtype_name, "gamma": gamma,
                          "index": uid.tolist(), "batch_stats": stats})  # fmt: skip
    meta = {
        "verl_version": "0.9.1",
        "torch_version": torch.__version__,
        "seed": SEED,
        "train_batch_size": PROMPTS,
        "rollout_n": N,
        "cases": cases,
    }
    save_file(store, str(HERE / "verl_0_9_1_batch_stats.safetensors"))
    (HERE / "verl_0_9_1_batch_stats.json").write_text(json.dumps(meta, indent=0, sort_keys=True) + "\n")
    print(f"{len(cases)} cases")


if __name__ == "__main__":
    main()
