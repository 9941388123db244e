"""The open registries: policy losses, aggregation modes and KL estimators register alike, built-in or
not, and a registered name works everywhere a built-in does (LossConfig, recompute, ppo_loss, audit)."""

from __future__ import annotations

import math

import pytest
import torch
from rlvitals.analyzers import LossConfig, audit, ppo_loss, recompute
from rlvitals.analyzers.reference.losses import (
    AGG_MODES,
    KL_ESTIMATORS,
    agg_loss,
    register_agg_mode,
    register_kl_estimator,
)
from rlvitals.analyzers.reference.policy_losses import (
    POLICY_LOSSES,
    LossMode,
    compute_policy_loss_gpg,
    get_policy_loss,
    register_policy_loss,
)

# every test on the compiled token passes and on the torch ops (conftest.py)
pytestmark = pytest.mark.usefixtures("kernel_path")


def _batch(seed: int = 0, b: int = 4, t: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    lengths = torch.tensor([t, t // 2, 1, t - 3] * (b // 4))
    return {
        "log_prob": log_prob,
        "old_log_prob": log_prob + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3,
        "advantages": torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).contiguous(),
        "response_mask": torch.arange(t)[None, :] < lengths[:, None],
        "ref_log_prob": log_prob + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.1,
        "entropy": torch.rand(b, t, generator=g, dtype=torch.float64),
    }


@pytest.fixture
def scratch_registries():
    """Registrations made by a test are removed afterwards (the registries are process-wide)."""
    before = (dict(POLICY_LOSSES), dict(AGG_MODES), dict(KL_ESTIMATORS))
    yield
    for registry, saved in zip((POLICY_LOSSES, AGG_MODES, KL_ESTIMATORS), before, strict=True):
        registry.clear()
        registry.update(saved)


def test_every_verl_loss_mode_is_registered_as_a_builtin() -> None:
    assert set(POLICY_LOSSES) >= {m.value for m in LossMode}
    assert len(LossMode) == 12


def test_unknown_loss_mode_lists_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"loss_mode must be one of 'vanilla', .*'cispo'.*; got 'ppo2'"):
        LossConfig(loss_mode="ppo2")
    with pytest.raises(ValueError, match="'gspo'"):
        get_policy_loss("ppo2")


def test_duplicate_registrations_raise() -> None:
    with pytest.raises(ValueError, match="policy loss 'gspo' is already registered"):
        register_policy_loss("gspo")(compute_policy_loss_gpg)
    with pytest.raises(ValueError, match="already registered"):
        register_agg_mode("seq-mean-token-mean")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="already registered"):
        register_kl_estimator("k1")(lambda a, b: a)


def test_a_users_loss_registers_and_is_recomputed_like_a_builtin(scratch_registries) -> None:
    @register_policy_loss("half_gpg")
    def half_gpg(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None
    ):
        loss, _ = compute_policy_loss_gpg(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
        )
        return loss / 2, {"ppo_kl": torch.tensor(0.5)}

    t = _batch()
    gpg = recompute(LossConfig(loss_mode="gpg", entropy_coeff=0.01), **t)
    mine = recompute(LossConfig(loss_mode="half_gpg", entropy_coeff=0.01), **t)
    assert set(gpg) == {
        "pg_loss",
        "policy_loss",
        "entropy_loss",
        "kl_loss",
    }  # verl's gpg reports nothing else
    assert mine["pg_loss"] == pytest.approx(gpg["pg_loss"] / 2) and mine["ppo_kl"] == 0.5
    assert mine["policy_loss"] == pytest.approx(mine["pg_loss"] - 0.01 * mine["entropy_loss"])
    _, diff = ppo_loss(LossConfig(loss_mode="half_gpg"), **t)
    assert float(diff["pg_loss"]) == pytest.approx(mine["pg_loss"])
    report = audit(
        LossConfig(loss_mode="half_gpg"), t, {"actor/pg_loss": mine["pg_loss"], "actor/ppo_kl": 0.5}
    )
    assert report.ok, report.explanation


