"""verl loss semantics: the reference article's worked examples, invariances, properties, gradients.

Parity with the real verl 0.9.1 lives in test_analyzers_parity.py (golden fixture); here the fast
``recompute`` is also checked against the op-for-op reference path on random batches.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rlvitals.analyzers import (
    LossConfig,
    agg_loss,
    compute_policy_loss_vanilla,
    kl_penalty,
    ppo_loss,
    recompute,
)
from rlvitals.analyzers.contract.config import AggMode, KLType
from rlvitals.analyzers.fast.token_batch import TokenBatch

# every test on the compiled token passes and on the torch ops (conftest.py)
pytestmark = pytest.mark.usefixtures("kernel_path")

MODES = [m.value for m in AggMode]
KL_TYPES = [k.value for k in KLType]


def _two_responses() -> tuple[torch.Tensor, torch.Tensor]:
    """The article's batch: response A has 8 tokens of loss 1, response B 2 tokens of loss 5."""
    loss = torch.zeros(2, 8)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    loss[0, :] = 1.0
    mask[0, :] = True
    loss[1, :2] = 5.0
    mask[1, :2] = True
    return loss, mask


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 1.8),
        ("token-sum", 18.0),
        ("seq-mean-token-sum", 9.0),
        ("seq-mean-token-sum-norm", 1.125),  # 9.0 / loss_scale_factor, which defaults to response_len 8
        ("seq-mean-token-mean", 3.0),
    ],
)
def test_article_worked_example_for_each_agg_mode(mode: str, expected: float) -> None:
    loss, mask = _two_responses()
    assert agg_loss(loss, mask, mode).item() == pytest.approx(expected, rel=1e-6)
    # the same numbers through recompute: ratio 1 and A = -loss make every token's loss equal to -A
    zeros = torch.zeros(2, 8)
    out = recompute(
        LossConfig(loss_agg_mode=mode),
        log_prob=zeros,
        old_log_prob=zeros,
        advantages=-loss,
        response_mask=mask,
    )
    assert out["pg_loss"] == pytest.approx(expected, rel=1e-6)
    assert out["pg_clipfrac"] == 0.0
    assert out["ppo_kl"] == 0.0


def test_seq_mean_token_sum_norm_uses_explicit_factor() -> None:
    loss, mask = _two_responses()
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=4).item() == pytest.approx(2.25)


