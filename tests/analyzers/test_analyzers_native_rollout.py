"""The compiled rollout-correction passes (analyzers/csrc/rollout.h, rollout.py's _Native) against the
torch ops they replace (native.disabled()): every IS level and threshold kind, batch normalisation,
every rejection option alone and chained, on every width the loops treat differently. Parity with
verl itself runs on both paths in test_analyzers_rollout_parity.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rlvitals.analyzers import rollout_corr_metrics, rollout_correction, rollout_debug_metrics
from rlvitals.analyzers.contract.rollout_config import RS_OPTIONS
from rlvitals.analyzers.fast import native
from rlvitals.analyzers.fast.rollout import _Native, _native_debug

CONFIGS = {
    "off-policy": {},
    "token TIS": {"rollout_is": "token", "rollout_is_threshold": 1.5},
    "token IcePop": {"rollout_is": "token", "rollout_is_threshold": "0.8_1.2"},
    "token TIS bn": {"rollout_is": "token", "rollout_is_threshold": 1.1, "rollout_is_batch_normalize": True},
    "token IcePop bn": {
        "rollout_is": "token",
        "rollout_is_threshold": "0.9_1.3",
        "rollout_is_batch_normalize": True,
    },
    "sequence TIS": {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "sequence IcePop": {"rollout_is": "sequence", "rollout_is_threshold": "0.01_100"},
    "sequence TIS bn": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 1.5,
        "rollout_is_batch_normalize": True,
    },
    "sequence IcePop bn": {
        "rollout_is": "sequence",
        "rollout_is_threshold": "0.2_5",
        "rollout_is_batch_normalize": True,
    },
    **{  # every rejection option alone, thresholds that keep some tokens and reject others
        option: {"rollout_rs": option, "rollout_rs_threshold": "0.8_1.25" if option.endswith("k1") else 0.02}
        for option in RS_OPTIONS
    },
    "chain token": {"rollout_rs": "token_k1,token_k2,token_k3", "rollout_rs_threshold": "0.7_1.3,0.05,0.03"},
    "chain mixed + TIS": {
        "rollout_is": "token",
        "rollout_rs": "token_k1,seq_mean_k3,seq_max_k2",
        "rollout_rs_threshold": "0.8_1.25,0.01,0.2",
    },
    "chain seq + IcePop bn": {
        "rollout_is": "sequence",
        "rollout_is_threshold": "0.1_10",
        "rollout_is_batch_normalize": True,
        "rollout_rs": "seq_sum_k1,seq_sum_k2,seq_mean_k1,seq_max_k3",
        "rollout_rs_threshold": "0.5_2,1.0,0.9_1.1,0.3",
    },
}


def _batch(
    rows: int, width: int, dtype=torch.float32, seed: int = 0, spread: float = 0.15, mask_dtype=torch.int64
):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    rollout = old + torch.randn(rows, width, generator=g, dtype=torch.float64) * spread
    mask = torch.rand(rows, width, generator=g) < 0.75
    mask[:, 0] = True  # every row valid somewhere ...
    if rows > 2:
        mask[1] = False  # ... but one: an all-masked row
    return old.to(dtype), rollout.to(dtype), mask.to(mask_dtype)


def _exact(key: str) -> bool:
    """Token-level rejection keys that are counts over tokens or max / min of token values: equal on
    both paths (IS keys depend on the level: the callers that know it say)."""
    name = key.removeprefix("rollout_corr/")
    if not name.startswith("rollout_rs_token_"):
        return False
    rest = name[len("rollout_rs_token_k1_") :]
    return rest in ("max", "min", "fraction_high", "fraction_low", "masked_fraction", "seq_masked_fraction")


def _std_tolerance(key: str, ref: dict[str, float], tol: float) -> float:
    """verl's std is sqrt(E[x^2] - E[x]^2): the moments agree to ``tol``, their difference cancels."""
    stem = key[: -len("std")]
    scale = max(abs(ref.get(stem + k, 0.0)) for k in ("mean", "max", "min"))
    e2 = scale * scale + ref[key] ** 2
    return 1e-7 + 4 * tol * e2 / max(ref[key], math.sqrt(tol * e2), 1e-30)


