"""GRPO outcome advantages (verl's ``compute_grpo_outcome_advantage``) and group diagnostics.

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

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

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