def test_dual_clip_caps_negative_advantage_loss_at_c() -> None:
    # A = -2, ratio 5, c = 3: standard clip keeps max(10, 2.4) = 10, dual clip caps it at 6
    log_prob = torch.tensor([[math.log(5.0)]])
    zeros = torch.zeros(1, 1)
    adv = torch.tensor([[-2.0]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    cfg = LossConfig(clip_ratio_c=3.0)
    pg_loss, metrics = compute_policy_loss_vanilla(zeros, log_prob, adv, mask, cfg)
    assert pg_loss.item() == pytest.approx(6.0)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1.0)
    assert metrics["pg_clipfrac"].item() == 0.0
    out = recompute(cfg, log_prob=log_prob, old_log_prob=zeros, advantages=adv, response_mask=mask)
    assert out["pg_loss"] == pytest.approx(6.0)
    assert out["pg_clipfrac_lower"] == pytest.approx(1.0)
    assert out["pg_clipfrac"] == 0.0


@pytest.mark.parametrize("adv", [0.5, 1.0, 2.0])
def test_positive_advantage_ratio_above_band_is_clipped_to_minus_1_2_a(adv: float) -> None:
    log_prob = torch.tensor([[math.log(1.5)]])
    zeros = torch.zeros(1, 1)
    mask = torch.ones(1, 1, dtype=torch.bool)
    out = recompute(
        LossConfig(),
        log_prob=log_prob,
        old_log_prob=zeros,
        advantages=torch.tensor([[adv]]),
        response_mask=mask,
    )
    assert out["pg_loss"] == pytest.approx(-1.2 * adv, rel=1e-6)
    assert out["pg_clipfrac"] == pytest.approx(1.0)
    # a negative advantage at the same ratio is not clipped: the penalty keeps its full -1.5 A
    out = recompute(
        LossConfig(),
        log_prob=log_prob,
        old_log_prob=zeros,
        advantages=torch.tensor([[-adv]]),
        response_mask=mask,
    )
    assert out["pg_loss"] == pytest.approx(1.5 * adv, rel=1e-6)
    assert out["pg_clipfrac"] == 0.0


def _batch(
    seed: int, b: int = 6, t: int = 33, dtype=torch.float32, spread: float = 0.4
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return {
        "log_prob": log_prob.to(dtype),
        "old_log_prob": (log_prob + torch.randn(b, t, generator=g, dtype=torch.float64) * spread).to(dtype),
        "advantages": torch.randn(b, t, generator=g, dtype=torch.float64).to(dtype),
        "response_mask": mask,
        "ref_log_prob": (log_prob + torch.randn(b, t, generator=g, dtype=torch.float64) * spread).to(dtype),
        "entropy": torch.rand(b, t, generator=g, dtype=torch.float64).to(dtype) * 2,
    }


def _reference(cfg: LossConfig, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    with torch.no_grad():
        _, metrics = ppo_loss(cfg, **tensors)
    return {k: float(v) for k, v in metrics.items()}


def _assert_close(a: dict[str, float], b: dict[str, float], rel: float, abs_: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if math.isnan(b[key]):
            assert math.isnan(a[key]), key
        else:
            assert a[key] == pytest.approx(b[key], rel=rel, abs=abs_), key


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fast_recompute_matches_reference_ops(mode: str, kl_type: str, dtype: torch.dtype) -> None:
    tensors = _batch(hash((mode, kl_type)) % 1000, dtype=dtype, spread=1.5)
    cfg = LossConfig(
        loss_agg_mode=mode,
        kl_loss_type=kl_type,
        use_kl_loss=True,
        entropy_coeff=0.01,
        clip_ratio_high=0.28,
        clip_ratio_c=2.5,
    )
    fast = recompute(cfg, **tensors)
    assert TokenBatch(**tensors).fast
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    _assert_close(fast, _reference(cfg, tensors), tol, tol)
    assert fast["pg_clipfrac"] > 0 and fast["pg_clipfrac_lower"] > 0  # both clip kinds exercised


@pytest.mark.parametrize("mode", MODES)
def test_global_batch_info_scales_like_verl(mode: str) -> None:
    tensors = _batch(7)
    cfg = LossConfig(
        loss_agg_mode=mode, dp_size=4, batch_num_tokens=500, global_batch_size=24, loss_scale_factor=64
    )
    _assert_close(recompute(cfg, **tensors), _reference(cfg, tensors), 1e-5, 1e-7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_its_own_dtype_like_verl(dtype: torch.dtype) -> None:
    tensors = _batch(3, dtype=dtype)
    cfg = LossConfig(use_kl_loss=True)
    out = recompute(cfg, **tensors)
    assert out == _reference(cfg, tensors)
    # and it stays close to the float64 answer
    exact = recompute(cfg, **{k: v.double() if v.is_floating_point() else v for k, v in tensors.items()})
    assert out["pg_loss"] == pytest.approx(exact["pg_loss"], rel=0.05, abs=0.01)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("garbage", [1e6, -3e4, 12345.0])
def test_masked_positions_do_not_change_any_metric(mode: str, garbage: float) -> None:
    tensors = _batch(11)
    cfg = LossConfig(loss_agg_mode=mode, use_kl_loss=True, entropy_coeff=0.01)
    clean = recompute(cfg, **tensors)
    dirty = dict(tensors)
    outside = ~tensors["response_mask"]
    for name in ("log_prob", "old_log_prob", "advantages", "ref_log_prob", "entropy"):
        dirty[name] = tensors[name].masked_fill(outside, garbage)
    assert recompute(cfg, **dirty) == pytest.approx(clean, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum"])
@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf])
def test_non_finite_garbage_under_the_mask_is_dropped_by_masked_sum(mode: str, garbage: float) -> None:
    tensors = _batch(12)
    cfg = LossConfig(loss_agg_mode=mode, use_kl_loss=True, entropy_coeff=0.01)
    clean = recompute(cfg, **tensors)
    dirty = {
        k: (v.masked_fill(~tensors["response_mask"], garbage) if v.is_floating_point() else v)
        for k, v in tensors.items()
    }
    assert recompute(cfg, **dirty) == pytest.approx(clean, rel=1e-5, abs=1e-7)


def test_seq_modes_propagate_nan_under_the_mask_as_verl_does() -> None:
    # verl's seq-* modes sum loss_mat * loss_mask without masked_sum's guard: NaN * 0 stays NaN
    tensors = _batch(13)
    tensors["advantages"] = tensors["advantages"].masked_fill(~tensors["response_mask"], math.nan)
    out = recompute(LossConfig(loss_agg_mode="seq-mean-token-mean"), **tensors)
    assert math.isnan(out["pg_loss"])
    assert math.isfinite(out["ppo_kl"]) and math.isfinite(out["pg_clipfrac"])


def test_nan_on_a_valid_token_reaches_the_metrics() -> None:
    tensors = _batch(14)
    tensors["log_prob"][0, 0] = math.nan
    out = recompute(LossConfig(), **tensors)
    assert math.isnan(out["pg_loss"]) and math.isnan(out["ppo_kl"])


@pytest.mark.parametrize("mode", MODES)
def test_fully_masked_batch_does_not_crash_and_matches_verl_nan(mode: str) -> None:
    tensors = _batch(15)
    tensors["response_mask"] = torch.zeros_like(tensors["response_mask"])
    cfg = LossConfig(loss_agg_mode=mode, use_kl_loss=True)
    out = recompute(cfg, **tensors)
    _assert_close(out, _reference(cfg, tensors), 0, 0)
    assert out["ppo_kl"] == 0.0 and out["pg_clipfrac"] == 0.0 and out["pg_clipfrac_lower"] == 0.0
    if mode == "token-sum":
        assert out["pg_loss"] == 0.0
    else:
        assert math.isnan(out["pg_loss"]) and math.isnan(out["kl_loss"]) and math.isnan(out["policy_loss"])


def test_int_mask_equals_bool_mask() -> None:
    tensors = _batch(16)
    as_int = dict(tensors, response_mask=tensors["response_mask"].to(torch.int64))
    cfg = LossConfig(loss_agg_mode="seq-mean-token-mean")
    assert recompute(cfg, **as_int) == recompute(cfg, **tensors)


def test_token_mean_with_global_token_count_adds_up_over_micro_batches() -> None:
    tensors = _batch(17, b=12, t=40)
    total_tokens = int(tensors["response_mask"].sum())
    whole = recompute(LossConfig(), **tensors)
    cfg = LossConfig(batch_num_tokens=total_tokens)
    parts = [recompute(cfg, **{k: v[i : i + 4] for k, v in tensors.items()}) for i in range(0, 12, 4)]
    assert sum(p["pg_loss"] for p in parts) == pytest.approx(whole["pg_loss"], rel=1e-5)
    # the same with the differentiable reference
    pieces = [
        agg_loss(
            tensors["entropy"][i : i + 4],
            tensors["response_mask"][i : i + 4],
            "token-mean",
            batch_num_tokens=total_tokens,
        )
        for i in range(0, 12, 4)
    ]
    assert float(sum(pieces)) == pytest.approx(
        float(agg_loss(tensors["entropy"], tensors["response_mask"], "token-mean")), rel=1e-5
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-60, 60, allow_nan=False), min_size=1, max_size=40),
    st.lists(st.floats(-60, 60, allow_nan=False), min_size=1, max_size=40),
)
def test_k3_is_never_negative(a: list[float], b: list[float]) -> None:
    # exactly: e^d - d - 1 >= 0. In floating point the cancellation near d = 0 can leave a few ulps
    # of 1 below zero (d = 1e-8 gives -1.1e-16 in float64), never more.
    n = min(len(a), len(b))
    logp = torch.tensor([a[:n]], dtype=torch.float64)
    ref = torch.tensor([b[:n]], dtype=torch.float64)
    for kind in ("k3", "low_var_kl", "k3+"):
        assert bool((kl_penalty(logp, ref, kind) >= -4 * torch.finfo(torch.float64).eps).all())
    assert bool((kl_penalty(logp.float(), ref.float(), "k3") >= -4 * torch.finfo(torch.float32).eps).all())
    assert bool((kl_penalty(logp, ref, "k3") <= 10).all())  # and the upper clamp holds


@pytest.mark.parametrize("kind", ["kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"])
def test_straight_through_estimators_have_forward_value_of_base_and_gradient_of_k2(kind: str) -> None:
    g = torch.Generator().manual_seed(5)
    ref = torch.randn(3, 9, generator=g, dtype=torch.float64)
    start = ref + torch.randn(3, 9, generator=g, dtype=torch.float64)
    logp = start.clone().requires_grad_(True)
    value = kl_penalty(logp, ref, kind)
    base = kind.rstrip("+")
    assert torch.allclose(value.detach(), kl_penalty(start, ref, base), rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(value.sum(), logp)
    k2 = start.clone().requires_grad_(True)
    (grad_k2,) = torch.autograd.grad(kl_penalty(k2, ref, "k2").sum(), k2)
    assert torch.allclose(grad, grad_k2, rtol=0, atol=1e-12)
    assert torch.allclose(grad, start - ref)
    if base in ("k3", "low_var_kl", "kl", "k1"):  # the plain estimator's gradient is different
        plain = start.clone().requires_grad_(True)
        (grad_plain,) = torch.autograd.grad(kl_penalty(plain, ref, base).sum(), plain)
        assert not torch.allclose(grad_plain, grad_k2)


def test_ppo_loss_is_differentiable_and_combines_terms() -> None:
    tensors = _batch(18)
    logp = tensors["log_prob"].clone().requires_grad_(True)
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
    loss, metrics = ppo_loss(cfg, **dict(tensors, log_prob=logp))
    loss.backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    expected = metrics["pg_loss"] - 0.01 * metrics["entropy_loss"] + 0.1 * metrics["kl_loss"]
    assert float(loss.detach()) == pytest.approx(float(expected))
    assert set(metrics) == {
        "pg_loss",
        "pg_clipfrac",
        "ppo_kl",
        "pg_clipfrac_lower",
        "entropy_loss",
        "kl_loss",
        "policy_loss",
    }


def test_kl_loss_is_reported_but_not_added_without_use_kl_loss() -> None:
    tensors = _batch(19)
    out = recompute(LossConfig(use_kl_loss=False), **tensors)
    assert out["kl_loss"] > 0
    assert out["policy_loss"] == pytest.approx(out["pg_loss"])


def test_recompute_keys_follow_the_inputs() -> None:
    tensors = _batch(20)
    core = {k: tensors[k] for k in ("log_prob", "old_log_prob", "advantages", "response_mask")}
    assert set(recompute(LossConfig(), **core)) == {
        "pg_loss",
        "pg_clipfrac",
        "ppo_kl",
        "pg_clipfrac_lower",
        "policy_loss",
    }
    with pytest.raises(ValueError, match="ref_log_prob is required"):
        recompute(LossConfig(use_kl_loss=True), **core)


def test_ppo_kl_is_masked_mean_of_old_minus_new_and_clamped() -> None:
    old = torch.tensor([[0.0, 0.0, 0.0]])
    new = torch.tensor([[-0.5, -100.0, 7.0]])
    mask = torch.tensor([[True, True, False]])
    out = recompute(
        LossConfig(), log_prob=new, old_log_prob=old, advantages=torch.ones(1, 3), response_mask=mask
    )
    assert out["ppo_kl"] == pytest.approx((0.5 + 20.0) / 2)  # -100 is clamped to -20


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"loss_agg_mode": "mean"}, "loss_agg_mode must be one of 'token-mean'"),
        ({"kl_loss_type": "full"}, "kl_loss_type must be one of 'kl', 'k1'"),
        ({"clip_ratio_c": 1.0}, "clip_ratio_c must be a number > 1"),
        ({"clip_ratio": -0.1}, "clip_ratio must be a number in"),
        ({"clip_ratio_low": 1.5}, "clip_ratio_low must be None or a number in"),
        ({"dp_size": 0}, "dp_size must be an integer >= 1"),
        ({"batch_num_tokens": -1}, "batch_num_tokens must be an integer >= 0 or None"),
        ({"loss_scale_factor": 0}, "loss_scale_factor must be None or a number > 0"),
        ({"use_kl_loss": "yes"}, "use_kl_loss must be one of True, False"),
        ({"kl_loss_coef": math.nan}, "kl_loss_coef must be a finite number"),
        ({"dp_size": 2}, "batch_num_tokens must be the global token count"),
        (
            {"dp_size": 2, "loss_agg_mode": "seq-mean-token-mean"},
            "global_batch_size must be the global sequence count",
        ),
    ],
)
def test_invalid_config_names_field_and_allowed_values(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LossConfig(**bad)


def test_config_defaults_and_round_trip() -> None:
    cfg = LossConfig()
    assert (cfg.clip_ratio, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c) == (
        0.2,
        None,
        None,
        3.0,
    )
    assert cfg.loss_agg_mode == "token-mean" and cfg.kl_loss_type == "low_var_kl"
    assert (cfg.kl_loss_coef, cfg.entropy_coeff, cfg.use_kl_loss, cfg.dp_size) == (0.001, 0.0, False, 1)
    assert cfg.clip_low == cfg.clip_high == 0.2
    d = LossConfig(clip_ratio_high=0.28, loss_agg_mode="seq-mean-token-mean").to_dict()
    assert d["loss_agg_mode"] == "seq-mean-token-mean" and isinstance(d["loss_agg_mode"], str)
    assert type(d["kl_loss_type"]) is str
    assert LossConfig(**d) == LossConfig(clip_ratio_high=0.28, loss_agg_mode="seq-mean-token-mean")
    with pytest.raises(AttributeError):
        cfg.clip_ratio = 0.3  # type: ignore[misc]


def test_from_verl_reads_actor_section_nested_configs_and_global_batch_info() -> None:
    trainer = {
        "actor_rollout_ref": {
            "actor": {
                "clip_ratio": 0.2,
                "clip_ratio_low": 0.2,
                "clip_ratio_high": 0.28,
                "clip_ratio_c": 10.0,
                "loss_agg_mode": "token-mean",
                "use_kl_loss": True,
                "kl_loss_type": "low_var_kl",
                "kl_loss_coef": 0.001,
                "entropy_coeff": 0,
                "ppo_mini_batch_size": 256,  # not a loss field: ignored
                "policy_loss": {"loss_mode": "vanilla"},
                "global_batch_info": {
                    "dp_size": 8,
                    "batch_num_tokens": torch.tensor(4096),
                    "global_batch_size": 64,
                },
            }
        }
    }
    cfg = LossConfig.from_verl(trainer)
    assert cfg.clip_high == 0.28 and cfg.clip_ratio_c == 10.0 and cfg.use_kl_loss
    assert (cfg.dp_size, cfg.batch_num_tokens, cfg.global_batch_size) == (8, 4096, 64)
    assert (
        LossConfig.from_verl(trainer["actor_rollout_ref"]["actor"], batch_num_tokens=100).batch_num_tokens
        == 100
    )
    gspo = LossConfig.from_verl(
        {"tau_pos": 2.0, "policy_loss": {"loss_mode": "gspo", "kl_cov_ratio": 0.01, "clip_cov_ub": None}}
    )
    assert (gspo.loss_mode, gspo.tau_pos, gspo.kl_cov_ratio, gspo.clip_cov_ub) == ("gspo", 2.0, 0.01, 5.0)
    with pytest.raises(ValueError, match=r"loss_mode must be one of 'vanilla', .*'bypass_mode'; got 'nope'"):
        LossConfig.from_verl({"policy_loss": {"loss_mode": "nope"}})


class _StructuredConfig:
    """Behaves like OmegaConf's DictConfig / verl's BaseConfig: ``.get`` and attributes, no dict."""

    def __init__(self, **values):
        self._values = values

    def get(self, key, default=None):
        if key not in self._values:
            raise KeyError(key)  # structured configs refuse unknown keys
        return self._values[key]


def test_from_verl_accepts_structured_config_objects() -> None:
    actor = _StructuredConfig(
        clip_ratio=0.2,
        clip_ratio_low=None,
        clip_ratio_high=None,
        loss_agg_mode="seq-mean-token-sum-norm",
        loss_scale_factor=4096,
        policy_loss=_StructuredConfig(loss_mode="vanilla"),
    )
    cfg = LossConfig.from_verl(actor)
    assert cfg.loss_agg_mode is AggMode.SEQ_MEAN_TOKEN_SUM_NORM and cfg.loss_scale_factor == 4096
    with pytest.raises(ValueError, match="config must be a mapping"):
        LossConfig.from_verl(42)


def test_live_batches_never_share_workspace_buffers() -> None:
    first, second = _batch(30, b=5, t=64), _batch(31, b=5, t=64)
    cfg = LossConfig(use_kl_loss=True, entropy_coeff=0.01)
    expected = (recompute(cfg, **first), recompute(cfg, **second))
    a, b = TokenBatch(**first), TokenBatch(**second)  # both alive: each owns its buffers
    assert a.metrics(cfg) == expected[0]
    assert b.metrics(cfg) == expected[1]
    assert a.metrics(LossConfig(loss_agg_mode="token-sum")) == recompute(
        LossConfig(loss_agg_mode="token-sum"), **first
    )


def test_concurrent_recomputes_in_threads_agree_with_sequential() -> None:
    from concurrent.futures import ThreadPoolExecutor

    batches = [_batch(40 + i, b=6, t=128) for i in range(8)]
    cfg = LossConfig(use_kl_loss=True, kl_loss_type="k3+", loss_agg_mode="seq-mean-token-mean")
    sequential = [recompute(cfg, **t) for t in batches]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(3):
            assert list(pool.map(lambda t: recompute(cfg, **t), batches)) == sequential


def test_non_contiguous_inputs_are_accepted() -> None:
    tensors = _batch(50, b=6, t=40)
    wide = {k: torch.stack([v, torch.zeros_like(v)], dim=-1).flatten(1)[:, ::2] for k, v in tensors.items()}
    assert not wide["log_prob"].is_contiguous()
    cfg = LossConfig(use_kl_loss=True)
    assert recompute(cfg, **wide) == pytest.approx(recompute(cfg, **tensors), rel=1e-6)


def test_bad_inputs_raise_clear_errors() -> None:
    tensors = _batch(51)
    with pytest.raises(ValueError, match="advantages has shape"):
        recompute(LossConfig(), **dict(tensors, advantages=tensors["advantages"][:, :-1]))
    with pytest.raises(ValueError, match="must be 2-D"):
        recompute(LossConfig(), **{k: v[0] for k, v in tensors.items()})
    with pytest.raises(
        ValueError, match="log_prob must be a floating-point tensor, float16, bfloat16, float32 or float64"
    ):
        recompute(LossConfig(), **dict(tensors, log_prob=tensors["log_prob"].long()))
    with pytest.raises(ValueError, match="entropy is on meta but response_mask is on cpu"):
        recompute(LossConfig(), **dict(tensors, entropy=tensors["entropy"].to("meta")))
    with pytest.raises(ValueError, match=r"must be a torch\.Tensor"):
        recompute(LossConfig(), **dict(tensors, entropy=[1.0]))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 6),
    t=st.integers(1, 24),
    spread=st.sampled_from([0.0, 0.1, 1.0, 25.0]),
    mode=st.sampled_from(MODES),
    kl_type=st.sampled_from(KL_TYPES),
    density=st.floats(0.0, 1.0),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_fast_path_equals_reference_on_random_batches(
    seed, b, t, spread, mode, kl_type, density, dtype
) -> None:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 5
    tensors = {
        "log_prob": logp.to(dtype),
        "old_log_prob": (logp + torch.randn(b, t, generator=g, dtype=torch.float64) * spread).to(dtype),
        "advantages": (torch.randn(b, t, generator=g, dtype=torch.float64) * 2).to(dtype),
        "response_mask": torch.rand(b, t, generator=g) < density,
        "ref_log_prob": (logp + torch.randn(b, t, generator=g, dtype=torch.float64) * spread).to(dtype),
        "entropy": torch.rand(b, t, generator=g, dtype=torch.float64).to(dtype),
    }
    cfg = LossConfig(
        loss_agg_mode=mode, kl_loss_type=kl_type, use_kl_loss=True, entropy_coeff=0.01, clip_ratio_high=0.3
    )
    tol = 2e-5 if dtype == torch.float32 else 1e-10
    _assert_close(recompute(cfg, **tensors), _reference(cfg, tensors), tol, tol)


