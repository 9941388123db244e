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
from typing import Any

import torch

from ..contract.algorithm_config import AlgorithmConfig, training_batch_size  # noqa: F401  (re-exported)
from ..contract.rollout_config import RolloutCorrectionConfig
from ..fast.rollout import rollout_correction, rollout_debug_metrics
from ..reference.advantages import ADV_ESTIMATORS, BATCH_NORMALISED, compute_advantages
from ..reference.rollout import PREFIX

Tensor = torch.Tensor

ADVANTAGE_ATOL = 1e-4  # float32 advantages of a trainer against ours
ADVANTAGE_RTOL = 1e-4
METRIC_RTOL = 1e-4  # a trainer's GPU reductions differ from ours in summation order, not more
METRIC_ATOL = 1e-6
DEBUG_PREFIX = "training/rollout_"


def check_advantages(
    algorithm: AlgorithmConfig, tensors: Mapping[str, Tensor], *, batch_size: int | None = None
) -> dict[str, Any]:
    """Recompute ``algorithm.adv_estimator``'s advantages from ``token_level_rewards`` and
    ``group_index`` and compare with the sent ``advantages`` on valid tokens.

    An estimator that normalises over the whole batch verl ran it on (``reinforce_plus_plus`` and
    ``reinforce_plus_plus_baseline`` whiten over it, ``gpg`` scales by a count over it; see
    :data:`~rlvitals.analyzers.reference.advantages.BATCH_NORMALISED`) is checked exactly when the upload is that
    whole batch (``batch_size`` rows: :func:`training_batch_size`). An upload that is a part of it (fewer
    rows), or of unknown size that does not match exactly, is checked for what a part keeps: the sent
    advantages must be ``scale * raw + shift`` on valid tokens with one ``scale > 0`` (and ``shift``)
    fitted by least squares; ``scope`` is then ``"batch_statistics"`` and ``fitted`` holds the whole
    batch's statistics the fit implies (whitening: its ``mean`` and ``std``; gpg: ``scale``).

    Returns ``{"ok", "estimator", "max_abs_err", "norm_adv_by_std_in_grpo", "gamma", "scope", "rows",
    "batch_size", "explanation"}`` (+ ``"fitted"``, ``"exact_max_abs_err"`` in ``batch_statistics``
    scope); ``ok`` is None (with ``"skipped"``) when the estimator is not one reproduced here or cannot
    run on the batch.
    """
    name = algorithm.adv_estimator or "grpo"
    mask = tensors["response_mask"]
    rows = int(mask.shape[0])
    out: dict[str, Any] = {
        "estimator": name,
        "norm_adv_by_std_in_grpo": algorithm.norm_adv_by_std_in_grpo,
        "gamma": float(algorithm.gamma),
        "rows": rows,
        "batch_size": batch_size,
    }
    if name not in ADV_ESTIMATORS:
        return {**out, "ok": None, "max_abs_err": None,
                "skipped": f"adv_estimator {name!r} is not reproduced (valid: {', '.join(sorted(ADV_ESTIMATORS))})"}  # fmt: skip
    settings = {"gamma": float(algorithm.gamma), "norm_adv_by_std_in_grpo": algorithm.norm_adv_by_std_in_grpo}
    rewards, index = tensors["token_level_rewards"], tensors.get("group_index")
    form = BATCH_NORMALISED.get(name)
    skipped = None
    try:
        expected, _ = compute_advantages(name, rewards, mask, index, **settings)
    except ValueError as exc:  # e.g. grpo_passk with a group of one, whitening over one token
        if form is None or batch_size == rows:
            return {**out, "ok": None, "max_abs_err": None, "skipped": str(exc)}
        expected = None  # a part with one valid token: the whole batch's whitening still ran; fit below
        skipped = str(exc)
    valid = mask.bool()
    sent = tensors["advantages"].to(torch.float64)[valid]
    words = f"{name.upper()} advantages (adv_estimator={name!r})"
    if expected is not None:
        expected = expected.to(torch.float64)[valid]
        err = float((expected - sent).abs().max()) if sent.numel() else 0.0
        scale = float(expected.abs().max()) if sent.numel() else 0.0
        ok = err <= ADVANTAGE_ATOL + ADVANTAGE_RTOL * scale  # NaN compares False: a NaN is a mismatch
        if ok or form is None or batch_size == rows:
            whole = (
                f" over the whole batch ({rows} responses)" if form is not None and batch_size == rows else ""
            )
            explanation = (
                f"The sent advantages {'equal' if ok else 'differ from'} {words} recomputed{whole} from "
                f"token_level_rewards{' and group_index' if index is not None else ''}"
                + ("." if ok else f" by up to {err:.3g} ({_settings(algorithm)}).")
            )
            return {**out, "ok": bool(ok), "max_abs_err": err, "scope": "exact", "explanation": explanation}
    else:
        err = None
    try:
        raw = form.raw(rewards, mask, index, epsilon=1e-6, **settings).to(torch.float64)[valid]
    except ValueError as exc:  # the per-row part cannot run either (a group estimator without groups)
        return {**out, "ok": None, "max_abs_err": None, "skipped": skipped or str(exc)}
    fit = _affine_fit(raw, sent, shift=form.shift)
    part = (
        f"this upload holds {rows} of the batch's {batch_size} responses"
        if batch_size is not None
        else f"the run's config does not give the batch size (data.train_batch_size x "
        f"actor_rollout_ref.rollout.n), so this {rows}-response upload is taken as a part of it"
    )
    if batch_size is not None and rows > batch_size:
        part = f"this upload has more responses ({rows}) than the batch the config gives ({batch_size})"
    stats = ", ".join(f"{k} {v:.6g}" for k, v in fit["fitted"].items()) or "constant per-row values"
    if fit["ok"]:
        explanation = (
            f"The sent advantages equal {words} up to the whole batch's statistics: verl normalises them "
            f"with {form.statistic}, and {part}; checked that they are "
            f"{'one affine map' if form.shift else 'one positive multiple'} of the per-row values (fitted {stats})."
        )
    else:
        explanation = (
            f"The sent advantages are not {words} for any batch statistics: no single "
            f"{'scale and shift' if form.shift else 'scale'} ({form.statistic}) maps the per-row values "
            f"recomputed from token_level_rewards onto them; the best fit ({stats}) misses by up to "
            f"{fit['max_abs_err']:.3g} ({_settings(algorithm)}; {part})."
        )
    return {**out, "ok": fit["ok"], "max_abs_err": fit["max_abs_err"], "exact_max_abs_err": err,
            "scope": "batch_statistics", "fitted": fit["fitted"], "explanation": explanation}  # fmt: skip


