"""The audit's search: which plausible misconfiguration reproduces a reported value that verl's
configured loss does not?

For one mismatched metric, candidates are generated in order of simplicity: single config changes
(each ``loss_agg_mode``; local vs global normalisation and ``dp_size``; symmetric vs asymmetric clip;
``clip_ratio_c``; KL estimator; coefficient signs), a few derived definitions (opposite sign, mask
ignored, one clip side only, no ±20 clamp, policy and reference swapped), then every other registered
``loss_mode`` (each one a full recomputation, so only when nothing cheaper explains it), then pairs of
changes. Each
candidate is recomputed exactly (the :class:`~.token_batch.TokenBatch` caches make that scalar arithmetic
on the fast path) and kept when it reproduces the reported value within the audit tolerance.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..contract.config import NO_DUAL_CLIP, AggMode, KLType, LossConfig
from ..fast.token_batch import TokenBatch
from ..fast.workspace import ieee_div

AGG_METRICS = ("pg_loss", "entropy_loss", "kl_loss", "policy_loss")
_DP_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_CLIP_EPS = (0.1, 0.2, 0.28, 0.3)


@dataclass(frozen=True)
class Alternative:
    """A way to get the reported value: the config changes (or derived definition) and its value."""

    metric: str
    description: str  # what reproduces it, e.g. "seq-mean-token-mean"
    config_says: str  # what the config says instead, e.g. "token-mean"
    value: float
    changes: dict[str, Any] = field(default_factory=dict)

    @property
    def sentence(self) -> str:
        return f"reported {self.metric} equals {self.description}; config says {self.config_says}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "description": self.description,
            "config_says": self.config_says,
            "value": self.value,
            "changes": {k: (v.value if hasattr(v, "value") else v) for k, v in self.changes.items()},
        }


def _show(name: str, value: Any) -> str:
    if isinstance(value, AggMode | KLType):
        return value.value if name in ("loss_agg_mode", "kl_loss_type") else f"{name}={value.value}"
    if name == "clip_ratio_c" and value >= NO_DUAL_CLIP:
        return "no dual clip"
    if name == "loss_mode":
        return f"loss_mode {value}"
    if name == "use_kl_loss":
        return "the KL term added to the loss" if value else "no KL term in the loss"
    if name == "kl_loss_type":
        return f"kl_loss_type={value}"
    if isinstance(value, float) and value.is_integer() and name != "clip_ratio_c":
        value = int(value)
    return f"{name}={value}"


def _clip_words(config: LossConfig) -> str:
    if config.clip_low == config.clip_high:
        return f"symmetric clip ±{config.clip_low:g}"
    return f"asymmetric clip (low {config.clip_low:g}, high {config.clip_high:g})"


def _describe(config: LossConfig, alt: LossConfig, changes: dict[str, Any]) -> tuple[str, str]:
    """("seq-mean-token-mean with dp_size=8", "token-mean with dp_size=1")"""
    new: list[str] = []
    old: list[str] = []
    clip_keys = {"clip_ratio", "clip_ratio_low", "clip_ratio_high"}
    if clip_keys & set(changes):
        new.append(_clip_words(alt))
        old.append(_clip_words(config))
    for name, value in changes.items():
        if name in clip_keys or getattr(config, name) == value:
            continue
        new.append(_show(name, value))
        old.append(_show(name, getattr(config, name)))
    if not new:  # every change was a no-op spelling of the same setting
        return "the configured settings", "the same"

    def join(parts: list[str]) -> str:
        return parts[0] if len(parts) == 1 else f"{parts[0]} with {', '.join(parts[1:])}"

    return join(new), join(old)


# -- candidate config changes -----------------------------------------------------------------------
def _mode_changes(config: LossConfig) -> Iterator[dict[str, Any]]:
    for mode in AggMode:
        if mode is not config.loss_agg_mode:
            yield {"loss_agg_mode": mode}


def _loss_mode_changes(config: LossConfig) -> Iterator[dict[str, Any]]:
    """Every other registered loss mode that gives one value per batch (``clip_cov`` draws at random;
    ``dro`` needs a ``dro_beta``; ``bypass_mode`` is vanilla on these tensors when nothing is rejected)."""
    from ..reference.policy_losses import POLICY_LOSSES

    for name, entry in POLICY_LOSSES.items():
        if name == config.loss_mode or entry.random or name == "bypass_mode":
            continue
        if name == "dro" and config.dro_beta is None:
            continue
        yield {"loss_mode": name}


def _norm_changes(config: LossConfig, batch: TokenBatch) -> Iterator[dict[str, Any]]:
    """Local vs global normalisation and the dp_size multiplier."""
    local = {"batch_num_tokens": batch.n_tokens, "global_batch_size": batch.n_seqs}
    if config.batch_num_tokens is not None or config.global_batch_size is not None or config.dp_size != 1:
        yield {"batch_num_tokens": None, "global_batch_size": None, "dp_size": 1}
    if config.batch_num_tokens is not None or config.global_batch_size is not None:
        yield local
    for dp in _DP_SIZES:
        if dp != config.dp_size:
            yield {"dp_size": dp}  # the configured global counts (refused by verl when there are none)
            yield {"dp_size": dp, **local}  # dp multiplier on this micro-batch's own counts
    if config.loss_scale_factor is not None:
        yield {"loss_scale_factor": None}


def implied_normaliser(config: LossConfig, batch: TokenBatch, metric: str, reported: float) -> float | None:
    """The token (token-mean) or sequence (seq-*) count that would make ``metric`` equal ``reported``."""
    if metric not in ("pg_loss", "entropy_loss", "kl_loss") or config.loss_agg_mode is AggMode.TOKEN_SUM:
        return None
    if reported == 0 or not math.isfinite(reported):
        return None
    probe = dataclasses.replace(config, batch_num_tokens=1, global_batch_size=1)
    value = _metric_value(batch, probe, metric)  # = X / 1, so the normaliser is X / reported
    if value is None or not math.isfinite(value):
        return None
    implied = value / reported
    return implied if implied > 0 else None


def _clip_changes(config: LossConfig) -> Iterator[dict[str, Any]]:
    if (
        config.clip_low != config.clip_high
        or config.clip_ratio_low is not None
        or config.clip_ratio_high is not None
    ):
        yield {"clip_ratio_low": None, "clip_ratio_high": None}
    for eps in _CLIP_EPS:
        yield {"clip_ratio_low": config.clip_low, "clip_ratio_high": eps}
        yield {"clip_ratio_low": eps, "clip_ratio_high": config.clip_high}
        yield {"clip_ratio_low": eps, "clip_ratio_high": eps}
    if config.clip_low != config.clip_high and config.clip_high <= 1:
        yield {"clip_ratio_low": config.clip_high, "clip_ratio_high": config.clip_low}
    for c in (3.0, 10.0, 1.5, 2.0, 5.0, NO_DUAL_CLIP):
        if c != config.clip_ratio_c:
            yield {"clip_ratio_c": c}


def _kl_changes(config: LossConfig) -> Iterator[dict[str, Any]]:
    for kind in (KLType.K1, KLType.ABS, KLType.K2, KLType.K3):
        if kind.base != config.kl_loss_type.base:
            yield {"kl_loss_type": kind}


def _coef_changes(config: LossConfig) -> Iterator[dict[str, Any]]:
    if config.entropy_coeff != 0:
        yield {"entropy_coeff": -config.entropy_coeff}
        yield {"entropy_coeff": 0.0}
    if config.kl_loss_coef != 0:
        yield {"kl_loss_coef": -config.kl_loss_coef}
    yield {"use_kl_loss": not config.use_kl_loss}


def _coef_combos(config: LossConfig) -> Iterator[dict[str, Any]]:
    """Coefficient settings for the total loss: sign flips, dropped terms, verl's defaults; in pairs."""
    entropy = [{}] + [{"entropy_coeff": c} for c in dict.fromkeys((-config.entropy_coeff, 0.0, 0.001, 0.01))]
    kl = [{}, {"use_kl_loss": not config.use_kl_loss}] + [
        {"kl_loss_coef": c, "use_kl_loss": True}
        for c in dict.fromkeys((-config.kl_loss_coef, 0.001, 0.01, 0.1))
    ]
    for e, k in itertools.product(entropy, kl):
        if e or k:
            yield {**e, **k}