def _compare(got, want, dtype, level=None, exact_is=False):
    tol = 2e-6 if dtype == torch.float32 else 1e-12
    (w1, m1, d1), (w2, m2, d2) = got, want
    assert torch.equal(m1, m2) and m1.dtype == m2.dtype
    if w2 is None:
        assert w1 is None
    else:
        assert w1.dtype == w2.dtype and w1.shape == w2.shape
        torch.testing.assert_close(w1, w2, rtol=tol, atol=tol, equal_nan=True)
    assert list(d1) == list(d2)  # the same keys in verl's order
    for key, b in d2.items():
        a = d1[key]
        if math.isnan(b):
            assert math.isnan(a), key
        elif _exact(key) or (
            exact_is
            and level == "token"
            and key.endswith(
                ("is_ratio_fraction_high", "is_ratio_fraction_low", "is_max", "is_min", "oob_ratio")
            )
        ):
            assert a == b, key
        elif key.endswith("_std") and not key.endswith("_seq_std"):
            assert a == b or abs(a - b) <= _std_tolerance(key, d2, tol), (key, a, b)
        elif key.endswith("_seq_std") and b > 0 and math.isfinite(b):
            # a std over few sequences of values far from 0: torch's float32 two-pass std loses
            # |mean| / std ulps to cancellation, the float64 one here does not
            mean = abs(d2.get(key[: -len("std")] + "mean", 0.0))
            rel = tol * max(1.0, 4 * mean / b)
            assert a == pytest.approx(b, rel=rel, abs=tol), (key, a, b)
        elif key.endswith(_EXP_KEYS) and b not in (0.0, math.inf, -math.inf):
            # exp of a float32 sum: a rounding difference dx in the exponent x = log b (float64 sums here,
            # float32 cascade sums in torch) is a relative dx in b, and dx grows with |x| (log-ratios past
            # +-20 make x ~ 20 and b ~ 1e8)
            rel = tol * max(1.0, 2 * abs(math.log(abs(b))))
            assert a == pytest.approx(b, rel=rel, abs=tol), (key, a, b)
        else:
            assert a == pytest.approx(b, rel=tol, abs=tol), key


# the metrics that are exp of a mean (or hold exp(d) terms): their rounding scales with the exponent
_EXP_KEYS = ("ppl_ratio", "training_ppl", "rollout_ppl", "chi2_token", "chi2_seq", "k3_kl")


def _both(args, options):
    got = rollout_correction(*args, **options)
    with native.disabled():
        want = rollout_correction(*args, **options)
    return got, want


def _outcome(args, options, torch_ops=False):
    try:
        if torch_ops:
            with native.disabled():
                return rollout_correction(*args, **options)
        return rollout_correction(*args, **options)
    except (ValueError, ZeroDivisionError) as exc:
        return type(exc)


