"""TRL's ``GRPOTrainer`` loss types expressed as verl :class:`LossConfig` s, so a TRL run can be audited.

======== ======================================================== =========================================
TRL      TRL's aggregation of ``per_token_loss`` (B rows)          verl equivalent
======== ======================================================== =========================================
grpo     mean over rows of (row sum / max(row tokens, 1))         ``seq-mean-token-mean``
bnpo     sum / max(tokens in this micro-batch, 1)                 ``token-mean``, local normalisation
dr_grpo  sum / (B * max_completion_length)                        ``seq-mean-token-sum-norm``,
                                                                  ``loss_scale_factor=max_completion_length``
dapo     sum / (num_items_in_batch / num_processes)               ``token-mean`` with global
                                                                  ``batch_num_tokens=num_items_in_batch``,
                                                                  ``dp_size=num_processes``
======== ======================================================== =========================================

The clipped surrogate is the same (``-min(r A, clip(r, 1 - eps, 1 + eps_high) A)``); ``beta`` is
``kl_loss_coef`` with the k3 estimator (``low_var_kl``). Where the two differ (see
:data:`TRL_DIFFERENCES`), the mapped config reproduces TRL exactly only on batches that stay clear of
verl's clamps; the audit's explanation then names the difference instead of calling it a bug.
"""

from __future__ import annotations

from typing import Any

from .config import AggMode, KLType, LossConfig

NO_DUAL_CLIP = 1e30  # TRL has no dual clip: a bound the (e^20-capped) ratio never reaches

TRL_LOSS_TYPES: dict[str, AggMode] = {
    "grpo": AggMode.SEQ_MEAN_TOKEN_MEAN,
    "bnpo": AggMode.TOKEN_MEAN,
    "dr_grpo": AggMode.SEQ_MEAN_TOKEN_SUM_NORM,
    "dapo": AggMode.TOKEN_MEAN,
}

TRL_DIFFERENCES: tuple[str, ...] = (
    "No dual clip: a negative-advantage token's loss is not capped at -A*c (TRL's optional `delta`, "
    "two-sided clipping, caps the ratio at delta and maps to clip_ratio_c=delta).",
    "No ±20 clamp of the log-ratio before exp (verl clamps; TRL overflows to inf where verl stays finite).",
    "TRL's KL term is k3 without verl's clamps (±20 on the log-ratio, ±10 on the result).",
    "Empty sequences: TRL divides by max(tokens, 1), so an empty micro-batch gives 0 where verl gives NaN; "
    "'grpo' and 'dr_grpo' count empty rows in the batch size, verl counts only non-empty ones unless "
    "global_batch_size is given (trl_loss_config sets it from batch_size).",
    "Recent TRL divides the grpo/bnpo/dr_grpo micro-batch loss by gradient_accumulation_steps; "
    "trl_loss_config expresses that as global normalisation (global_batch_size or batch_num_tokens times the "
    "accumulation steps).",
    "No entropy bonus (entropy_coeff = 0); TRL's clip_ratio/region_mean is verl's pg_clipfrac, but TRL "
    "compares ratios where verl compares the rounded products A*r (identical except at exact ties).",
)


def trl_loss_config(
    loss_type: str,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    delta: float | None = None,
    max_completion_length: int | None = None,
    batch_size: int | None = None,
    num_tokens: int | None = None,
    gradient_accumulation_steps: int = 1,
    num_items_in_batch: int | None = None,
    num_processes: int = 1,
) -> LossConfig:
    """The :class:`LossConfig` whose verl loss equals TRL's ``loss_type`` loss on one micro-batch.

    Args mirror ``GRPOConfig`` (``epsilon``, ``epsilon_high``, ``beta``, ``delta``,
    ``max_completion_length``, ``loss_type``) plus what TRL knows at loss time: ``batch_size`` (rows in
    this micro-batch, to count empty rows as TRL does), ``num_tokens`` (valid tokens in it, for ``bnpo``
    with gradient accumulation), ``gradient_accumulation_steps`` (recent TRL divides grpo/bnpo/dr_grpo by
    it), and for ``dapo`` ``num_items_in_batch`` (global token count) and ``num_processes``.
    """
    mode = TRL_LOSS_TYPES.get(loss_type)
    if mode is None:
        allowed = ", ".join(repr(k) for k in TRL_LOSS_TYPES)
        raise ValueError(f"loss_type must be one of {allowed}; got {loss_type!r}")
    if gradient_accumulation_steps < 1:
        raise ValueError(
            f"gradient_accumulation_steps must be an integer >= 1; got {gradient_accumulation_steps!r}"
        )
    k = gradient_accumulation_steps
    fields: dict[str, Any] = {
        "clip_ratio": epsilon,
        "clip_ratio_low": epsilon,
        "clip_ratio_high": epsilon if epsilon_high is None else epsilon_high,
        "clip_ratio_c": NO_DUAL_CLIP if delta is None else delta,
        "loss_agg_mode": mode,
        "use_kl_loss": beta != 0.0,
        "kl_loss_type": KLType.LOW_VAR_KL,
        "kl_loss_coef": beta,
        "entropy_coeff": 0.0,
    }
    if loss_type in ("grpo", "dr_grpo"):
        if batch_size is not None:
            fields["global_batch_size"] = batch_size * k
        elif k > 1:
            raise ValueError(
                f"batch_size is required for loss_type {loss_type!r} with gradient_accumulation_steps > 1"
            )
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError(
                "max_completion_length is required for loss_type 'dr_grpo' (it is the loss_scale_factor)"
            )
        fields["loss_scale_factor"] = max_completion_length
    if loss_type == "bnpo" and k > 1:
        if num_tokens is None:
            raise ValueError(
                "num_tokens is required for loss_type 'bnpo' with gradient_accumulation_steps > 1"
            )
        fields["batch_num_tokens"] = num_tokens * k
    if loss_type == "dapo":
        if num_items_in_batch is None:
            raise ValueError("num_items_in_batch (the global token count) is required for loss_type 'dapo'")
        fields["batch_num_tokens"] = num_items_in_batch
        fields["dp_size"] = num_processes
    return LossConfig(**fields)