def _single_changes(config: LossConfig, batch: TokenBatch, metric: str, reported: float) -> Iterator[dict]:
    if metric in AGG_METRICS:
        yield from _mode_changes(config)
        yield from _norm_changes(config, batch)
    if metric in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "policy_loss"):
        yield from _clip_changes(config)
    if metric in ("kl_loss", "policy_loss"):
        yield from _kl_changes(config)
    if metric == "policy_loss":
        yield from _coef_changes(config)


def _pair_changes(config: LossConfig, batch: TokenBatch, metric: str, reported: float) -> Iterator[dict]:
    if metric not in AGG_METRICS:
        return
    norms = list(_norm_changes(config, batch))
    others: list[dict] = []
    if metric in ("pg_loss", "policy_loss"):
        others += list(_clip_changes(config))
    if metric in ("kl_loss", "policy_loss"):
        others += list(_kl_changes(config))
    if metric == "policy_loss":
        others += list(_coef_combos(config))
    for mode in _mode_changes(config):
        for other in norms + others:
            yield {**mode, **other}
    for norm, other in itertools.product(norms, others):
        yield {**norm, **other}


# -- derived definitions ----------------------------------------------------------------------------
def _masked(batch: TokenBatch, values: torch.Tensor) -> float:
    return float(torch.where(batch.mask, values, 0.0).sum())


