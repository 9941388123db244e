"""GRPO advantages (verl's compute_grpo_outcome_advantage) and group diagnostics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from rlvitals.analyzers import GroupDiagnostics, group_diagnostics, grpo_advantages


def _rewards(scores: list[float], width: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Outcome rewards: the score sits on a response's last valid token, as in verl."""
    rewards = torch.zeros(len(scores), width)
    mask = torch.zeros(len(scores), width, dtype=torch.bool)
    for i, s in enumerate(scores):
        length = 1 + i % width
        mask[i, :length] = True
        rewards[i, length - 1] = s
    return rewards, mask


def test_group_normalised_with_unbiased_std_and_broadcast_on_mask() -> None:
    rewards, mask = _rewards([1.0, 0.0, 1.0, 0.0])
    adv, ret = grpo_advantages(rewards, mask, ["p", "p", "p", "p"])
    std = torch.tensor([1.0, 0.0, 1.0, 0.0]).std()  # unbiased: 0.5774
    expected = (torch.tensor([1.0, 0.0, 1.0, 0.0]) - 0.5) / (std + 1e-6)
    assert torch.allclose(adv[mask], expected.repeat_interleave(mask.sum(-1)))
    assert (adv[~mask] == 0).all()
    assert torch.equal(adv, ret)


def test_singleton_group_gets_mean_zero_std_one() -> None:
    rewards, mask = _rewards([0.7, 1.0, 0.0])
    adv, _ = grpo_advantages(rewards, mask, [10, 20, 20])
    assert adv[0, 0].item() == pytest.approx(0.7 / (1 + 1e-6))


def test_identical_rewards_give_zero_advantage() -> None:
    rewards, mask = _rewards([1.0, 1.0, 1.0, 0.0, 1.0])
    adv, _ = grpo_advantages(rewards, mask, ["a", "a", "a", "b", "b"])
    assert (adv[:3] == 0).all()
    assert (adv[3:][mask[3:]] != 0).all()


def test_without_std_normalisation_only_centres() -> None:
    rewards, mask = _rewards([2.0, 0.0, 1.0])
    adv, _ = grpo_advantages(rewards, mask, [1, 1, 1], norm_adv_by_std_in_grpo=False)
    assert [adv[i][mask[i]][0].item() for i in range(3)] == pytest.approx([1.0, -1.0, 0.0])


@pytest.mark.parametrize(
    "index",
    [
        ["x", "y", "x", "y"],
        [3, 4, 3, 4],
        np.array(["x", "y", "x", "y"], dtype=object),
        torch.tensor([3, 4, 3, 4]),
    ],
)
def test_string_int_array_and_tensor_ids_group_the_same(index) -> None:
    rewards, mask = _rewards([1.0, 0.5, 0.0, 0.25])
    adv, _ = grpo_advantages(rewards, mask, index)
    reference, _ = grpo_advantages(rewards, mask, ["x", "y", "x", "y"])
    assert torch.equal(adv, reference)


def test_index_length_must_match_batch() -> None:
    rewards, mask = _rewards([1.0, 0.0])
    with pytest.raises(ValueError, match="index has 3 group ids but the batch has 2"):
        grpo_advantages(rewards, mask, [1, 1, 1])


def test_diagnostics_split_zero_variance_groups_by_cause() -> None:
    # groups: a all solved, b all failed, c mixed, d tied at 0.5, e singleton
    scores = [1, 1, 1, 0, 0, 0, 1, 0, 0.5, 0.5, 1]
    ids = ["a"] * 3 + ["b"] * 3 + ["c"] * 2 + ["d"] * 2 + ["e"]
    rewards, mask = _rewards([float(s) for s in scores])
    diag = group_diagnostics(rewards, mask, ids)
    assert isinstance(diag, GroupDiagnostics)
    assert (diag.num_groups, diag.num_singletons, diag.num_zero_variance) == (5, 1, 3)
    assert (diag.num_all_max, diag.num_all_min, diag.num_other_zero_variance) == (1, 1, 1)
    assert diag.zero_variance_frac == pytest.approx(3 / 5)
    assert diag.all_max_frac == pytest.approx(1 / 5) and diag.all_min_frac == pytest.approx(1 / 5)
    assert diag.zero_advantage_response_frac == pytest.approx(8 / 11)
    d = diag.to_dict()
    assert d["num_singletons"] == 1 and isinstance(d["zero_variance_frac"], float)
    # the groups diagnostics call zero-variance really get zero advantage
    adv, _ = grpo_advantages(rewards, mask, ids)
    assert (adv[:6] == 0).all() and (adv[8:10] == 0).all()


def test_diagnostics_with_explicit_score_range() -> None:
    rewards, mask = _rewards([0.5, 0.5, 0.5, 0.5])
    diag = group_diagnostics(rewards, mask, [1, 1, 2, 2], score_range=(0.0, 1.0))
    assert diag.num_zero_variance == 2 and diag.num_other_zero_variance == 2 and diag.num_all_max == 0


def test_diagnostics_on_a_degenerate_batch_use_the_pass_fail_convention() -> None:
    solved, mask = _rewards([1.0] * 4)
    assert group_diagnostics(solved, mask, [1, 1, 2, 2]).all_max_frac == 1.0
    failed, mask = _rewards([0.0] * 4)
    assert group_diagnostics(failed, mask, [1, 1, 2, 2]).all_min_frac == 1.0


def test_diagnostics_of_an_empty_batch_are_nan_not_a_crash() -> None:
    diag = group_diagnostics(torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool), [])
    assert diag.num_groups == 0 and math.isnan(diag.zero_variance_frac)