def test_the_compiled_passes_take_what_they_can_read_in_place():
    old, rollout, mask = _batch(4, 40)
    for m in (mask, mask.bool(), mask.float(), mask.to(torch.uint8)):
        nat = _Native.of(old, rollout, m)
        assert nat is not None
        nat.close()
    assert _Native.of(old.double(), rollout.double(), mask.double()) is not None
    refused = [
        (old.half(), rollout.half(), mask),  # verl's ops in half precision
        (old, rollout.double(), mask),  # mixed dtypes
        (old, rollout, mask.double()),  # a float64 mask promotes verl's float32 sums to float64
        (old, rollout, mask * 2),  # verl weighs by the mask's values
        (old, rollout, mask.float() * 0.5),
        (old, rollout, -mask),
    ]
    for args in refused:
        assert _Native.of(*args) is None
    with native.disabled():
        assert _Native.of(old, rollout, mask) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [1, 7, 8, 9, 63, 4096 + 3])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_compiled_and_torch_ops_agree_on_every_width_and_option(dtype, width, config):
    options = CONFIGS[config]
    args = _batch(5, width, dtype, seed=width)
    got, want = _outcome(args, options), _outcome(args, options, torch_ops=True)
    if isinstance(want, type):  # IcePop zeroed every weight: verl's ESS divides by zero, on both paths
        assert got is want
    else:
        _compare(got, want, dtype, options.get("rollout_is"), exact_is=True)
    got = rollout_corr_metrics(*args)
    with native.disabled():
        want = rollout_corr_metrics(*args)
    assert list(got) == list(want)
    tol = 2e-6 if dtype == torch.float32 else 1e-12
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=tol, abs=tol), key


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32, torch.float32])
def test_every_mask_dtype_gives_back_its_own_dtype(mask_dtype):
    args = _batch(4, 33, mask_dtype=mask_dtype)
    options = CONFIGS["chain mixed + TIS"]
    got, want = _both(args, options)
    assert got[1].dtype == mask_dtype
    _compare(got, want, torch.float32, "token", exact_is=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tokens_on_the_bounds_count_exactly_as_verl_counts_them(dtype):
    old, rollout, mask = _batch(6, 50, dtype, seed=3)
    valid = mask.bool()
    log_ratio = old - rollout
    safe = log_ratio.clamp(-20, 20)
    rho = torch.exp(safe)
    # thresholds that some valid tokens hit exactly (a strict > must not count them, <= must keep them)
    upper = float(rho[valid][7])
    lower = float(rho[valid][11])
    lower, upper = min(lower, upper), max(lower, upper)
    assert ((rho == upper) & valid).any() and ((rho == lower) & valid).any()
    for options in (
        {"rollout_is": "token", "rollout_is_threshold": upper},
        {"rollout_is": "token", "rollout_is_threshold": f"{lower!r}_{upper!r}"},
    ):
        got, want = _both((old, rollout, mask), options)
        _compare(got, want, dtype, "token", exact_is=True)
        n = int(valid.sum())
        assert got[2]["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(
            int(((rho > upper) & valid).sum()) / n, rel=1e-6
        )
    k2 = 0.5 * safe**2
    k3 = torch.exp(safe) - 1.0 - safe
    for option, stat in (("token_k2", k2), ("token_k3", k3)):
        bound = float(stat[valid][5])
        got, want = _both((old, rollout, mask), {"rollout_rs": option, "rollout_rs_threshold": bound})
        _compare(got, want, dtype)
        rejected = int(((stat > bound) & valid).sum())
        assert 0 < rejected < int(valid.sum())
        kept = got[1].bool()
        assert int((valid & ~kept).sum()) == rejected
    # k1 = -safe against log(lower) / log(upper), compared in the token dtype: tokens placed on both
    lo, hi = 0.8, 1.25
    old = old.clone()
    old[0, :4] = rollout[0, :4] + torch.tensor([-math.log(hi), -math.log(lo)] * 2, dtype=torch.float64).to(
        dtype
    )
    mask = mask.clone()
    mask[0, :4] = 1
    got, want = _both((old, rollout, mask), {"rollout_rs": "token_k1", "rollout_rs_threshold": f"{lo}_{hi}"})
    _compare(got, want, dtype)


@pytest.mark.parametrize("where", ["masked", "valid"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", ["old", "rollout"])
@pytest.mark.parametrize("config", ["off-policy", "token TIS", "sequence IcePop bn", "chain mixed + TIS"])
def test_a_non_finite_value_anywhere_sends_both_paths_to_verls_op_sequence(where, value, name, config):
    old, rollout, mask = _batch(3, 20)
    valid = mask.bool()
    i, j = (0, int((~valid[0]).nonzero()[0])) if where == "masked" else (2, int(valid[2].nonzero()[0]))
    t = {"old": old.clone(), "rollout": rollout.clone()}
    t[name][i, j] = value
    args = (t["old"], t["rollout"], mask)
    assert _Native.of(*args) is None  # the off-policy sums are not finite
    options = CONFIGS[config]
    got, want = _outcome(args, options), _outcome(args, options, torch_ops=True)
    if isinstance(want, type):  # verl's own error (e.g. IcePop zeroed every weight): both paths raise it
        assert got is want
        return
    _compare(got, want, torch.float32, options.get("rollout_is"))


def test_a_log_ratio_past_the_clamp_uses_the_clamped_exp():
    old, rollout, mask = _batch(4, 30, seed=5)
    old = old.clone()
    old[0, 0], old[2, 3] = rollout[0, 0] + 25.0, rollout[2, 3] - 30.0  # |d| > 20: rho = exp(+-20), not exp(d)
    for config in ("token TIS", "token_k3", "chain mixed + TIS"):
        _compare(*_both((old, rollout, mask), CONFIGS[config]), torch.float32, "token", exact_is=True)


@pytest.mark.parametrize(
    ("level", "rows", "width", "seed", "upper"),
    [("sequence", 2, 7, 644, 1.0000001), ("token", 6, 7, 26516, 1.0)],
)
def test_per_sequence_means_an_ulp_from_a_threshold_fall_on_verls_side(level, rows, width, seed, upper):
    # log-ratios of ~1e-8: every weight is within an ulp of 1, and so is the IcePop / 1/upper bound; the
    # per-sequence means must be verl's float32 row sums of the weights (a float64 sum rounded once
    # flipped rollout_is_seq_fraction_low from 0 to 0.5 / 1)
    old, rollout, mask = _batch(rows, width, torch.float32, seed=seed, spread=1e-8)
    options = {"rollout_is": level, "rollout_is_threshold": f"{1 / upper}_{upper}"}
    if level == "token":
        options["rollout_is_threshold"] = upper
    got, want = _both((old, rollout, mask), options)
    for key in ("rollout_corr/rollout_is_seq_fraction_low", "rollout_corr/rollout_is_seq_min"):
        assert got[2][key] == want[2][key], key
    _compare(got, want, torch.float32, level, exact_is=True)


def test_every_weight_truncated_to_the_bound_gives_verls_exact_std():  # the sums are torch's own
    # every weight is the bound: verl's E[w^2] - E[w]^2 is float32 rounding noise around 0; the compiled
    # path takes verl's own sums then, not a float64 sum that rounds to another noise
    old, rollout, mask = _batch(4, 257, seed=9, spread=0.01)
    old = rollout + 0.5  # every ratio e^0.5 > 1.01
    options = {
        "rollout_is": "token",
        "rollout_is_threshold": 1.01,
        "rollout_rs": "seq_max_k2",
        "rollout_rs_threshold": 0.02,
    }
    got, want = _both((old, rollout, mask), options)
    for key in ("rollout_corr/rollout_is_std", "rollout_corr/rollout_rs_seq_max_k2_std"):
        assert got[2][key] == want[2][key], key


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    width=st.integers(1, 70),
    spread=st.floats(0.0, 30.0),
    config=st.sampled_from(list(CONFIGS)),
    upper=st.floats(1.0, 4.0),
    seed=st.integers(0, 2**16),
    f64=st.booleans(),
)
def test_compiled_and_torch_ops_agree_on_random_batches(rows, width, spread, config, upper, seed, f64):
    # spread up to 30: log-ratios past the +-20 clamp; thresholds anywhere
    dtype = torch.float64 if f64 else torch.float32
    old, rollout, mask = _batch(rows, width, dtype, seed=seed, spread=spread)
    options = dict(CONFIGS[config])
    if "rollout_is" in options:
        options["rollout_is_threshold"] = (
            upper if "_" not in str(options.get("rollout_is_threshold", 2.0)) else f"{1 / upper}_{upper}"
        )
    got, want = (
        _outcome((old, rollout, mask), options),
        _outcome((old, rollout, mask), options, torch_ops=True),
    )
    if isinstance(want, type):  # IcePop zeroed every weight: verl's ESS divides by zero, on both paths
        assert got is want
        return
    _compare(got, want, dtype, options.get("rollout_is"), exact_is=True)


def _debug_both(args):
    got = rollout_debug_metrics(*args)
    with native.disabled():
        want = rollout_debug_metrics(*args)
    return got, want


def _debug_close(got, want, dtype):
    tol = 2e-6 if dtype == torch.float32 else 1e-12
    assert list(got) == list(want)
    for key, b in want.items():
        a = got[key]
        if math.isnan(b):
            assert math.isnan(a), key
        elif key.endswith(("_max", "_valid")):
            assert a == b, key  # exact
        else:  # torch.corrcoef is float32 (a 2 x n matmul): the compiled float64 correlation is closer
            assert a == pytest.approx(b, rel=1e-5 if key.endswith("corr") and tol > 1e-9 else tol, abs=tol), (
                key
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [1, 7, 8, 9, 63, 4096 + 3])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64])
def test_debug_metrics_compiled_and_torch_ops_agree(dtype, width, mask_dtype):
    args = _batch(5, width, dtype, seed=width, mask_dtype=mask_dtype)
    assert _native_debug(*args) is not None  # the compiled pass, not the torch ops twice
    _debug_close(*_debug_both(args), dtype)