def _derived(
    batch: TokenBatch, metric: str, recomputed: float, config: LossConfig
) -> Iterator[tuple[str, Callable[[], float]]]:
    n = batch.n_tokens
    yield "the opposite sign (an objective rather than a loss, or a flipped difference)", lambda: -recomputed
    if metric == "ppo_kl":

        def delta(clamp: bool) -> torch.Tensor:
            d = batch.tensors["old_log_prob"].double() - batch.tensors["log_prob"].double()
            return d.clamp(-20, 20) if clamp else d

        yield (
            "the masked mean of old_log_prob - log_prob without the ±20 clamp",
            lambda: _masked(batch, delta(False)) / (n + 1e-8),
        )
        yield (
            "the mean over every position (response_mask ignored)",
            lambda: float(delta(True).sum()) / max(delta(True).numel(), 1),
        )
        yield (
            "the masked mean of |log_prob - old_log_prob|",
            lambda: _masked(batch, delta(True).abs()) / (n + 1e-8),
        )
        yield (
            "the k3 estimate (r - 1) - log r of the ratio",
            lambda: _masked(batch, torch.expm1(-delta(True)) + delta(True)) / (n + 1e-8),
        )
    if metric in ("pg_clipfrac", "pg_clipfrac_lower"):
        total = batch.shape[0] * batch.shape[1]
        yield (
            "a share of every position (response_mask ignored)",
            lambda: recomputed * (n + 1e-8) / max(total, 1),
        )
    if metric == "kl_loss" and "ref_log_prob" in batch.tensors:
        yield "the KL with log_prob and ref_log_prob swapped", lambda: _swapped_kl(batch, config)
    if config.loss_mode != "vanilla":  # the clip-fraction variants below are vanilla's definitions
        return
    if metric == "pg_clipfrac":
        yield (
            "only tokens clipped at the upper bound 1 + clip_ratio_high",
            lambda: _clipfrac(batch, config, low=1.0),
        )
        yield (
            "only tokens clipped at the lower bound 1 - clip_ratio_low",
            lambda: _clipfrac(batch, config, high=NO_DUAL_CLIP),
        )
        yield (
            "a share that also counts dual-clipped tokens",
            lambda: recomputed + batch.metrics(config)["pg_clipfrac_lower"],
        )
    if metric == "pg_clipfrac_lower":
        yield "a share of the negative-advantage tokens only", lambda: _dual_share_of_negatives(batch, config)


def _clipfrac(batch: TokenBatch, config: LossConfig, **bounds: float) -> float:
    low = bounds.get("low", config.clip_low)
    high = bounds.get("high", config.clip_high)
    alt = dataclasses.replace(config, clip_ratio_low=low, clip_ratio_high=high)
    return batch.metrics(alt)["pg_clipfrac"]


def _dual_share_of_negatives(batch: TokenBatch, config: LossConfig) -> float:
    negatives = int((batch.mask & (batch.tensors["advantages"] < 0)).sum())
    return ieee_div(batch.metrics(config)["pg_clipfrac_lower"] * (batch.n_tokens + 1e-8), negatives)


def _swapped_kl(batch: TokenBatch, config: LossConfig) -> float:
    swapped = TokenBatch(
        log_prob=batch.tensors["ref_log_prob"],
        old_log_prob=batch.tensors["old_log_prob"],
        advantages=batch.tensors["advantages"],
        response_mask=batch.mask,
        ref_log_prob=batch.tensors["log_prob"],
    )
    return swapped.metrics(config)["kl_loss"]


