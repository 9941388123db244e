"""Audit one TRL ``GRPOTrainer`` micro-batch: recompute with :func:`~.trl.trl_loss`, compare with what
TRL returned and logged, and explain a mismatch in TRL's own option names.

``trl_audit(config, tensors, reported)`` returns the same :class:`~.auditing.AuditReport` as the verl
audit (the service stores, serves and alerts on both alike). ``reported`` holds TRL's names: ``loss``
(what ``_compute_loss`` returned), ``clip_ratio/region_mean``, ``kl``, ``entropy``, ... A mismatch is
explained by the single ``GRPOConfig`` change that reproduces every mismatched number (e.g. "with
use_bias_correction_kl=False"); a config marked ``unaudited`` is not checked and the report says why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from ..reference.trl import METRICS, TrlLossConfig, TrlLossType, trl_loss
from .auditing import DEFAULT_ATOL, DEFAULT_RTOL, AuditReport, _close, _errors, _fmt

TRL_VERSION = "TRL 1.16 GRPOTrainer"
_TENSORS = ("log_prob", "old_log_prob", "advantages", "response_mask", "ref_log_prob", "entropy")


def _candidates(c: TrlLossConfig) -> list[tuple[str, dict[str, Any]]]:
    """Single-option changes a user plausibly has wrong, each as (what it says, the change)."""
    out: list[tuple[str, dict[str, Any]]] = []
    if c.beta != 0.0:
        out.append(
            (
                f"use_bias_correction_kl={not c.use_bias_correction_kl}",
                {"use_bias_correction_kl": not c.use_bias_correction_kl},
            )
        )
    if c.entropy_bonus and c.entropy_coef != 0.0:
        out.append(("no entropy bonus (entropy_coef=0)", {"entropy_coef": 0.0}))
    if c.gradient_accumulation_steps != 1:
        out.append(
            (
                "no division by gradient_accumulation_steps",
                {"gradient_accumulation_steps": 1, "steps_per_generation": 1},
            )
        )
    if (
        c.loss_type.value in ("dapo", "cispo", "vespo")
        and c.steps_per_generation != c.gradient_accumulation_steps
    ):
        out.append(
            (
                f"steps_per_generation={c.gradient_accumulation_steps} (= gradient_accumulation_steps; config says "
                f"{c.steps_per_generation})",
                {"steps_per_generation": c.gradient_accumulation_steps},
            )
        )
    other_level = "sequence" if c.importance_sampling_level == "token" else "token"
    out.append((f"importance_sampling_level={other_level!r}", {"importance_sampling_level": other_level}))
    if c.delta is not None:
        out.append(("no two-sided clipping (delta=None)", {"delta": None}))
    if c.top_entropy_quantile < 1.0:
        out.append(("top_entropy_quantile=1.0 (every token trained)", {"top_entropy_quantile": 1.0}))
    if c.off_policy_mask_threshold is not None:
        out.append(
            ("no off-policy mask (off_policy_mask_threshold=None)", {"off_policy_mask_threshold": None})
        )
    if c.epsilon_high != c.epsilon_low:
        out.append((f"epsilon_high={c.epsilon_low:g} (symmetric clip)", {"epsilon_high": c.epsilon_low}))
    if c.num_processes != 1:
        out.append(("num_processes=1", {"num_processes": 1}))
    for kind in TrlLossType:
        if kind is not c.loss_type:
            out.append((f"loss_type={kind.value!r}", {"loss_type": kind}))
    return out


def _explain_mismatch(c, tensors, given, bad, close) -> str | None:
    for words, change in _candidates(c):
        try:
            alt = trl_loss(dataclasses.replace(c, **change), **tensors)
        except (ValueError, RuntimeError):
            continue
        if all(key in alt and close(given[key], alt[key]) for key in bad):
            return words
    return None


def trl_audit(
    config: TrlLossConfig,
    tensors: Mapping[str, torch.Tensor],
    reported: Mapping[str, float | None],
    *,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
) -> AuditReport:
    """Check TRL's ``reported`` numbers for one micro-batch against :func:`trl_loss` on ``tensors``."""
    batch = {k: tensors[k] for k in _TENSORS if tensors.get(k) is not None}
    mask = batch["response_mask"].bool()
    empty = not bool(mask.any())
    gap = None
    if not empty:
        diff = (batch["log_prob"].double() - batch["old_log_prob"].double()).abs()[mask]
        gap = float(diff.max()) if not torch.isnan(diff).any() else math.nan
    if config.unaudited is not None:
        return AuditReport(
            ok=True, empty=empty, reported={}, recomputed={}, verdicts={}, counterfactuals={}, on_policy_gap=gap,
            explanation=f"Not audited: {config.unaudited}. The tensors are kept; no reported number is checked.",
        )  # fmt: skip
    given: dict[str, float] = {}
    for name, value in reported.items():
        key = name.removeprefix("train/")
        if key in METRICS and value is not None:
            given[key] = float(value)
    notes: list[str] = []
    if config.beta != 0.0 and "ref_log_prob" not in batch:
        notes.append("beta is non-zero but ref_log_prob was not sent: nothing is checked")
        given = {}
    needs_entropy = config.entropy_bonus or config.top_entropy_quantile < 1.0
    if needs_entropy and "entropy" not in batch:
        notes.append("the loss uses entropies (entropy bonus or top_entropy_quantile) but none were sent")
        given = {}
    recomputed = {} if notes else trl_loss(config, **batch)
    for key in [k for k in given if k not in recomputed]:
        notes.append(f"{key} reported but not computed by {config.loss_type.value!r} from these tensors")
        given.pop(key)

    def close(a: float, b: float) -> bool:
        return _close(a, b, rtol, atol)

    verdicts = {}
    for key, value in given.items():
        abs_err, rel_err = _errors(value, recomputed[key])
        verdicts[key] = {"ok": close(value, recomputed[key]), "abs_err": abs_err, "rel_err": rel_err}
    bad = [k for k, v in verdicts.items() if not v["ok"]]
    lines: list[str] = []
    if not verdicts:
        lines.append("No reported metric to check; recomputed values are in 'recomputed'.")
    elif not bad:
        worst = max((v["rel_err"] for v in verdicts.values() if math.isfinite(v["rel_err"])), default=0.0)
        lines.append(
            f"All {len(verdicts)} reported metrics match {TRL_VERSION} (loss_type {config.loss_type.value!r}) "
            f"for this config (largest relative error {worst:.1e})."
        )
    else:
        found = _explain_mismatch(config, batch, given, bad, close)
        parts = [f"{k}: reported {_fmt(given[k])}, {TRL_VERSION} gives {_fmt(recomputed[k])}" for k in bad]
        line = "; ".join(parts) + " for this config."
        if found:
            line += f" The reported values equal TRL's loss with {found}: check that GRPOConfig option."
        else:
            line += (
                " No single GRPOConfig change (loss_type, use_bias_correction_kl, entropy_coef, "
                "gradient_accumulation_steps, steps_per_generation, importance_sampling_level, delta, "
                "top_entropy_quantile, off_policy_mask_threshold, epsilon_high) reproduces it: check that these "
                "are the tensors the loss was computed on, and that _compute_loss is not overridden."
            )
        lines.append(line)
    lines.extend(note[0].upper() + note[1:] + "." for note in notes)
    return AuditReport(
        ok=not bad,
        empty=empty,
        reported=given,
        recomputed=recomputed,
        verdicts=verdicts,
        explanation=" ".join(lines),
        counterfactuals={},
        on_policy_gap=gap,
    )