def test_debug_metrics_edge_cases_take_the_same_values():
    old, rollout, mask = _batch(3, 12)
    none = torch.zeros_like(mask)
    got, want = _debug_both((old, rollout, none))
    _debug_close(got, want, torch.float32)
    assert got["training/rollout_probs_diff_valid"] == 0 and math.isnan(
        got["training/rollout_probs_diff_max"]
    )
    one = none.clone()
    one[2, 5] = 1  # one token: std and correlation NaN, as torch gives them
    _debug_close(*_debug_both((old, rollout, one)), torch.float32)
    assert math.isnan(rollout_debug_metrics(old, rollout, one)["training/rollout_probs_diff_std"])
    same = (old, old.clone(), mask)  # equal probabilities: diff 0 everywhere, correlation 1
    _debug_close(*_debug_both(same), torch.float32)
    weighted = (old, rollout, mask * 3)  # masked_select reads any non-zero as valid: the torch ops then
    _debug_close(*_debug_both(weighted), torch.float32)
    for value, where in ((math.nan, 0), (math.inf, 0), (math.nan, 1)):
        t = old.clone()
        valid = mask.bool()
        j = int((valid[0] if where else ~valid[0]).nonzero()[0])
        t[0, j] = value  # masked: masked_select drops it; valid: NaN / inf results on both paths
        _debug_close(*_debug_both((t, rollout, mask)), torch.float32)