def test_a_registered_agg_mode_and_kl_estimator_take_the_generic_path(scratch_registries) -> None:
    @register_agg_mode("seq-max")
    def seq_max(loss_mat, loss_mask, *, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
        return torch.where(loss_mask, loss_mat, -math.inf).amax(dim=-1).max() * dp_size

    @register_kl_estimator("sq3")
    def sq3(logprob, ref_logprob):
        return (logprob - ref_logprob) ** 3

    t = _batch(1)
    cfg = LossConfig(loss_agg_mode="seq-max", kl_loss_type="sq3", use_kl_loss=True)
    assert cfg.loss_agg_mode == "seq-max" and cfg.to_dict()["kl_loss_type"] == "sq3"
    assert LossConfig(**cfg.to_dict()) == cfg
    got = recompute(cfg, **t)
    mask = t["response_mask"]
    # the fused pass implements only the built-ins: the registered functions must be the ones used
    from rlvitals.analyzers.reference.losses import clipped_token_losses

    mat, _ = clipped_token_losses(
        t["old_log_prob"], t["log_prob"], t["advantages"], mask, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0
    )
    assert got["pg_loss"] == float(agg_loss(mat, mask, "seq-max"))
    assert got["kl_loss"] == float(
        seq_max(
            (t["log_prob"] - t["ref_log_prob"]) ** 3,
            mask,
            dp_size=1,
            batch_num_tokens=None,
            global_batch_size=None,
            loss_scale_factor=None,
        )
    )
    assert recompute(LossConfig(kl_loss_type="sq3+", use_kl_loss=True), **t)["kl_loss"] == pytest.approx(
        float(agg_loss((t["log_prob"] - t["ref_log_prob"]) ** 3, mask, "token-mean"))
    )
    with pytest.raises(
        ValueError, match=r"loss_agg_mode must be one of 'token-mean', .*'seq-max'; got 'nope'"
    ):
        LossConfig(loss_agg_mode="nope")
    with pytest.raises(ValueError, match=r"kl_loss_type must be one of .*'sq3'; got 'k9'"):
        LossConfig(kl_loss_type="k9")


@pytest.mark.parametrize("mode", [m.value for m in LossMode if m is not LossMode.BYPASS_MODE])
def test_rollout_is_weights_multiply_the_token_loss(mode: str) -> None:
    t = _batch(2)
    cfg = LossConfig(loss_mode=mode, dro_beta=0.5, loss_agg_mode="token-sum")
    torch.manual_seed(0)
    plain = recompute(cfg, **t)
    torch.manual_seed(0)
    ones = recompute(cfg, **t, rollout_is_weights=torch.ones_like(t["log_prob"]))
    torch.manual_seed(0)
    doubled = recompute(cfg, **t, rollout_is_weights=torch.full_like(t["log_prob"], 2.0))
    assert ones == pytest.approx(plain)
    assert doubled["pg_loss"] == pytest.approx(
        2 * plain["pg_loss"]
    )  # geo_mean: the geometric mean of 2s is 2
    assert {k: v for k, v in doubled.items() if k not in ("pg_loss", "policy_loss")} == pytest.approx(
        {k: v for k, v in plain.items() if k not in ("pg_loss", "policy_loss")}
    )


def test_masked_positions_do_not_change_any_loss_mode() -> None:
    t = _batch(3)
    dirty = dict(t)
    for name in ("log_prob", "old_log_prob", "advantages"):
        dirty[name] = t[name].masked_fill(~t["response_mask"], -3.25)
    for mode in LossMode:
        if mode in (LossMode.BYPASS_MODE, LossMode.CLIP_COV, LossMode.KL_COV):
            continue  # the covariance modes centre on masked means: garbage shifts nothing only in expectation
        cfg = LossConfig(loss_mode=mode.value, dro_beta=0.5)
        assert recompute(cfg, **dirty) == pytest.approx(recompute(cfg, **t)), mode


def _clip_cov_batch() -> tuple[LossConfig, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    b, t = 6, 40
    log_prob = -torch.rand(b, t, generator=g, dtype=torch.float64) * 6
    tensors = {
        "log_prob": log_prob,
        "old_log_prob": log_prob + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.05,
        "advantages": (torch.randn(b, 1, generator=g, dtype=torch.float64) * 3).expand(b, t).contiguous(),
        "response_mask": torch.rand(b, t, generator=g) < 0.8,
    }
    return LossConfig(loss_mode="clip_cov", clip_cov_ratio=0.2), tensors


def test_clip_cov_audit_checks_pg_loss_as_the_range_of_every_draw() -> None:
    cfg, tensors = _clip_cov_batch()
    draws = []
    for seed in range(20):
        torch.manual_seed(seed)
        draws.append(recompute(cfg, **tensors))
    assert len({d["pg_loss"] for d in draws}) > 1  # the draw matters
    assert len({(d["pg_clipfrac"], d["ppo_kl"]) for d in draws}) == 1  # these do not
    for reported in draws[:5]:
        report = audit(cfg, tensors, {f"actor/{k}": v for k, v in reported.items()})
        assert report.ok, report.explanation
        lo, hi = report.verdicts["pg_loss"]["range"]
        assert lo <= min(d["pg_loss"] for d in draws) and max(d["pg_loss"] for d in draws) <= hi
        assert "checked as the range" in report.explanation and "torch.randperm" in report.explanation
        assert "range" not in report.verdicts["pg_clipfrac"]
    low = audit(cfg, tensors, {"actor/pg_loss": lo - 0.5, "actor/pg_clipfrac": draws[0]["pg_clipfrac"]})
    assert not low.ok and low.mismatched == ["pg_loss"]
    assert "outside [" in low.explanation and "random draw" in low.explanation
    assert low.to_dict()["verdicts"]["pg_loss"]["range"] == [lo, hi]
    bad = audit(cfg, tensors, {"actor/pg_clipfrac": draws[0]["pg_clipfrac"] + 0.05})
    assert not bad.ok and bad.mismatched == ["pg_clipfrac"]


def test_a_number_computed_under_another_loss_mode_is_named() -> None:
    t = _batch(4, b=8, t=32)
    reported = recompute(LossConfig(loss_mode="gspo"), **t)
    report = audit(
        LossConfig(), t, {f"actor/{k}": v for k, v in reported.items() if k != "pg_clipfrac_lower"}
    )
    assert not report.ok
    assert "Reported pg_loss equals loss_mode gspo; config says loss_mode vanilla" in report.explanation
    cispo = recompute(LossConfig(loss_mode="cispo"), **t)
    report = audit(LossConfig(), t, {"actor/pg_loss": cispo["pg_loss"]})
    assert "loss_mode cispo" in report.explanation


def test_metrics_a_loss_mode_does_not_compute_are_noted_not_checked() -> None:
    t = _batch(5)
    report = audit(
        LossConfig(loss_mode="gpg"),
        t,
        {"actor/pg_loss": recompute(LossConfig(loss_mode="gpg"), **t)["pg_loss"], "actor/pg_clipfrac": 0.3},
    )
    assert report.ok and "pg_clipfrac" not in report.verdicts
    assert "pg_clipfrac reported but verl's loss_mode 'gpg' computes none" in report.explanation.lower()


def test_counterfactuals_give_every_loss_mode_under_every_agg_mode() -> None:
    from rlvitals.analyzers import counterfactuals
    from rlvitals.analyzers.contract.config import AggMode

    t = _batch(6)
    cfg = LossConfig(dro_beta=0.5, loss_agg_mode="seq-mean-token-mean")
    cf = counterfactuals(cfg, t)
    by_mode, by_agg = cf["by_loss_mode"], cf["pg_loss_by_loss_mode_and_agg_mode"]
    assert set(by_mode) == {m.value for m in LossMode} == set(by_agg) | {"clip_cov"}
    assert set(by_mode["clip_cov"]) == {"pg_loss_range"}
    for mode in LossMode:
        if mode is LossMode.CLIP_COV:
            continue
        for agg in AggMode:
            want = recompute(LossConfig(loss_mode=mode.value, dro_beta=0.5, loss_agg_mode=agg), **t)
            assert by_agg[mode.value][agg.value] == pytest.approx(want["pg_loss"], rel=1e-12), (mode, agg)
        want = recompute(dataclasses_replace(cfg, loss_mode=mode.value), **t)
        assert by_mode[mode.value] == pytest.approx(
            {k: v for k, v in want.items() if k in ("pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")}
        ), mode


def dataclasses_replace(cfg: LossConfig, **changes) -> LossConfig:
    import dataclasses

    return dataclasses.replace(cfg, **changes)


def test_from_verl_reads_policy_loss_where_verl_keeps_it_and_round_trips() -> None:
    actor = {
        "clip_ratio": 0.2,
        "tau_pos": 1.5,
        "tau_neg": 2.0,
        "policy_loss": {
            "loss_mode": "bypass_mode",
            "clip_cov_ratio": 0.1,
            "dro_beta": None,
            "rollout_correction": {
                "loss_type": "reinforce",
                "rollout_is": "token",
                "rollout_is_threshold": 3.0,
            },
        },
    }
    cfg = LossConfig.from_verl({"actor_rollout_ref": {"actor": actor}})
    assert (cfg.loss_mode, cfg.clip_cov_ratio, cfg.tau_pos, cfg.tau_neg) == ("bypass_mode", 0.1, 1.5, 2.0)
    assert cfg.rollout_correction_settings["loss_type"] == "reinforce"
    assert cfg.rollout_correction_settings["rollout_rs"] is None  # verl's default filled in
    assert LossConfig(**cfg.to_dict()) == cfg and LossConfig.from_verl(cfg.to_dict()) == cfg
    assert hash(cfg) == hash(LossConfig(**cfg.to_dict()))
    with pytest.raises(ValueError, match="dro_beta must be a number > 0 when loss_mode is 'dro'"):
        LossConfig(loss_mode="dro")
    with pytest.raises(ValueError, match="rollout_correction has unknown key"):
        LossConfig(loss_mode="bypass_mode", rollout_correction={"rollout_iss": "token"})
    with pytest.raises(ValueError, match="tau_neg must be a number > 0"):
        LossConfig(tau_neg=0)


def _wide_batch(
    rows: int, width: int, dtype: torch.dtype, *, prefix: bool, strided: bool = False
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rows * width)
    log_prob = -torch.rand(rows, width, generator=g, dtype=dtype) * 3
    if prefix:  # valid prefixes of random length, as a trainer pads
        lengths = torch.randint(0, width + 1, (rows,), generator=g)
        mask = torch.arange(width)[None, :] < lengths[:, None]
    else:
        mask = torch.rand(rows, width, generator=g) < 0.8
    advantages = torch.randn(rows, 1, generator=g, dtype=dtype).expand(rows, width)
    return {
        "log_prob": log_prob,
        "old_log_prob": log_prob + torch.randn(rows, width, generator=g, dtype=dtype) * 0.3,
        # strided: per-row advantages as verl broadcasts them (stride 0) and an int64 0/1 mask
        "advantages": advantages if strided else advantages.contiguous(),
        "response_mask": mask.to(torch.int64) if strided else mask,
        "ref_log_prob": log_prob + torch.randn(rows, width, generator=g, dtype=dtype) * 0.1,
        "entropy": torch.rand(rows, width, generator=g, dtype=dtype) * 2,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("rows", "width", "prefix", "strided"),
    [(30, 500, True, False), (3, 9000, False, False), (21, 700, False, True)],
)
def test_the_fused_passes_agree_with_verls_op_sequence_across_row_blocks(
    rows, width, prefix, strided, dtype, monkeypatch
) -> None:
    # the fused passes walk the batch in blocks of whole rows (workspace.BLOCK_ELEMS tokens); with 4096
    # these shapes give several blocks, a ragged last one, and one row per block (wider than a block);
    # the reference is verl's op sequence (ppo_loss through each loss's registered function)
    from rlvitals.analyzers.fast import workspace

    monkeypatch.setattr(workspace, "BLOCK_ELEMS", 4096)
    tensors = _wide_batch(rows, width, dtype, prefix=prefix, strided=strided)
    tol = {"rel": 1e-5, "abs": 1e-6} if dtype == torch.float32 else {"rel": 1e-7, "abs": 1e-12}
    for i, mode in enumerate(LossMode):
        for agg in (("token-mean", "seq-mean-token-mean")[i % 2], "seq-mean-token-sum-norm"):
            cfg = LossConfig(
                loss_mode=mode.value,
                dro_beta=0.5,
                loss_agg_mode=agg,
                use_kl_loss=True,
                entropy_coeff=0.01,
                clip_cov_ratio=0.01,
                kl_cov_ratio=0.01,
            )
            torch.manual_seed(3)
            fused = recompute(cfg, **tensors)
            torch.manual_seed(3)
            with torch.no_grad():
                _, reference = ppo_loss(cfg, **tensors)
            reference = {k: float(v) for k, v in reference.items()}
            assert set(fused) == set(reference), (mode, agg)
            assert fused == pytest.approx(reference, **tol), (mode, agg)