# -- the search -------------------------------------------------------------------------------------
def _metric_value(batch: TokenBatch, config: LossConfig, metric: str) -> float | None:
    try:
        return batch.metrics(config).get(metric)
    except ValueError:  # a loss verl itself would refuse on this batch (bypass_mode on an empty mask)
        return None


def find_alternatives(
    batch: TokenBatch,
    config: LossConfig,
    metric: str,
    reported: float,
    recomputed: float,
    close: Callable[[float, float], bool],
    *,
    limit: int = 3,
    max_candidates: int | None = None,
    bases: list[dict[str, Any]] | None = None,
) -> list[Alternative]:
    """Up to ``limit`` alternatives that reproduce ``reported`` for ``metric``, simplest first.

    ``bases`` are change sets that already explained other metrics (e.g. the aggregation mode that
    reproduces pg_loss); for ``policy_loss`` they are tried first, alone and with every coefficient
    setting on top. ``max_candidates`` bounds the work (the reference path recomputes every candidate
    in full).
    """
    if max_candidates is None:
        fused = batch.fast and batch.finite and config.loss_mode == "vanilla"
        max_candidates = 4000 if fused else 300  # other modes recompute every candidate in full
    found: list[Alternative] = []
    seen: set[LossConfig] = {config}
    tried = 0

    inert = set()  # settings that cannot change anything for lack of the tensor they act on
    if batch.tensors.get("entropy") is None:
        inert.add("entropy_coeff")
    if batch.tensors.get("ref_log_prob") is None:
        inert.update({"kl_loss_coef", "kl_loss_type", "use_kl_loss"})

    def try_config(changes: dict[str, Any]) -> None:
        nonlocal tried
        if inert & set(changes):
            return
        try:
            alt = dataclasses.replace(config, **changes)
        except ValueError:  # e.g. dp_size > 1 without global counts: verl itself would refuse
            return
        if alt in seen or (alt.use_kl_loss and batch.tensors.get("ref_log_prob") is None):
            return
        seen.add(alt)
        tried += 1
        value = _metric_value(batch, alt, metric)
        if value is not None and close(reported, value):
            description, says = _describe(config, alt, changes)
            if all(a.description != description for a in found):
                found.append(Alternative(metric, description, says, value, changes))

    if metric == "policy_loss":
        for base in bases or []:
            for extra in [{}, *_coef_combos(config)]:
                if len(found) >= limit or tried >= max_candidates:
                    return found
                try_config({**base, **extra})
        if found:
            return found
    for changes in _single_changes(config, batch, metric, reported):
        if len(found) >= limit or tried >= max_candidates:
            return found
        try_config(changes)
    for description, compute in _derived(batch, metric, recomputed, config):
        if len(found) >= limit:
            return found
        value = compute()
        if close(reported, value):
            found.append(Alternative(metric, description, _configured(metric, config), value))
    if found:
        return found
    if metric in ("pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower", "policy_loss"):
        for changes in _loss_mode_changes(config):  # each recomputes the batch in full: only when needed
            if len(found) >= limit:
                return found
            try_config(changes)
    if found:
        return found
    for changes in _pair_changes(config, batch, metric, reported):
        if len(found) >= limit or tried >= max_candidates:
            break
        try_config(changes)
    return found


def _configured(metric: str, config: LossConfig) -> str:
    return {
        "ppo_kl": "ppo_kl = masked mean of clamp(old_log_prob - log_prob, ±20)",
        "pg_clipfrac": f"clip band [1 - {config.clip_low}, 1 + {config.clip_high}], both sides, over valid tokens",
        "pg_clipfrac_lower": f"dual clip at c = {config.clip_ratio_c} as a share of all valid tokens",
        "kl_loss": f"kl_loss_type={config.kl_loss_type.value} of log_prob vs ref_log_prob",
    }.get(metric, f"{metric} as a loss with {config.loss_agg_mode.value}")


def _local(config: LossConfig, mode: AggMode) -> LossConfig:
    try:
        return dataclasses.replace(config, loss_agg_mode=mode)
    except ValueError:  # dp_size > 1 without the global count this mode needs
        return dataclasses.replace(
            config, loss_agg_mode=mode, dp_size=1, batch_num_tokens=None, global_batch_size=None
        )


# -- counterfactuals across loss modes ----------------------------------------------------------------
POLICY_METRICS = ("pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")