def test_registries_refuse_duplicates_and_unknown_names() -> None:
    from rlvitals.analyzers.reference.losses import register_agg_mode, register_kl_estimator

    with pytest.raises(ValueError, match="already registered"):
        register_agg_mode("token-mean")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="already registered"):
        register_kl_estimator("k3")(lambda a, b: a)
    loss, mask = _two_responses()
    with pytest.raises(ValueError, match="loss_agg_mode must be one of 'token-mean', 'token-sum'"):
        agg_loss(loss, mask, "mean")
    with pytest.raises(ValueError, match="kl_loss_type must be one of"):
        kl_penalty(loss, loss, "full")


def test_overflowing_and_infinite_rows_give_ieee_results_not_exceptions() -> None:
    from rlvitals.analyzers.fast.workspace import _total

    assert math.isnan(_total([math.inf, -math.inf])) and _total([1e308, 1e308]) == math.inf
    tensors = _batch(60, dtype=torch.float64)
    tensors["entropy"] = tensors["entropy"] * 1e307  # finite per token, overflows when summed
    tensors["entropy"][0, 0] = math.inf
    tensors["entropy"][1, 0] = -math.inf
    out = recompute(LossConfig(entropy_coeff=0.01), **tensors)
    assert math.isnan(out["entropy_loss"]) and math.isfinite(out["pg_loss"])
