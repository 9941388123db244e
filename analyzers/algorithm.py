"""verl's ``algorithm`` section (advantage estimator, rollout correction) and the two batch checks it
drives: the uploaded advantages against ``algorithm.adv_estimator``, and the reported ``rollout_corr/*``
(and ``training/rollout_*``) metrics against the IS weights and rejection mask recomputed from
``old_log_prob``, ``rollout_log_probs`` and ``response_mask``.

Both checks are pure (no I/O) and return JSON-safe dicts; the service stores them beside the loss audit.
The ``response_mask`` the rollout check reads is the mask *before* rejection (what verl's driver hands
``compute_rollout_correction_and_add_to_batch``); the recomputed mask after rejection is returned so a
caller can audit the loss on the mask the trainer should have used. The reported ``rollout_corr/*``
values are verl's numbers for the whole batch they were computed on: send that batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .advantages import ADV_ESTIMATORS, compute_advantages
from .rollout import PREFIX, rollout_correction, rollout_debug_metrics
from .rollout_config import RolloutCorrectionConfig

Tensor = torch.Tensor

ADVANTAGE_ATOL = 1e-4  # float32 advantages of a trainer against ours
ADVANTAGE_RTOL = 1e-4
METRIC_RTOL = 1e-4  # a trainer's GPU reductions differ from ours in summation order, not more
METRIC_ATOL = 1e-6
DEBUG_PREFIX = "training/rollout_"


@dataclass(frozen=True)
class AlgorithmConfig:
    """The fields of verl's ``algorithm`` config the audit reads, with verl's defaults, except
    ``adv_estimator``: None when the config does not say (the audit then assumes ``grpo``, the estimator
    of every GRPO recipe; verl's own default is ``gae``, which needs a critic and is not checked)."""

    adv_estimator: str | None = None
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0
    rollout_correction: RolloutCorrectionConfig | None = None

    def __post_init__(self) -> None:
        if self.adv_estimator is not None and not isinstance(self.adv_estimator, str):
            raise ValueError(f"adv_estimator must be a string; got {self.adv_estimator!r}")
        if not isinstance(self.norm_adv_by_std_in_grpo, bool):
            raise ValueError(
                f"norm_adv_by_std_in_grpo must be True or False; got {self.norm_adv_by_std_in_grpo!r}"
            )
        if (
            isinstance(self.gamma, bool)
            or not isinstance(self.gamma, (int, float))
            or not math.isfinite(self.gamma)
        ):
            raise ValueError(f"gamma must be a finite number; got {self.gamma!r}")

    @classmethod
    def from_verl(cls, mapping: Mapping[str, Any] | None) -> AlgorithmConfig:
        """From a whole verl config (reads ``algorithm``) or the ``algorithm`` section itself."""
        if not hasattr(mapping, "get"):
            return cls()
        section = mapping.get("algorithm") if hasattr(mapping.get("algorithm"), "get") else mapping
        values = {
            k: section[k] for k in ("adv_estimator", "norm_adv_by_std_in_grpo", "gamma") if k in section
        }
        return cls(**values, rollout_correction=RolloutCorrectionConfig.from_verl(mapping))

    @property
    def present(self) -> bool:
        return self != AlgorithmConfig()

    def to_dict(self) -> dict[str, Any]:
        """verl's shape: ``{"adv_estimator", "norm_adv_by_std_in_grpo", "gamma", "rollout_correction"}``."""
        out: dict[str, Any] = {
            "norm_adv_by_std_in_grpo": self.norm_adv_by_std_in_grpo,
            "gamma": float(self.gamma),
        }
        if self.adv_estimator is not None:
            out["adv_estimator"] = self.adv_estimator
        if self.rollout_correction is not None:
            out["rollout_correction"] = self.rollout_correction.to_dict()
        return out


def check_advantages(algorithm: AlgorithmConfig, tensors: Mapping[str, Tensor]) -> dict[str, Any]:
    """Recompute ``algorithm.adv_estimator``'s advantages from ``token_level_rewards`` and
    ``group_index`` and compare with the sent ``advantages`` on valid tokens.

    Returns ``{"ok", "estimator", "max_abs_err", "norm_adv_by_std_in_grpo", "gamma"}``; ``ok`` is None
    (with ``"skipped"``) when the estimator is not one reproduced here or cannot run on the batch.
    """
    name = algorithm.adv_estimator or "grpo"
    out: dict[str, Any] = {
        "estimator": name,
        "norm_adv_by_std_in_grpo": algorithm.norm_adv_by_std_in_grpo,
        "gamma": float(algorithm.gamma),
    }
    if name not in ADV_ESTIMATORS:
        return {**out, "ok": None, "max_abs_err": None,
                "skipped": f"adv_estimator {name!r} is not reproduced (valid: {', '.join(sorted(ADV_ESTIMATORS))})"}  # fmt: skip
    mask = tensors["response_mask"]
    try:
        expected, _ = compute_advantages(
            name,
            tensors["token_level_rewards"],
            mask,
            tensors.get("group_index"),
            gamma=float(algorithm.gamma),
            norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
        )
    except ValueError as exc:  # e.g. grpo_passk with a group of one, whitening over one token
        return {**out, "ok": None, "max_abs_err": None, "skipped": str(exc)}
    expected = expected.to(torch.float64)
    valid = mask.bool()
    diff = (expected - tensors["advantages"].to(torch.float64)).abs()[valid]
    max_err = float(diff.max()) if diff.numel() else 0.0
    scale = float(expected.abs()[valid].max()) if diff.numel() else 0.0
    ok = max_err <= ADVANTAGE_ATOL + ADVANTAGE_RTOL * scale  # NaN compares False: a NaN is a mismatch
    return {**out, "ok": bool(ok), "max_abs_err": max_err}


def _verdict(reported: float, recomputed: float) -> dict[str, Any]:
    if math.isnan(reported) or math.isnan(recomputed):
        ok = math.isnan(reported) and math.isnan(recomputed)
        err = 0.0 if ok else math.inf
    elif math.isinf(reported) or math.isinf(recomputed):
        ok = reported == recomputed
        err = 0.0 if ok else math.inf
    else:
        err = abs(reported - recomputed)
        ok = err <= METRIC_ATOL + METRIC_RTOL * abs(recomputed)
    rel = err / abs(recomputed) if recomputed not in (0.0,) and math.isfinite(recomputed) else err
    return {"ok": bool(ok), "reported": reported, "recomputed": recomputed, "abs_err": err, "rel_err": rel}


def audit_rollout(
    algorithm: AlgorithmConfig, tensors: Mapping[str, Tensor], reported: Mapping[str, float | None]
) -> dict[str, Any] | None:
    """Recompute verl's rollout correction for this batch and check the reported ``rollout_corr/*``
    and ``training/rollout_*`` values; None when ``rollout_log_probs`` was not sent.

    The weights and mask come from ``algorithm.rollout_correction`` (None: verl computes only the
    off-policy metrics, ``kl``, ``k3_kl``, ``chi2_*``, perplexities). In ``bypass_mode`` verl corrects
    inside the loss, between ``log_prob`` and the rollout log-probs. Reported ``rollout_corr/*`` keys this
    configuration does not produce (e.g. ``rollout_is_mean`` while ``rollout_is`` is off) are a
    configuration mismatch: the audit fails and names them.

    When the batch carries the ``rollout_is_weights`` the trainer applied, they are compared with the
    recomputed ones (``sent_weights``; without IS they must be 1). With ``rollout_is_batch_normalize`` they
    are compared up to one positive factor (``batch_norm_scale``): verl divides by the mean over the whole
    batch, and a micro-batch upload (what the verl loss hooks send) has another mean than its batch.

    Returns ``{"ok", "config", "verdicts", "unexpected", "tokens", "rejected_tokens",
    "rejected_sequences", "weights", "sent_weights", "explanation"}`` plus the tensors under ``"_mask"`` /
    ``"_weights"`` (not JSON: the caller pops them).
    """
    rollout = tensors.get("rollout_log_probs")
    if rollout is None:
        return None
    config = algorithm.rollout_correction or RolloutCorrectionConfig()
    mask = tensors["response_mask"]
    trainer = tensors["log_prob"] if config.bypass_mode else tensors["old_log_prob"]
    if not bool(mask.bool().any()):
        return {
            "ok": None,
            "config": config.to_dict(),
            "skipped": "response_mask has no valid token (verl raises)",
        }
    try:
        weights, new_mask, metrics = rollout_correction(trainer, rollout, mask, **config.kwargs())
    except ZeroDivisionError:  # IcePop zeroed every weight: verl's ESS divides by zero and the trainer stops
        return {"ok": None, "config": config.to_dict(),
                "skipped": "every IS weight is outside the IcePop bounds (verl raises ZeroDivisionError)"}  # fmt: skip
    if not config.bypass_mode:  # verl's driver logs these beside the correction (decoupled mode)
        metrics.update(rollout_debug_metrics(trainer, rollout, mask))
    verdicts: dict[str, dict[str, Any]] = {}
    unexpected: list[str] = []
    for key, value in reported.items():
        name = key.removeprefix("actor/")
        if value is None or not (name.startswith(PREFIX) or name.startswith(DEBUG_PREFIX)):
            continue
        if name not in metrics:
            unexpected.append(name)
            continue
        verdicts[name] = _verdict(float(value), float(metrics[name]))
    valid = mask.bool()
    kept = new_mask.bool() & valid
    tokens = int(valid.sum())
    rejected = tokens - int(kept.sum())
    rejected_seqs = int(((valid & ~kept).any(dim=-1)).sum())
    summary = None
    if weights is not None:
        w = weights.to(torch.float64)[valid]
        summary = {"mean": float(w.mean()), "min": float(w.min()), "max": float(w.max())}
    sent_weights = None
    if tensors.get("rollout_is_weights") is not None:  # the weights the trainer applied, if it sent them
        sent = tensors["rollout_is_weights"].to(torch.float64)[valid]
        if weights is None:
            sent_weights = {"ok": bool((sent == 1).all()), "max_abs_err": float((sent - 1).abs().max())}
        else:
            want = weights.to(torch.float64)[valid]
            scale = 1.0
            if config.rollout_is_batch_normalize and float((want * want).sum()) > 0:
                # verl normalised over the whole batch; a micro-batch upload has its own mean: the weights
                # must agree up to that one positive factor (1 for the whole batch)
                scale = float((sent * want).sum() / (want * want).sum())
            err = float((sent - scale * want).abs().max())
            sent_weights = {
                "ok": err <= METRIC_ATOL + METRIC_RTOL * float((scale * want).abs().max()),
                "max_abs_err": err,
            }
            if config.rollout_is_batch_normalize:
                sent_weights["batch_norm_scale"] = scale
    bad = sorted(k for k, v in verdicts.items() if not v["ok"])
    ok = not bad and not unexpected and (sent_weights is None or sent_weights["ok"])
    parts = []
    setting = (
        f"rollout_is={config.rollout_is!r}, rollout_is_threshold={config.rollout_is_threshold!r}, "
        f"rollout_is_batch_normalize={config.rollout_is_batch_normalize}, rollout_rs={config.rollout_rs!r}, "
        f"rollout_rs_threshold={config.rollout_rs_threshold!r}"
        + (", bypass_mode" if config.bypass_mode else "")
    )
    for key in bad:
        v = verdicts[key]
        parts.append(f"{key} reported {v['reported']:.6g} but recomputed {v['recomputed']:.6g}")
    if sent_weights is not None and not sent_weights["ok"]:
        parts.append(
            f"the sent rollout_is_weights differ from the recomputed ones by up to {sent_weights['max_abs_err']:.3g}"
        )
    if unexpected:
        parts.append(
            f"{', '.join(sorted(unexpected))} reported but not produced by this configuration ({setting}): "
            "the trainer ran a different rollout correction than its config says"
        )
    if ok:
        explanation = f"{len(verdicts)} rollout-correction metric(s) agree ({setting})."
    else:
        explanation = (
            "Rollout correction mismatch: "
            + "; ".join(parts)
            + f". Recomputed with {setting} from "
            + ("log_prob" if config.bypass_mode else "old_log_prob")
            + " and rollout_log_probs."
        )
    return {
        "ok": ok,
        "config": config.to_dict(),
        "verdicts": verdicts,
        "unexpected": sorted(unexpected),
        "tokens": tokens,
        "rejected_tokens": rejected,
        "rejected_sequences": rejected_seqs,
        "weights": summary,
        "sent_weights": sent_weights,
        "explanation": explanation,
        "_mask": new_mask,
        "_weights": weights,
    }
