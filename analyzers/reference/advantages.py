"""verl 0.9.1's outcome advantage estimators (``compute_advantages``, an open registry) and GRPO group
diagnostics.

GRPO (Shao et al. 2024, arXiv:2402.03300) scores each response by its summed token rewards and
normalises within the group of responses to the same prompt: ``A_i = (s_i - mean_g) / (std_g + eps)``
(unbiased std; Dr. GRPO, arXiv:2503.20783, drops the division). Two silent traps that verl does not
report and :func:`group_diagnostics` does:

- a group whose rewards are all equal gets advantage 0 for every response: no gradient at all. When
  every response solved the prompt (all-max) the prompt is too easy; when all failed (all-min) it is
  too hard. DAPO's dynamic sampling (arXiv:2503.14476) filters exactly these groups.
- a singleton group gets mean 0 and std 1, i.e. its raw score as the advantage: a different scale from
  every other response.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..contract.registries import (  # noqa: F401  (re-exported: the registry lives in the contract layer)
    ADV_ESTIMATORS,
    AdvantageFn,
    AdvEstimator,
    get_adv_estimator,
    register_adv_estimator,
)

Tensor = torch.Tensor


def _group_ids(index: Sequence[Any] | Tensor, batch: int) -> list[Any]:
    ids = index.tolist() if hasattr(index, "tolist") else list(index)
    if len(ids) != batch:
        raise ValueError(f"index has {len(ids)} group ids but the batch has {batch} responses")
    return ids


def _check(token_level_rewards: Tensor, response_mask: Tensor) -> None:
    if token_level_rewards.dim() != 2 or not token_level_rewards.is_floating_point():
        raise ValueError(
            f"token_level_rewards must be a 2-D float tensor (batch, response_len); got shape "
            f"{tuple(token_level_rewards.shape)} {str(token_level_rewards.dtype).replace('torch.', '')}"
        )
    if response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"response_mask has shape {tuple(response_mask.shape)} but token_level_rewards has "
            f"{tuple(token_level_rewards.shape)}"
        )


def _groups(ids: list[Any]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    for row, gid in enumerate(ids):
        groups.setdefault(gid, []).append(row)
    return groups


def grpo_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Any] | Tensor,
    *,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[Tensor, Tensor]:
    """GRPO advantages, identical to verl 0.9.1's ``compute_grpo_outcome_advantage``.

    Args:
        token_level_rewards: ``(batch, response_len)`` float; a response's score is its row sum.
        response_mask: ``(batch, response_len)`` bool or 0/1; the advantage is broadcast onto it.
        index: ``batch`` group ids (strings or ints, a list, numpy array or int64 tensor).

    Returns ``(advantages, returns)``, both ``(batch, response_len)`` and equal, as in verl. Groups of
    one get mean 0 / std 1; groups with identical scores get 0 (std 0, divided by ``std + epsilon``).
    """
    _check(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        ids = _group_ids(index, scores.shape[0])
        out = scores.clone()
        for rows in _groups(ids).values():
            at = torch.tensor(rows, dtype=torch.long)
            group = scores[at]
            if len(rows) == 1:
                # verl: mean = torch.tensor(0.0), std = torch.tensor(1.0); its 0-dim float32 arithmetic
                # promotes half-precision scores to float32 before the result is stored back
                mean = torch.tensor(0.0)
                std = torch.tensor(1.0)
                group = group.to(torch.promote_types(group.dtype, torch.float32))
            else:
                mean = torch.mean(group)
                std = torch.std(group)  # unbiased
            value = group - mean
            if norm_adv_by_std_in_grpo:
                value = value / (std + epsilon)
            out[at] = value.to(out.dtype)
        advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages


@dataclass(frozen=True)
class GroupDiagnostics:
    """How many GRPO groups carry no learning signal, and why.

    ``zero_variance_frac`` is the share of groups (of two or more responses) whose scores are all
    equal; it splits into ``all_max_frac`` (every response got the top score: solved) and
    ``all_min_frac`` (every response got the bottom score: failed); the rest (``other``) tie at a
    middle value. Fractions are of ``num_groups`` (singletons included, as TRL's
    ``frac_reward_zero_std`` counts prompts); singletons are counted separately and never as
    zero-variance (verl gives them their raw score as advantage).
    """

    num_responses: int
    num_groups: int
    num_singletons: int
    num_zero_variance: int
    num_all_max: int
    num_all_min: int
    num_other_zero_variance: int
    zero_variance_frac: float
    all_max_frac: float
    all_min_frac: float
    zero_advantage_response_frac: float
    score_min: float
    score_max: float
    score_mean: float

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)


def group_diagnostics(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Any] | Tensor,
    *,
    score_range: tuple[float, float] | None = None,
) -> GroupDiagnostics:
    """Zero-variance and singleton statistics of a GRPO batch (see :class:`GroupDiagnostics`).

    ``score_range = (min, max)`` names the bottom and top achievable scores (e.g. ``(0, 1)`` for a
    pass/fail reward). By default the batch's observed extremes are used; if every response in the
    batch has the same score the observed range is degenerate, and a tied group counts as all-max
    when its score is > 0 and all-min otherwise (the pass/fail convention).
    """
    _check(token_level_rewards, response_mask)
    scores = token_level_rewards.detach().sum(dim=-1).to(torch.float64)
    ids = _group_ids(index, scores.shape[0])
    n = scores.shape[0]
    if n == 0:
        nan = float("nan")
        return GroupDiagnostics(0, 0, 0, 0, 0, 0, 0, nan, nan, nan, nan, nan, nan, nan)
    lo, hi = (float(scores.min()), float(scores.max())) if score_range is None else map(float, score_range)
    groups = _groups(ids)
    singletons = zero = top = bottom = zero_rows = 0
    for rows in groups.values():
        if len(rows) == 1:
            singletons += 1
            continue
        group = scores[rows]
        first = float(group[0])
        if bool((group == first).all()):
            zero += 1
            zero_rows += len(rows)
            if lo == hi:
                top, bottom = (top + 1, bottom) if first > 0 else (top, bottom + 1)
            elif first >= hi:
                top += 1
            elif first <= lo:
                bottom += 1
    count = len(groups)
    return GroupDiagnostics(
        num_responses=n,
        num_groups=count,
        num_singletons=singletons,
        num_zero_variance=zero,
        num_all_max=top,
        num_all_min=bottom,
        num_other_zero_variance=zero - top - bottom,
        zero_variance_frac=zero / count,
        all_max_frac=top / count,
        all_min_frac=bottom / count,
        zero_advantage_response_frac=zero_rows / n,
        score_min=float(scores.min()),
        score_max=float(scores.max()),
        score_mean=float(scores.mean()),
    )


# -- every outcome estimator verl 0.9.1 registers, on one open registry ------------------------------------
@dataclass(frozen=True)
class BatchNormalisation:
    """How an estimator's advantages depend on the whole batch verl computed them on (the driver's full
    training batch), beyond the rows one upload holds: on valid tokens ``advantages = scale * raw +
    shift``, ``scale > 0`` and ``shift`` one number each for the whole batch (``shift=False``: 0).

    ``raw(token_level_rewards, response_mask, index, *, gamma, epsilon, norm_adv_by_std_in_grpo)`` is
    the per-row part, computable from any subset of whole groups; ``statistic`` names the batch
    statistic in the audit's words. A part of the batch then has the estimator's advantages exactly when
    they are such an affine map of ``raw`` (the whole batch's statistics are not in the upload)."""

    raw: Callable[..., Tensor]
    shift: bool
    statistic: str


BATCH_NORMALISED: dict[str, BatchNormalisation] = {}


def register_batch_normalisation(
    name: str | AdvEstimator, *, shift: bool, statistic: str
) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    """Declare that estimator ``name`` normalises over the whole batch: the decorated function is its
    ``raw`` part (see :class:`BatchNormalisation`). A duplicate name raises."""
    key = str(name)

    def decorator(raw: Callable[..., Tensor]) -> Callable[..., Tensor]:
        if key in BATCH_NORMALISED:
            raise ValueError(f"a batch normalisation for {key!r} is already registered")
        BATCH_NORMALISED[key] = BatchNormalisation(raw, shift, statistic)
        return raw

    return decorator


def compute_advantages(
    estimator: str | AdvEstimator,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Any] | Tensor | None = None,
    *,
    gamma: float = 1.0,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[Tensor, Tensor]:
    """``(advantages, returns)``, both ``(batch, response_len)``, as verl 0.9.1's registered estimator
    ``estimator`` computes them (``algorithm.adv_estimator``; ``gamma`` and ``norm_adv_by_std_in_grpo``
    are ``algorithm.*`` too). ``index`` (one group id per response, verl's ``uid``) is required by every
    group estimator; ``reinforce_plus_plus`` ignores it. An unknown name lists the valid ones.
    """
    fn = get_adv_estimator(estimator)
    _check(token_level_rewards, response_mask)
    return fn(
        token_level_rewards,
        response_mask,
        index,
        gamma=gamma,
        epsilon=epsilon,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )


def _need_index(name: str, index: Any, batch: int) -> dict[Any, list[int]]:
    if index is None:
        raise ValueError(f"adv_estimator {name!r} needs index (one group id per response)")
    return _groups(_group_ids(index, batch))


def _masked_whiten(values: Tensor, mask: Tensor) -> Tensor:
    """verl's ``masked_whiten``: ``(x - mean) / sqrt(var + 1e-8)`` with the unbiased masked variance."""

    def mean(x: Tensor) -> Tensor:
        return (torch.where(mask.bool(), x, 0.0) * mask).sum() / (mask.sum() + 1e-8)

    mu = mean(values)
    var = mean((values - mu) ** 2)
    count = mask.sum()
    if count == 0:
        raise ValueError("masked_whiten needs at least one valid token")
    if count == 1:
        raise ValueError(
            "masked_whiten needs at least two valid tokens (the unbiased variance divides by n-1)"
        )
    var = var * (count / (count - 1))
    return (values - mu) * torch.rsqrt(var + 1e-8)


@register_adv_estimator(AdvEstimator.GRPO)
def _grpo(rewards, mask, index, *, gamma, epsilon, norm_adv_by_std_in_grpo):
    """GRPO (arXiv:2402.03300): ``(s_i - mean_g) / (std_g + eps)``; Dr. GRPO (arXiv:2503.20783) when
    ``norm_adv_by_std_in_grpo`` is False: ``s_i - mean_g``."""
    if index is None:
        raise ValueError("adv_estimator 'grpo' needs index (one group id per response)")
    return grpo_advantages(
        rewards, mask, index, epsilon=epsilon, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo
    )


@register_adv_estimator(AdvEstimator.RLOO)
def _rloo(rewards, mask, index, *, gamma, epsilon, norm_adv_by_std_in_grpo):
    """RLOO (arXiv:2402.14740): ``s_i * n/(n-1) - mean_g * n/(n-1)`` = s_i minus the mean of the others;
    a singleton keeps its raw score."""
    with torch.no_grad():
        scores = rewards.sum(dim=-1)
        out = scores.clone()
        for rows in _need_index("rloo", index, scores.shape[0]).values():
            n = len(rows)
            if n > 1:
                at = torch.tensor(rows, dtype=torch.long)
                group = scores[at]
                mean = torch.mean(group)
                out[at] = group * n / (n - 1) - mean * n / (n - 1)
        adv = out.unsqueeze(-1) * mask
    return adv, adv


@register_adv_estimator(AdvEstimator.OPO)
def _opo(rewards, mask, index, *, gamma, epsilon, norm_adv_by_std_in_grpo):
    """OPO (arXiv:2505.23585): ``s_i - sum_g(len_j * s_j) / sum_g(len_j)`` (length-weighted baseline)."""
    with torch.no_grad():
        lengths = mask.sum(dim=-1)
        scores = rewards.sum(dim=-1)
        out = scores.clone()
        for rows in _need_index("opo", index, scores.shape[0]).values():
            at = torch.tensor(rows, dtype=torch.long)
            if len(rows) == 1:
                out[at] = (scores[at] - torch.tensor(0.0)).to(out.dtype)
            else:
                baseline = (lengths[at] * scores[at]).sum() / lengths[at].sum()
                out[at] = (scores[at] - baseline).to(out.dtype)
        adv = out.unsqueeze(-1) * mask
    return adv, adv


def _group_centred(name: str, scores: Tensor, index: Any) -> Tensor:
    """``s_i - mean_g`` per response (``(batch,)``); a singleton keeps its score (verl's mean 0)."""
    out = scores.clone()
    for rows in _need_index(name, index, scores.shape[0]).values():
        at = torch.tensor(rows, dtype=torch.long)
        mean = torch.tensor(0.0) if len(rows) == 1 else torch.mean(scores[at])
        out[at] = (scores[at] - mean).to(out.dtype)
    return out


@register_adv_estimator(AdvEstimator.GPG)
def _gpg(rewards, mask, index, *, gamma, epsilon, norm_adv_by_std_in_grpo):
    """GPG (arXiv:2504.02546): ``alpha * (s_i - mean_g)``, ``alpha = batch / max(#non-zero scores, 1)``
    counted over the whole batch."""
    with torch.no_grad():
        scores = rewards.sum(dim=-1)
        alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
        out = (alpha * _group_centred("gpg", scores, index) / 1.0).to(scores.dtype)  # verl's f_norm = 1.0
        adv = out.unsqueeze(-1) * mask
    return adv, adv


@register_batch_normalisation(
    AdvEstimator.GPG, shift=False, statistic="alpha = batch size / non-zero scores, counted over the batch"
)
def _gpg_raw(rewards, mask, index, **_):
    with torch.no_grad():
        return _group_centred("gpg", rewards.sum(dim=-1), index).unsqueeze(-1) * mask


@register_adv_estimator(AdvEstimator.GRPO_PASSK)
def _grpo_passk(rewards, mask, index, *, gamma, epsilon, norm_adv_by_std_in_grpo):
    """Pass@k (arXiv:2503.19595): only each group's best response gets ``r_max - r_2nd`` (divided by
    ``std_g + eps`` when normalising); groups of one raise, as in verl."""
    with torch.no_grad():
        scores = rewards.sum(dim=-1)
        out = torch.zeros_like(scores)
        for gid, rows in _need_index("grpo_passk", index, scores.shape[0]).items():
            if len(rows) < 2:
                raise ValueError(f"grpo_passk needs at least 2 responses per group; group {gid!r} has 1")
            group = scores[torch.tensor(rows, dtype=torch.long)]
            top, top_at = torch.topk(group, 2)
            value = top[0] - top[1]
            if norm_adv_by_std_in_grpo:
                value = value / (torch.std(group) + epsilon)
            out[rows[int(top_at[0])]] = value
        adv = out.unsqueeze(-1) * mask
    return adv, adv


WHITENING = "masked_whiten (mean and unbiased std over the valid tokens of the batch)"


@register_batch_normalisation(AdvEstimator.REINFORCE_PLUS_PLUS_BASELINE, shift=True, statistic=WHITENING)
def _reinforce_pp_baseline_raw(rewards, mask, index, **_):
    """``s_i - mean_g`` tiled over the response, masked: what verl whitens."""
    with torch.no_grad():
        out = _group_centred("reinforce_plus_plus_baseline", rewards.sum(dim=-1), index)
        return out.unsqueeze(-1).tile([1, rewards.shape[-1]]) * mask


@register_adv_estimator(AdvEstimator.REINFORCE_PLUS_PLUS_BASELINE)
def _reinforce_pp_baseline(rewards, mask, index, *, gamma, epsilon, norm_adv_by_std_in_grpo):
    """REINFORCE++-baseline (arXiv:2501.03262): ``s_i - mean_g`` on every token, whitened over the
    batch's valid tokens."""
    with torch.no_grad():
        adv = _masked_whiten(_reinforce_pp_baseline_raw(rewards, mask, index), mask) * mask
    return adv, adv


@register_batch_normalisation(AdvEstimator.REINFORCE_PLUS_PLUS, shift=True, statistic=WHITENING)
def _reinforce_pp_returns(rewards, mask, index, *, gamma, **_):
    """The discounted return-to-go on valid tokens (0 elsewhere): what verl whitens."""
    if mask.dtype == torch.bool:  # verl computes ``1 - mask``, which a bool tensor refuses
        mask = mask.to(rewards.dtype)
    with torch.no_grad():
        returns = torch.zeros_like(rewards)
        running: Tensor | int = 0
        for t in reversed(range(rewards.shape[1])):
            step = rewards[:, t] + gamma * running
            returns[:, t] = step * mask[:, t]
            running = step * mask[:, t] + running * (1 - mask[:, t])
    return returns


@register_adv_estimator(AdvEstimator.REINFORCE_PLUS_PLUS)
def _reinforce_pp(rewards, mask, index, *, gamma, epsilon, norm_adv_by_std_in_grpo):
    """REINFORCE++ (arXiv:2501.03262): discounted return-to-go ``G_t = r_t + gamma * G_{t+1}`` over
    valid tokens (masked positions carry G through unchanged), whitened over the batch."""
    returns = _reinforce_pp_returns(rewards, mask, index, gamma=gamma)
    if mask.dtype == torch.bool:
        mask = mask.to(rewards.dtype)
    with torch.no_grad():
        adv = _masked_whiten(returns, mask) * mask
    return adv, returns