@pytest.mark.skipif(not native.inline_exp(), reason="torch's exp is not MKL's here: nothing is inline")
@pytest.mark.parametrize("f64", [False, True])
@pytest.mark.parametrize("width", [1, 9, 511, 512, 513, 1500, 4096 + 3])
def test_debug_metrics_with_exp_inline_are_those_over_torchs_exp_buffers(f64, width):
    # the pass taking exp of the valid spans per chunk, against the same pass over torch.exp of every
    # token: the same sums exactly (right-padded rows, all-masked chunks, a row starting masked)
    dtype = torch.float64 if f64 else torch.float32
    old, rollout, _ = _batch(6, width, dtype, seed=width, spread=0.5)
    g = torch.Generator().manual_seed(width)
    lengths = torch.randint(0, width + 1, (6,), generator=g)
    lengths[0] = 0
    mask = torch.arange(width)[None, :] < lengths[:, None]
    mask[2] = torch.rand(width, generator=g) < 0.1
    mask[3, width // 2 :] = True
    if not mask.any():
        mask[4, -1] = True
    inputs = native.Inputs(
        {"old_log_prob": old, "rollout_log_prob": rollout}, mask.contiguous().view(torch.uint8)
    )
    buffered = inputs.rc_dbg(torch.exp(old), torch.exp(rollout))
    assert inputs.rc_dbg() == buffered
    with native.exp_between_passes(), pytest.raises(ValueError):
        inputs.rc_dbg()
    with pytest.raises(ValueError):
        inputs.rc_dbg(torch.exp(old), None)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    width=st.integers(1, 70),
    spread=st.floats(0.0, 3.0),
    seed=st.integers(0, 2**16),
    f64=st.booleans(),
)
def test_debug_metrics_agree_on_random_batches(rows, width, spread, seed, f64):
    dtype = torch.float64 if f64 else torch.float32
    _debug_close(*_debug_both(_batch(rows, width, dtype, seed=seed, spread=spread)), dtype)