def loss_mode_counterfactuals(batch: TokenBatch, config: LossConfig) -> dict[str, dict[str, Any]]:
    """What this batch's policy metrics would be under every registered loss mode: ``{mode: {pg_loss,
    <the metrics that mode reports>, pg_loss_by_agg_mode: {agg: pg_loss}}}``, the other settings as
    configured. One loss call per mode: its token-loss matrix is captured and re-aggregated for the
    other modes (``sapo`` and ``geo_mean`` ignore ``loss_agg_mode``, as in verl). ``clip_cov`` draws its
    tokens with ``torch.randperm``: it gets ``pg_loss_range``, the range over all draws. Left out: ``dro`` without a
    ``dro_beta``, and a mode verl would refuse on this batch (``bypass_mode`` on an empty mask)."""
    from ..reference.losses import agg_loss
    from ..reference.policy_losses import POLICY_LOSSES

    t = batch.tensors
    info = config.global_batch_info
    args = (t["old_log_prob"], t["log_prob"], t["advantages"], batch.mask)
    weights = t.get("rollout_is_weights")
    out: dict[str, dict[str, Any]] = {}
    local_info: dict[AggMode, dict[str, Any]] = {}  # per aggregation mode, the same for every loss mode
    for name, entry in POLICY_LOSSES.items():
        if name == "dro" and config.dro_beta is None:
            continue
        cfg = dataclasses.replace(config, loss_mode=name)
        if entry.random and entry.bounds is not None:  # one draw says little: the range of all draws
            lo, hi = entry.bounds(*args, config.loss_agg_mode, cfg, weights)
            out[name] = {"pg_loss_range": [lo, hi]}
            continue
        if name == "vanilla" and batch.fast and batch.finite and weights is None:
            try:  # the fused pass: every aggregation mode is scalar arithmetic on its row sums
                by_agg = {mode.value: batch.metrics(_local(cfg, mode))["pg_loss"] for mode in AggMode}
                row = {k: v for k, v in batch.metrics(cfg).items() if k in POLICY_METRICS}
                out[name] = {**row, "pg_loss_by_agg_mode": by_agg}
                continue
            except ValueError:
                pass
        elif batch.fast and batch.finite and weights is None:
            try:  # the mode's fused pass, when it has one: its row sums give every aggregation
                metrics = batch.metrics(cfg)
            except ValueError:
                continue
            fused = batch.pg_rows(cfg)
            if fused is not None or not entry.uses_agg_mode:
                row = {k: v for k, v in metrics.items() if k in POLICY_METRICS}
                if fused is None:  # one number whatever loss_agg_mode says (geo_mean)
                    by_agg = {mode.value: row["pg_loss"] for mode in AggMode}
                else:
                    rows, fixed = fused
                    for mode in AggMode:
                        if mode not in local_info:
                            local_info[mode] = _local(cfg, mode).global_batch_info
                    by_agg = {
                        mode.value: batch.aggregate(rows, fixed or mode, **local_info[mode])
                        for mode in AggMode
                    }
                out[name] = {**row, "pg_loss_by_agg_mode": by_agg}
                continue
        try:
            metrics = batch.policy_metrics(cfg)  # memoised: shared with the alternative search
            inputs = batch.policy_agg_inputs(cfg)
        except ValueError:
            continue
        pg_loss = metrics.pop("pg_loss")
        captured = [inputs] if inputs is not None else []
        row: dict[str, Any] = {"pg_loss": float(pg_loss)}
        row.update({k: float(v) for k, v in metrics.items() if k in POLICY_METRICS})
        by_agg: dict[str, float | None] = {}
        for mode in AggMode:
            if not entry.uses_agg_mode:
                by_agg[mode.value] = float(pg_loss)  # the loss ignores loss_agg_mode (sapo, geo_mean)
                continue
            try:
                if captured and captured[-1][2] == str(config.loss_agg_mode):
                    mat, mask, _ = captured[-1]  # the token losses, re-aggregated
                    by_agg[mode.value] = float(agg_loss(mat, mask, mode, **info))
                else:  # a loss that aggregates more than once: compute it again
                    by_agg[mode.value] = batch.policy_metrics(dataclasses.replace(cfg, loss_agg_mode=mode))[
                        "pg_loss"
                    ]
            except ValueError:  # dp_size > 1 without this mode's global count: verl refuses too
                by_agg[mode.value] = None
        row["pg_loss_by_agg_mode"] = by_agg
        out[name] = row
    return out
