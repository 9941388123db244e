"""Audit: recompute a micro-batch's loss metrics as verl 0.9.1 would, compare them with what the
trainer reported, and explain any disagreement.

``audit(config, tensors, reported)`` returns an :class:`AuditReport`: per metric the reported and
recomputed value with absolute/relative error and a verdict; for each mismatch, the simplest
alternative configuration that reproduces the reported number (see :mod:`.alternatives`), named in
plain words ("reported pg_loss equals seq-mean-token-mean; config says token-mean"); what-if values
under other settings (:func:`counterfactuals`); the on-policy gap ``max |log_prob - old_log_prob|``
over valid tokens, which must be ~0 on the first mini-batch of fresh rollouts (when it is not, the
actor's forward disagrees with the one that produced ``old_log_prob``: a known rollout/actor mismatch
bug class); and whether the batch was empty (no valid token: verl's token-mean and seq-* losses are
NaN there, which is then what we expect the trainer to report).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..contract.audit_names import canonical_name
from ..contract.batch import CheckedTensors
from ..contract.batch_rules import NAN, POS_INF
from ..contract.config import AggMode, KLType, LossConfig
from ..fast.dispatch import token_batch
from ..fast.token_batch import TokenBatch
from .alternatives import (
    NO_DUAL_CLIP,
    Alternative,
    find_alternatives,
    implied_normaliser,
    loss_mode_counterfactuals,
)
from .chunks import row_chunks

METRICS = ("pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower", "entropy_loss", "kl_loss", "policy_loss")
DEFAULT_RTOL = 1e-4  # a trainer's GPU reductions differ from ours in summation order, not more
DEFAULT_ATOL = 1e-6
DEFAULT_ON_POLICY_TOL = 1e-3
# An audit adds the what-ifs under every other loss mode (one full loss computation each) up to this many
# valid tokens; counterfactuals(config, tensors) always computes them.
AUDIT_LOSS_MODE_TOKENS = 1 << 16
_BATCH_KEYS = (
    "log_prob",
    "old_log_prob",
    "advantages",
    "response_mask",
    "ref_log_prob",
    "entropy",
    "rollout_is_weights",
)


_canonical = canonical_name  # the audit's names: see .audit_names (torch-free, the service reads it too)


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * abs(b)


def _errors(reported: float, recomputed: float) -> tuple[float, float]:
    if math.isnan(reported) and math.isnan(recomputed):
        return 0.0, 0.0
    abs_err = abs(reported - recomputed)
    if math.isnan(abs_err):
        return math.inf, math.inf
    if recomputed == 0:
        return abs_err, (0.0 if abs_err == 0 else math.inf)
    return abs_err, abs_err / abs(recomputed)


@dataclass
class AuditReport:
    """The outcome of one audit; ``to_dict()`` is the JSON shape the service stores and serves."""

    ok: bool
    empty: bool
    reported: dict[str, float]
    recomputed: dict[str, float]
    verdicts: dict[str, dict[str, Any]]
    explanation: str
    counterfactuals: dict[str, Any]
    on_policy_gap: float | None
    alternatives: dict[str, list[Alternative]] = field(default_factory=dict)
    summary: str = ""  # one sentence: how many metrics disagree and the likeliest reason
    details: dict[str, str] = field(default_factory=dict)  # per mismatched metric, its part of explanation
    decided_by: str = "fast"  # "reference" when the reference path recomputed a disagreement
    # metric -> {"fast", "reference"} where the two paths disagreed (a fast-path defect)
    fast_path_defect: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def mismatched(self) -> list[str]:
        return [name for name, verdict in self.verdicts.items() if not verdict["ok"]]

    @property
    def verdict(self) -> str:
        """``agree`` or ``mismatch`` (a batch that cannot be recomputed never gets a report)."""
        return "agree" if self.ok else "mismatch"

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": bool(self.ok),
            "verdict": self.verdict,
            "decided_by": self.decided_by,
            "fast_path_defect": {
                k: {p: float(x) for p, x in v.items()} for k, v in self.fast_path_defect.items()
            },
            "empty": bool(self.empty),
            "reported": {k: float(v) for k, v in self.reported.items()},
            "recomputed": {k: float(v) for k, v in self.recomputed.items()},
            "verdicts": {k: _verdict_dict(v) for k, v in self.verdicts.items()},
            "explanation": self.explanation,
            "summary": self.summary or self.explanation,
            "details": dict(self.details),
            "counterfactuals": self.counterfactuals,
            "on_policy_gap": None if self.on_policy_gap is None else float(self.on_policy_gap),
        }


def _verdict_dict(v: dict[str, Any]) -> dict[str, Any]:
    out = {"ok": bool(v["ok"]), "abs_err": float(v["abs_err"]), "rel_err": float(v["rel_err"])}
    if "range" in v:
        out["range"] = [float(x) for x in v["range"]]
    return out


def _batch(tensors: Mapping[str, torch.Tensor]) -> TokenBatch:
    missing = [k for k in ("log_prob", "old_log_prob", "advantages", "response_mask") if k not in tensors]
    if missing:
        raise ValueError(
            f"tensors is missing {missing}; an audit needs log_prob, old_log_prob, advantages, response_mask"
        )
    # the contract's per-tensor check runs here for a direct caller, and not again for an AuditBatch's
    # tensors (checked when the batch was validated). Dense: the audit aggregates every way, the
    # seq-mean modes included, and those count what lies under the mask (token_batch.TokenBatch)
    kind = CheckedTensors if isinstance(tensors, CheckedTensors) else dict
    picked = kind((k, tensors[k]) for k in _BATCH_KEYS if k in tensors and tensors[k] is not None)
    return token_batch(picked, dense=True)


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _on_policy_gap(batch: TokenBatch) -> float | None:
    if batch.empty:
        return None
    log_prob, old_log_prob, mask = batch.tensors["log_prob"], batch.tensors["old_log_prob"], batch.mask
    largest = -math.inf
    for rows in row_chunks(log_prob):  # a few rows at a time: no float64 copy of the whole batch
        gap = (log_prob[rows].double() - old_log_prob[rows].double()).abs()[mask[rows]]
        if torch.isnan(gap).any():
            return math.nan
        if gap.numel():
            largest = max(largest, float(gap.max()))
    return largest


def audit(
    config: LossConfig,
    tensors: Mapping[str, torch.Tensor],
    reported: Mapping[str, float | None],
    *,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    on_policy: bool = False,
    on_policy_tol: float = DEFAULT_ON_POLICY_TOL,
    with_counterfactuals: bool = True,
) -> AuditReport:
    """Check ``reported`` metrics of one micro-batch against verl 0.9.1 recomputed from ``tensors``.

    Args:
        config: the loss settings the trainer claims to use (``LossConfig.from_verl(actor_cfg)``).
        tensors: the HTTP batch names, ``(batch, response_len)``: ``log_prob``, ``old_log_prob``,
            ``advantages``, ``response_mask``, optional ``ref_log_prob``, ``entropy`` (other keys such
            as ``token_level_rewards`` / ``group_index`` are ignored here).
        reported: the trainer's numbers; bare (``pg_loss``) or verl-prefixed (``actor/pg_loss``) names;
            None values are skipped.
        on_policy: this is the first mini-batch of fresh rollouts, so ``old_log_prob`` must equal
            ``log_prob``; a gap above ``on_policy_tol`` fails the audit.
    """
    batch = _batch(tensors)
    given = {}
    for name, value in reported.items():
        key = _canonical(name)
        if key in METRICS and value is not None:
            try:
                given[key] = float(value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"reported[{name!r}] must be a number (or {NAN!r}/{POS_INF!r}); got {value!r}"
                ) from None
    notes: list[str] = []
    effective = config
    if config.use_kl_loss and batch.tensors.get("ref_log_prob") is None:
        effective = dataclasses.replace(config, use_kl_loss=False)
        notes.append(
            "use_kl_loss is on but ref_log_prob was not sent: kl_loss and policy_loss are not checked"
        )
        given.pop("policy_loss", None)
    if config.entropy_coeff != 0 and batch.tensors.get("entropy") is None and "policy_loss" in given:
        notes.append("entropy_coeff is non-zero but entropy was not sent: policy_loss is not checked")
        given.pop("policy_loss")
    recomputed = batch.metrics(effective)
    for key in [k for k in given if k not in recomputed]:
        if key in ("kl_loss", "entropy_loss"):
            needs = "ref_log_prob" if key == "kl_loss" else "entropy"
            notes.append(f"{key} reported but {needs} was not sent: not checked")
        else:
            notes.append(
                f"{key} reported but verl's loss_mode {config.loss_mode!r} computes none: not checked"
            )
        given.pop(key)
    ranges = _random_ranges(batch, effective, recomputed)
    if ranges:
        lo, hi = ranges["pg_loss"]
        notes.append(
            f"loss_mode {config.loss_mode!r} picks the tokens it zeroes with torch.randperm, so pg_loss and "
            f"policy_loss are checked as the range any draw gives (pg_loss in [{_fmt(lo)}, {_fmt(hi)}]); "
            "the other metrics exactly"
        )

    def close(a: float, b: float) -> bool:
        return _close(a, b, rtol, atol)

    verdicts: dict[str, dict[str, Any]] = {}
    for key, value in given.items():
        if key in ranges:
            verdicts[key] = _range_verdict(value, ranges[key], rtol, atol)
            continue
        abs_err, rel_err = _errors(value, recomputed[key])
        verdicts[key] = {"ok": close(value, recomputed[key]), "abs_err": abs_err, "rel_err": rel_err}
    recomputed, decided_by, defect = _arbitrate(batch, effective, given, recomputed, verdicts, close)

    alternatives: dict[str, list[Alternative]] = {}
    for key in sorted(verdicts, key=lambda k: k == "policy_loss"):  # the total last: it builds on the parts
        if verdicts[key]["ok"] or batch.empty or key in ranges:
            continue
        bases = [found[0].changes for found in alternatives.values() if found and found[0].changes]
        alternatives[key] = find_alternatives(
            batch, effective, key, given[key], recomputed[key], close, bases=bases
        )

    gap = _on_policy_gap(batch)
    on_policy_ok = not on_policy or gap is None or (not math.isnan(gap) and gap <= on_policy_tol)
    ok = all(v["ok"] for v in verdicts.values()) and on_policy_ok
    details: dict[str, str] = {}
    explanation = _explain(
        batch, effective, given, recomputed, verdicts, alternatives, gap, on_policy, on_policy_tol, notes,
        details,
    )  # fmt: skip
    summary = _summarise(verdicts, alternatives, explanation)
    return AuditReport(
        ok=ok,
        empty=batch.empty,
        reported=given,
        recomputed=recomputed,
        verdicts=verdicts,
        explanation=explanation,
        counterfactuals=_counterfactuals(batch, effective) if with_counterfactuals else {},
        on_policy_gap=gap,
        alternatives=alternatives,
        summary=summary,
        details=details,
        decided_by=decided_by,
        fast_path_defect=defect,
    )


def _arbitrate(batch: TokenBatch, config: LossConfig, given, recomputed, verdicts, close):
    """The reference path decides before anything is called wrong: when a metric the fast path
    recomputed disagrees with the reported one, every metric is recomputed by verl's own op
    sequence (:meth:`TokenBatch.reference_metrics`, readable torch) and judged on that. Returns the
    metrics judged on, who decided (``fast`` / ``reference``) and, metric by metric, where the two
    paths disagreed with each other: a fast-path defect (it costs time, never a false alarm).
    Updates ``verdicts`` in place."""
    if all(v["ok"] for v in verdicts.values()) or batch.empty_reference:
        return recomputed, "fast", {}
    reference = batch.reference_metrics(config)
    defect = {
        key: {"fast": value, "reference": reference[key]}
        for key, value in recomputed.items()
        if key in reference and not close(value, reference[key])
    }
    for key, verdict in verdicts.items():
        if "range" in verdict or key not in reference:
            continue
        abs_err, rel_err = _errors(given[key], reference[key])
        verdict.update(ok=close(given[key], reference[key]), abs_err=abs_err, rel_err=rel_err)
    return {**recomputed, **reference}, "reference", defect


def _summarise(verdicts, alternatives, explanation: str) -> str:
    """One sentence for a list of audits: how many reported metrics disagree and, when one
    alternative setting explains the first of them, that setting. Matches keep the explanation."""
    bad = [k for k, v in verdicts.items() if not v["ok"]]
    if not bad:
        return explanation
    head = f"{len(bad)} of {len(verdicts)} reported metrics disagree ({', '.join(bad)})"
    for key in bad:
        found = alternatives.get(key) or []
        if found:
            return f"{head}: {found[0].sentence}."
    return f"{head}; no single alternative setting reproduces them."


def _explain(
    batch,
    config,
    given,
    recomputed,
    verdicts,
    alternatives,
    gap,
    on_policy,
    on_policy_tol,
    notes,
    details=None,
) -> str:
    lines: list[str] = []
    if batch.empty:
        lines.append(
            "Empty batch: response_mask has no valid token, so verl's token-mean and seq-* losses are NaN "
            "(0/0), token-sum is 0 and ppo_kl / clip fractions are 0; nothing was learned from it."
        )
    bad = [k for k, v in verdicts.items() if not v["ok"]]
    if not verdicts:
        lines.append("No reported metric to check; recomputed values are in 'recomputed'.")
    elif not bad:
        worst = max((v["rel_err"] for v in verdicts.values() if math.isfinite(v["rel_err"])), default=0.0)
        lines.append(
            f"All {len(verdicts)} reported metrics match verl 0.9.1 for this config "
            f"(largest relative error {worst:.1e})."
        )
    for key in bad:
        if "range" in verdicts[key]:
            lo, hi = verdicts[key]["range"]
            lines.append(
                f"{key}: reported {_fmt(given[key])}, outside [{_fmt(lo)}, {_fmt(hi)}], every value verl 0.9.1's "
                f"random draw can give for this config."
            )
            continue
        head = f"{key}: reported {_fmt(given[key])}, verl 0.9.1 gives {_fmt(recomputed[key])} for this config"
        found = alternatives.get(key) or []
        if found:
            line = f"{head}. {found[0].sentence[0].upper()}{found[0].sentence[1:]}."
            if len(found) > 1:
                line += " Also consistent: " + "; ".join(a.description for a in found[1:]) + "."
        elif batch.empty:
            line = f"{head}."
        else:
            line = (
                f"{head}; no single alternative (aggregation mode, normalisation, dp_size, clip settings, "
                "KL type, coefficient signs) reproduces it. Check that these tensors are the ones the loss "
                "was computed on (same forward pass, advantages after any whitening)."
            )
            implied = implied_normaliser(config, batch, key, given[key])
            if implied is not None:
                unit, have = (
                    ("tokens", batch.n_tokens)
                    if config.loss_agg_mode is AggMode.TOKEN_MEAN
                    else ("sequences", batch.n_seqs)
                )
                line += (
                    f" The reported value implies normalising by {implied:.6g} {unit} "
                    f"(this micro-batch has {have})."
                )
        lines.append(line)
        if details is not None:
            details[key] = line
    if gap is not None:
        if on_policy and (math.isnan(gap) or gap > on_policy_tol):
            lines.append(
                f"On-policy mini-batch but log_prob differs from old_log_prob by up to {_fmt(gap)} "
                f"(tolerance {on_policy_tol:g}): the actor's forward disagrees with the one that produced "
                "old_log_prob (rollout/actor mismatch: dtype, kernels, sampling params or stale weights)."
            )
        elif on_policy:
            lines.append(f"On-policy check passed: max |log_prob - old_log_prob| = {_fmt(gap)}.")
    lines.extend(note[0].upper() + note[1:] + "." for note in notes)
    return " ".join(lines)


def counterfactuals(config: LossConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """What-if values for this batch (JSON-safe): pg_loss under every aggregation mode, pg_clipfrac
    under symmetric clip vs Clip-Higher, pg_clipfrac_lower under other dual-clip bounds, kl_loss under
    every estimator, the total loss with and without each regulariser, and ``by_loss_mode``: pg_loss
    (under every aggregation mode) and the clip fractions / ppo_kl under every registered loss mode
    (:func:`.alternatives.loss_mode_counterfactuals`)."""
    batch = _batch(tensors)
    effective = config
    if config.use_kl_loss and batch.tensors.get("ref_log_prob") is None:
        effective = dataclasses.replace(config, use_kl_loss=False)
    return _counterfactuals(batch, effective, loss_modes=True)


def _random_ranges(batch: TokenBatch, config: LossConfig, recomputed: dict[str, float]) -> dict[str, tuple]:
    """``{pg_loss: (lo, hi), policy_loss: (lo, hi)}`` for a loss that draws random numbers; else {}."""
    from ..reference.policy_losses import get_policy_loss

    entry = get_policy_loss(config.loss_mode)
    if not entry.random or entry.bounds is None:
        return {}
    t = batch.tensors
    lo, hi = entry.bounds(
        t["old_log_prob"],
        t["log_prob"],
        t["advantages"],
        batch.mask,
        config.loss_agg_mode,
        config,
        t.get("rollout_is_weights"),
    )
    rest = recomputed["policy_loss"] - recomputed["pg_loss"]  # the entropy and KL terms: deterministic
    return {"pg_loss": (lo, hi), "policy_loss": (lo + rest, hi + rest)}


def _range_verdict(value: float, bounds: tuple[float, float], rtol: float, atol: float) -> dict[str, Any]:
    lo, hi = bounds
    if math.isnan(lo) or math.isnan(hi):
        ok = math.isnan(value)
        err = 0.0 if ok else math.inf
        return {"ok": ok, "abs_err": err, "rel_err": err, "range": [lo, hi]}
    below, above = lo - value, value - hi
    abs_err = max(below, above, 0.0) if not math.isnan(value) else math.inf
    edge = lo if below > 0 else hi
    ok = abs_err <= atol + rtol * abs(edge)
    rel_err = 0.0 if abs_err == 0 else (abs_err / abs(edge) if edge else math.inf)
    return {"ok": ok, "abs_err": abs_err, "rel_err": rel_err, "range": [lo, hi]}


def _with(config: LossConfig, **changes: Any) -> LossConfig:
    """``config`` with ``changes``; where verl would refuse (dp_size > 1 without global counts), the
    micro-batch is normalised locally instead."""
    try:
        return dataclasses.replace(config, **changes)
    except ValueError:
        return dataclasses.replace(
            config, dp_size=1, batch_num_tokens=None, global_batch_size=None, **changes
        )


def _counterfactuals(batch: TokenBatch, config: LossConfig, loss_modes: bool | None = None) -> dict[str, Any]:
    def m(cfg: LossConfig) -> dict[str, float]:
        return batch.metrics(cfg)

    def table(rows: dict[str, Any]) -> dict[str, Any]:  # a loss mode without the metric has no row
        return {k: v for k, v in rows.items() if v is not None}

    base = m(config)
    out: dict[str, Any] = {
        "pg_loss_by_agg_mode": {
            mode.value: m(_with(config, loss_agg_mode=mode))["pg_loss"] for mode in AggMode
        },
    }
    low, high = config.clip_low, config.clip_high
    symmetric = _with(config, clip_ratio_low=None, clip_ratio_high=None)
    clip_higher = _with(config, clip_ratio_low=low, clip_ratio_high=max(high, 0.28))
    if "pg_clipfrac" in base:
        out["pg_clipfrac"] = table(
            {
                "configured": base["pg_clipfrac"],
                f"symmetric ±{config.clip_ratio:g}": m(symmetric).get("pg_clipfrac"),
                f"clip-higher (low {low:g}, high {max(high, 0.28):g})": m(clip_higher).get("pg_clipfrac"),
                "upper side only": m(_with(config, clip_ratio_low=1.0)).get("pg_clipfrac"),
                "lower side only": m(_with(config, clip_ratio_high=NO_DUAL_CLIP)).get("pg_clipfrac"),
            }
        )
    out["pg_loss_by_clip"] = {
        "configured": base["pg_loss"],
        f"symmetric ±{config.clip_ratio:g}": m(symmetric)["pg_loss"],
        f"clip-higher (low {low:g}, high {max(high, 0.28):g})": m(clip_higher)["pg_loss"],
        "no dual clip": m(_with(config, clip_ratio_c=NO_DUAL_CLIP))["pg_loss"],
    }
    if "pg_clipfrac_lower" in base:
        out["pg_clipfrac_lower_by_clip_ratio_c"] = {
            f"{c:g}": m(_with(config, clip_ratio_c=c))["pg_clipfrac_lower"]
            for c in sorted({config.clip_ratio_c, 3.0, 10.0})
        }
    if "ref_log_prob" in batch.tensors:
        out["kl_loss_by_type"] = {
            kind.value: m(_with(config, kl_loss_type=kind))["kl_loss"]
            for kind in (KLType.K1, KLType.ABS, KLType.K2, KLType.LOW_VAR_KL)
        }
    policy = {"configured": base["policy_loss"], "pg_loss only": base["pg_loss"]}
    if "entropy_loss" in base:
        policy["without entropy bonus"] = m(_with(config, entropy_coeff=0.0))["policy_loss"]
    if "kl_loss" in base:
        policy["with kl_loss" if not config.use_kl_loss else "without kl_loss"] = m(
            _with(config, use_kl_loss=not config.use_kl_loss)
        )["policy_loss"]
    out["policy_loss"] = policy
    if loss_modes is None:
        loss_modes = batch.n_tokens <= AUDIT_LOSS_MODE_TOKENS
    if loss_modes:  # two flat tables (mode x metric, mode x agg mode): what the dashboard draws
        by_mode = loss_mode_counterfactuals(batch, config)
        out["by_loss_mode"] = {
            mode: {k: v for k, v in row.items() if k != "pg_loss_by_agg_mode"}
            for mode, row in by_mode.items()
        }
        out["pg_loss_by_loss_mode_and_agg_mode"] = {
            mode: row["pg_loss_by_agg_mode"] for mode, row in by_mode.items() if "pg_loss_by_agg_mode" in row
        }
    out["tokens"] = {"valid": batch.n_tokens, "sequences": batch.n_seqs, "response_len": batch.width}
    return out