def _span_masks(rows: int, width: int, seed: int) -> torch.Tensor:
    """Right-padded rows (one empty, one full), a sparse row, a row valid only in its second half and
    one valid only at its last token: valid spans that start and end on and off the 512-token chunks."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    lengths[0], lengths[1] = 0, width
    mask = torch.arange(width)[None, :] < lengths[:, None]
    mask[2] = torch.rand(width, generator=g) < 0.1
    mask[3] = False
    mask[3, width // 2 :] = True
    mask[4] = False
    mask[4, -1] = True
    return mask


def _off_both(old, rollout, mask_u8):
    inputs = native.Inputs({"old_log_prob": old, "rollout_log_prob": rollout}, mask_u8)
    dm_i, rho, dm_b = torch.empty_like(old), torch.full_like(old, math.nan), torch.empty_like(old)
    e = torch.exp(old - rollout)
    inline = inputs.rc_off(None, None, dm_i, rho)
    buffered = inputs.rc_off(e, e, dm_b)
    return inline, buffered, (dm_i, dm_b), rho, e


@pytest.mark.skipif(not native.inline_exp(), reason="torch's exp is not MKL's here: nothing is inline")
@pytest.mark.parametrize("f64", [False, True])
@pytest.mark.parametrize("width", [1, 7, 9, 511, 512, 513, 1024, 1500, 4096 + 3])
def test_off_policy_pass_with_exp_inline_is_the_pass_over_torchs_exp_buffer(f64, width):
    # exp of the valid spans per chunk, against torch.exp of every token: the same sums exactly, d m
    # bit for bit, and rho (written by the inline pass) torch's exp at every valid token, finite (0 or
    # exp(d)) at every masked one
    dtype = torch.float64 if f64 else torch.float32
    old, rollout, _ = _batch(6, width, dtype, seed=width, spread=0.5)
    mask = _span_masks(6, width, width)
    (ri, ci, ti, bi), (rb, cb, tb, bb), (dm_i, dm_b), rho, e = _off_both(old, rollout, mask.view(torch.uint8))
    assert torch.equal(ri, rb) and torch.equal(ci, cb) and ti == tb
    assert not bi and not bb
    assert torch.equal(dm_i.view(torch.uint8), dm_b.view(torch.uint8))
    assert torch.equal(rho[mask].view(torch.uint8), e[mask].view(torch.uint8))
    assert bool(torch.isfinite(rho).all())
    assert bool((rho[~mask] == 0).any()) or width == 1 or bool(mask.all())  # outside the spans: no exp
    with native.exp_between_passes(), pytest.raises(ValueError):
        native.Inputs({"old_log_prob": old, "rollout_log_prob": rollout}, mask.view(torch.uint8)).rc_off(
            None, None, dm_i
        )


@pytest.mark.skipif(not native.inline_exp(), reason="torch's exp is not MKL's here: nothing is inline")
@pytest.mark.parametrize("where", ["valid", "masked in the span", "masked past the span"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 25.0, -25.0, 100.0])
@pytest.mark.parametrize("name", ["old", "rollout"])
def test_off_policy_pass_with_exp_inline_sees_what_the_buffered_pass_sees(where, value, name):
    # a non-finite input leaves some sum non-finite on both; |d| > 20 (a finite input far out, even
    # one whose exp overflows under the mask) says big on both, and then the caller runs the buffered
    # passes: both exp paths end on the same results
    old, rollout, _ = _batch(4, 1100, seed=3)
    mask = torch.arange(1100)[None, :] < torch.tensor([[1100], [700], [300], [1]])
    mask[0, 10] = False
    i, j = {"valid": (1, 5), "masked in the span": (0, 10), "masked past the span": (2, 900)}[where]
    t = {"old": old.clone(), "rollout": rollout.clone()}
    if math.isfinite(value):  # d moved by value: old up by it, or rollout down
        t[name][i, j] += value if name == "old" else -value
    else:
        t[name][i, j] = value
    (ri, _, ti, bi), (rb, _, tb, bb), _, _, _ = _off_both(t["old"], t["rollout"], mask.view(torch.uint8))
    finite_i = bool(torch.isfinite(ri).all()) and all(math.isfinite(v) for v in ti)
    finite_b = bool(torch.isfinite(rb).all()) and all(math.isfinite(v) for v in tb)
    assert bi == bb  # from d at every token, masked or not
    assert bi or finite_i == finite_b  # with big the inline pass's sums are not used
    args = (t["old"], t["rollout"], mask.to(torch.int64))
    # verl's ops: any non-finite input, or exp(d) = inf (even masked: inf 0 is NaN), leaves a NaN
    overflow = not math.isfinite(value) or value == 100.0
    assert (_Native.of(*args) is None) == overflow
    with native.exp_between_passes():
        assert (_Native.of(*args) is None) == overflow
    for options in ({}, CONFIGS["token TIS"], CONFIGS["chain mixed + TIS"]):
        _inline_is_between_passes(args, options)


def _inline_is_between_passes(args, options) -> None:
    """rollout_correction (``options``) and rollout_corr_metrics of ``args``: the same bits with exp
    inline and with exp between passes."""
    inline = _outcome(args, options)
    with native.exp_between_passes():
        buffered = _outcome(args, options)
    _same(inline, buffered)
    a = rollout_corr_metrics(*args)
    with native.exp_between_passes():
        b = rollout_corr_metrics(*args)
    assert _bits(a) == _bits(b)


def _bits(metrics: dict[str, float]) -> dict[str, str]:
    return {k: float(v).hex() for k, v in metrics.items()}


def _same(got, want) -> None:
    """Two results of rollout_correction, exactly equal (NaN equal to NaN)."""
    if isinstance(want, type):
        assert got is want
        return
    (w1, m1, d1), (w2, m2, d2) = got, want
    assert torch.equal(m1, m2) and m1.dtype == m2.dtype
    assert (w1 is None and w2 is None) or torch.equal(w1.view(torch.uint8), w2.view(torch.uint8))
    assert _bits(d1) == _bits(d2)


@pytest.mark.skipif(not native.inline_exp(), reason="torch's exp is not MKL's here: nothing is inline")
@pytest.mark.parametrize("f64", [False, True])
@pytest.mark.parametrize("width", [7, 513, 1500])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_option_gives_the_same_numbers_with_exp_inline_and_between_passes(f64, width, config):
    # the downstream passes read the inline pass's rho: 0 past the valid spans, where they only ever
    # multiply it by a 0 mask; every weight, mask and metric is the exp-between-passes one, bit for bit
    dtype = torch.float64 if f64 else torch.float32
    old, rollout, _ = _batch(6, width, dtype, seed=width, spread=0.3)
    args = (old, rollout, _span_masks(6, width, width + 1).to(torch.int64))
    _inline_is_between_passes(args, CONFIGS[config])


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.int16, torch.uint8, torch.float32, torch.float64, torch.bool]
)
def test_a_mask_of_any_dtype_becomes_the_bytes_torch_makes_of_it(dtype):
    from rlvitals.analyzers.fast.rollout import _mask_bytes

    g = torch.Generator().manual_seed(1)
    base = torch.rand(3, 1037, generator=g) < 0.6
    mask = base.to(dtype)
    got = _mask_bytes(mask)
    assert got is not None and got.dtype == torch.uint8 and got.is_contiguous()
    assert torch.equal(got, base.view(torch.uint8))
    with native.disabled():
        assert torch.equal(_mask_bytes(mask), got)
    assert torch.equal(_mask_bytes(mask.t().contiguous().t()), got)  # not contiguous: torch's ops
    if dtype == torch.bool:
        return
    bad = [2, -1] + ([0.5, math.nan, math.inf] if dtype.is_floating_point else [])
    if dtype == torch.uint8:
        bad = [2, 255]
    for value in bad:
        for j in (0, 517, 1036):  # first, middle, last: the vector body and the scalar tail
            m = mask.clone()
            m[1, j] = value
            assert _mask_bytes(m) is None, (value, j)
            with native.disabled():
                assert _mask_bytes(m) is None
    if dtype.is_floating_point:  # -0.0 is 0
        m = mask.clone()
        m[m == 0] = -0.0
        assert torch.equal(_mask_bytes(m), got)
    ok, out = native.mask_bytes(mask)  # the one-pass conversion where it applies
    assert ok == (dtype in (torch.int64, torch.int32, torch.float32, torch.float64))
    assert not ok or torch.equal(out, got)
