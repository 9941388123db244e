"""Sparse and dense batches (fast.token_batch.TokenBatch): the compiled passes of vanilla, gpg, dro, cispo and the
entropy / KL loop skip the groups of tokens with none valid, unread, unless the batch is dense; what lies
under the mask counts only in verl's seq-mean aggregations, and those always see a dense batch."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from rlvitals.analyzers import LossConfig, recompute
from rlvitals.analyzers.contract.config import AggMode
from rlvitals.analyzers.fast import native
from rlvitals.analyzers.fast.dispatch import token_batch
from rlvitals.analyzers.fast.token_batch import TokenBatch
from rlvitals.analyzers.verdicts.auditing import _batch as audit_batch_of

pytestmark = pytest.mark.skipif(
    native.module() is None or not native.inline_exp(), reason="the compiled passes with exp inline"
)

FLOATS = ["log_prob", "old_log_prob", "advantages", "ref_log_prob", "entropy"]
SKIPPING = ["vanilla", "gpg", "dro", "cispo"]
SEQ_MODES = [m.value for m in AggMode if m not in (AggMode.TOKEN_MEAN, AggMode.TOKEN_SUM)]


def _batch(rows: int, width: int, dtype=torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded responses (a valid prefix per row, one row empty, one full) and one scattered row,
    per-token advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    t = {
        "log_prob": lp,
        "old_log_prob": lp + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.3,
        "advantages": torch.randn(rows, width, generator=g, dtype=torch.float64),
        "ref_log_prob": lp + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.2,
        "entropy": torch.rand(rows, width, generator=g, dtype=torch.float64) * 2,
    }
    t = {k: v.to(dtype) for k, v in t.items()}
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    lengths[0], lengths[-1] = width, 0
    mask = torch.arange(width)[None, :] < lengths[:, None]
    mask[1] = torch.rand(width, generator=g) < 0.2
    t["response_mask"] = mask
    return t


def _config(mode: str, agg: str = "token-mean", kl: str = "low_var_kl") -> LossConfig:
    extra = {"dro_beta": 0.1} if mode == "dro" else {}
    return LossConfig(
        loss_mode=mode, loss_agg_mode=agg, use_kl_loss=True, entropy_coeff=0.01, kl_loss_type=kl, **extra
    )


def _passes(t: dict, skip: bool, kl: str = "k3", check: bool = False) -> dict:
    """Every pass that honours skip, straight from the wrappers: its sums and counts, then its checks
    (k2's sum of squares, vanilla's guard), which only ever say finite or not."""
    inputs = native.Inputs({k: t[k] for k in FLOATS}, t["response_mask"].view(torch.uint8))

    def side():
        return inputs.side_terms(entropy=True, kl=kl, check=check, skip=skip)

    vf = inputs.vfused(0.8, 1.2, 3.0, entropy=True, kl=kl, check=check, skip=skip)
    outs = {
        "vfused": (list(vf[:6]), list(vf[6:])),
        "gpg": inputs.gpg(side()),
        "dro": inputs.dro(0.05, side()),
        "cispo": inputs.cispo(None, 0.8, 1.2, side()),
        "aux": inputs.aux(entropy=True, kl=kl, check=check, skip=skip),
    }
    for name in ("gpg", "dro", "cispo"):
        *sums, (ent, kl_rows, k2) = outs[name]
        outs[name] = ([*sums, ent, kl_rows], [k2])
    ent, kl_rows, k2 = outs["aux"]
    outs["aux"] = ([ent, kl_rows], [k2])
    return outs


def _flat(a) -> list[float]:
    if isinstance(a, (tuple, list)):
        return [x for v in a for x in _flat(v)]
    return [] if a is None else [float(a)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [1, 7, 9, 511, 512, 513, 1500, 4096 + 3])
@pytest.mark.parametrize("plan", [("k3", False), ("k3", True), ("k1", False), ("k2", True)])
def test_skipping_the_masked_groups_changes_no_sum_of_finite_inputs(dtype, width, plan):
    # a skipped token would only have added 0 (its mask is 0): every sum and count is the same float
    t = _batch(7, width, dtype, seed=width)
    sparse, dense = _passes(t, True, *plan), _passes(t, False, *plan)
    for name in dense:
        assert _flat(sparse[name][0]) == _flat(dense[name][0]), name
        assert all(map(math.isfinite, _flat(sparse[name][1] + dense[name][1]))), name


@pytest.mark.parametrize("f64", [False, True])
@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("where", ["group", "tail"])
def test_a_skipped_group_is_not_read(f64, value, where):
    # poison a whole group of masked tokens (or a row's padded tail of 3) in every input: the sparse
    # passes never see it, the dense ones do (a NaN in some sum), so skip really skips
    t = _batch(4, 67, torch.float64 if f64 else torch.float32, seed=3)
    t["response_mask"][0, 32:] = False
    for name in FLOATS:
        t[name][0, slice(40, 48) if where == "group" else slice(64, 67)] = value
    sparse, dense = _passes(t, True, check=True), _passes(t, False, check=True)
    for name in dense:
        assert all(map(math.isfinite, _flat(sparse[name]))), name
        assert not all(map(math.isfinite, _flat(dense[name]))), name


def _overflowing(
    dtype=torch.float32, lengths: list[int] | None = None, entropy: bool = True, a: float = 0.5
) -> dict[str, torch.Tensor]:
    """Finite inputs under the mask whose products overflow (A = -a max, by default -max / 2, against
    r = e^5 and logp = -4: each loss's per-token value is +-inf there, and verl's ``loss * mask`` NaN),
    and (``entropy``) an infinite entropy there."""
    t = _batch(6, 300, dtype, seed=11)
    if lengths is not None:  # right-padded rows of these lengths
        t["response_mask"] = torch.arange(300)[None, :] < torch.tensor(lengths)[:, None]
    masked = ~t["response_mask"]
    masked[-1] = False  # the empty row: verl's seq-mean leaves it out whatever it holds
    t["advantages"] = t["advantages"].masked_fill(masked, -torch.finfo(dtype).max * a)
    t["log_prob"] = t["log_prob"].masked_fill(masked, -4.0)
    t["old_log_prob"] = t["old_log_prob"].masked_fill(masked, -9.0)
    if entropy:
        t["entropy"] = t["entropy"].masked_fill(masked, math.inf)
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", SKIPPING)
@pytest.mark.parametrize("agg", ["token-mean", "token-sum", *SEQ_MODES])
def test_what_lies_under_the_mask_counts_exactly_where_verl_counts_it(mode, agg, dtype):
    # token modes: verl's masked_sum drops the masked products (a finite answer, the clean batch's);
    # seq-mean modes: its loss * mask keeps them (inf * 0 = NaN). The torch-op passes read every token
    # and fall back to verl's op sequence on any non-finite sum: they are the reference here.
    t = _overflowing(dtype)
    config = _config(mode, agg)
    compiled = recompute(config, **t)
    with native.disabled():
        ops = recompute(config, **t)
    assert compiled.keys() == ops.keys()
    for key in compiled:
        a, b = compiled[key], ops[key]
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-7), key
    if agg in SEQ_MODES:
        assert math.isnan(compiled["pg_loss"]) and math.isnan(compiled["entropy_loss"])
    else:
        assert all(map(math.isfinite, compiled.values()))


@pytest.mark.parametrize("path", ["inline", "between", "torch"])
@pytest.mark.parametrize("mode", ["vanilla", "cispo", "sapo", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl"])
def test_a_loss_overflowing_under_the_mask_is_verls_nan_in_seq_mean(mode, path):
    # every row's masked tokens fill whole groups of 8 here, past the valid span, and only the loss
    # overflows there (a finite entropy). vanilla: its fold multiplies A by the mask before the loss, so
    # a dense pass also sums verl's loss with A unmasked into its guard; cispo's clamp(r, lo, hi) A logp
    # and sapo's sigmoid((r - 1) tau) (4 / tau) A overflow as verl's do only with verl's r there, so a
    # dense pass takes exp of every token, not only of the valid span. A is sized so that verl's loss
    # overflows and a 0 ratio's would not: vanilla 3 A > max, cispo 1.2 A 4 > max > 0.8 A 4, sapo
    # sigmoid(1.05 (e^5 - 1)) 3.8 A > max > sigmoid(-1.05) 3.8 A (4 / tau_neg = 3.8). kl_cov and dppo
    # (and clip_cov) compute the valid tokens' loss only: a dense batch checks the masked tokens' loss
    # (-A r; -A min(r, c) logp; max(-A r, -A clamp(r))) and takes verl's op sequence when one is not
    # finite (clip_cov's random draw never changes whether its loss is NaN). Measured against verl 0.9.1
    # itself: NaN for all of them (README, "garbage under the mask").
    a = {"cispo": 0.25}.get(mode, 0.5)
    t = _overflowing(lengths=[296, 96, 8, 160, 240, 0], entropy=False, a=a)
    config = _config(mode, "seq-mean-token-mean")
    if path == "inline":
        out = recompute(config, **t)
    elif path == "between":
        with native.exp_between_passes():
            out = recompute(config, **t)
    else:
        with native.disabled():
            out = recompute(config, **t)
    assert math.isnan(out["pg_loss"])
    if mode != "sapo":  # (sapo aggregates by seq-mean-token-mean whatever loss_agg_mode says)
        assert all(map(math.isfinite, recompute(_config(mode), **t).values())), "token-mean: finite"


@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
def test_a_zero_advantage_times_an_overflowing_ratio_under_the_mask_is_verls_nan(mode):
    # no bound on |A| catches this one (max |A| can be anything): verl's unclamped exp(lp - old) is inf
    # in float32 at lp - old = 100, and -0 * inf is NaN under the mask; the check bounds the ratio too
    # (verl 0.9.1 itself: NaN in seq-mean-token-mean, finite in token-mean, both modes)
    t = _batch(5, 24, torch.float32, seed=4)
    t["response_mask"] = torch.arange(24)[None, :] < torch.tensor([24, 8, 16, 11, 3])[:, None]
    padding = ~t["response_mask"]
    t["advantages"] = t["advantages"].masked_fill(padding, 0.0)
    t["old_log_prob"] = torch.where(padding, t["log_prob"] - 100.0, t["old_log_prob"])
    for path in (contextlib.nullcontext, native.disabled):
        with path():
            assert math.isnan(recompute(_config(mode, "seq-mean-token-mean"), **t)["pg_loss"]), path
            assert math.isfinite(recompute(_config(mode), **t)["pg_loss"]), path


def test_a_batch_turns_dense_when_a_config_aggregates_by_seq_mean():
    t = _overflowing()
    batch = token_batch(t)
    assert not batch.dense
    token = batch.metrics(_config("gpg"))
    assert all(map(math.isfinite, token.values())) and not batch.dense
    seq = batch.metrics(_config("gpg", "seq-mean-token-sum"))
    assert batch.dense and math.isnan(seq["pg_loss"]) and math.isnan(seq["entropy_loss"])
    fresh = TokenBatch(**t, dense=True)
    again = batch.metrics(_config("gpg"))  # the dense batch still gives the token modes' answer
    assert again == pytest.approx(fresh.metrics(_config("gpg")), rel=1e-6)
    assert again == pytest.approx(token, rel=1e-6)


@pytest.mark.parametrize("mode", ["sapo", "geo_mean"])
def test_the_losses_that_fix_their_own_aggregation_take_a_dense_batch(mode):
    batch = token_batch(_batch(3, 40))
    batch.metrics(_config(mode))
    assert batch.dense


@pytest.mark.parametrize("agg", SEQ_MODES)
def test_aggregate_refuses_a_seq_mean_mode_on_a_sparse_batch(agg):
    batch = token_batch(_batch(3, 40))
    rows = batch.entropy_rows()
    batch.aggregate(rows, "token-mean")
    with pytest.raises(RuntimeError, match="densify"):
        batch.aggregate(rows, agg)
    batch.densify()
    rows = batch.entropy_rows()
    assert math.isfinite(batch.aggregate(rows, agg))


def test_an_audits_batch_is_dense():
    assert audit_batch_of(_batch(3, 40)).dense