def _settings(algorithm: AlgorithmConfig) -> str:
    return f"norm_adv_by_std_in_grpo={algorithm.norm_adv_by_std_in_grpo}, gamma={algorithm.gamma}"


def _affine_fit(raw: Tensor, sent: Tensor, *, shift: bool) -> dict[str, Any]:
    """Least squares ``sent ~ a * raw + b`` (``b = 0`` without ``shift``), ``a > 0`` required; float64.

    Whitening's ``(x - mean) / std`` is ``a = 1 / std``, ``b = -mean / std``: ``fitted`` gives ``mean``
    and ``std``; a pure scale gives ``scale``. Constant ``raw`` (no spread to fit a scale on) only asks
    ``sent`` to be constant (0 without shift)."""
    if sent.numel() == 0:
        return {"ok": True, "max_abs_err": 0.0, "fitted": {}}
    x_mean, y_mean = (raw.mean(), sent.mean()) if shift else (raw.new_zeros(()), raw.new_zeros(()))
    dx, dy = raw - x_mean, sent - y_mean
    spread = float((dx * dx).sum())
    if spread <= 1e-24 * max(1.0, float((raw * raw).sum())):  # constant raw: the scale is not determined
        a, b = None, float(y_mean)
        fitted_values = torch.full_like(sent, b)
    else:
        a = float((dx * dy).sum()) / spread
        b = float(y_mean) - a * float(x_mean)
        fitted_values = a * raw + b
    err = float((sent - fitted_values).abs().max())
    ok = err <= ADVANTAGE_ATOL + ADVANTAGE_RTOL * float(sent.abs().max())  # NaN: False
    if a is not None and not a > 0:
        ok = False  # advantages decreasing in the return: a sign flip, no whitening does that
    if a is None:
        fitted = {"shift": b} if shift else {}
    elif shift:
        fitted = {"mean": -b / a if a else math.nan, "std": 1.0 / a if a else math.inf}
    else:
        fitted = {"scale": a}
    return {"ok": bool(ok), "max_abs_err": err, "fitted": fitted}


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
    except ZeroDivisionError as exc:  # every weight 0 (IcePop, or -inf log-probs): verl's ESS divides by zero
        return {"ok": None, "config": config.to_dict(), "skipped": f"{exc} (verl raises ZeroDivisionError)"}
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
