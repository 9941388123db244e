"""The compiled passes of losses A (gpg, dro, cispo, sapo, gspo, geo_mean; csrc/losses_a.h) against the
torch-op passes they replace (``native.disabled()``). Parity with verl itself runs on both paths in
test_analyzers_policy_losses.py and test_analyzers_parity.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rlvitals.analyzers import LossConfig, recompute
from rlvitals.analyzers.fast import native
from rlvitals.analyzers.fast.token_batch import TokenBatch

MODES = ["gpg", "dro", "cispo", "sapo", "gspo", "geo_mean"]
CLIPPING = ["cispo", "gspo", "geo_mean"]  # the modes that count clipped tokens
FLOATS = ["log_prob", "old_log_prob", "advantages", "ref_log_prob", "entropy"]


def _config(mode: str, **kw) -> LossConfig:
    extra = {"dro_beta": 0.1} if mode == "dro" else {}
    return LossConfig(
        loss_mode=mode, use_kl_loss=True, entropy_coeff=0.01, kl_loss_type="low_var_kl", **extra, **kw
    )


def _batch(rows: int, width: int, dtype=torch.float32, seed: int = 0, spread: float = 0.3, token_adv=False):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(rows, width if token_adv else 1, generator=g, dtype=torch.float64)
    t = {
        "log_prob": lp,
        "old_log_prob": lp + torch.randn(rows, width, generator=g, dtype=torch.float64) * spread,
        "advantages": adv.expand(rows, width).contiguous(),
        "ref_log_prob": lp + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.2,
        "entropy": torch.rand(rows, width, generator=g, dtype=torch.float64) * 2,
    }
    t = {k: v.to(dtype) for k, v in t.items()}
    t["response_mask"] = torch.rand(rows, width, generator=g) < 0.7
    return t


def _both(config: LossConfig, t: dict) -> tuple[dict, dict]:
    assert TokenBatch(**t).native is not None  # the compiled side really runs the loops
    compiled = recompute(config, **t)
    with native.disabled():
        ops = recompute(config, **t)
    return compiled, ops


def _agree(compiled: dict, ops: dict, tol: float) -> None:
    assert compiled.keys() == ops.keys()
    for key in compiled:
        a, b = compiled[key], ops[key]
        if key in ("pg_clipfrac", "pg_clipfrac_lower"):
            assert a == b or (math.isnan(a) and math.isnan(b)), key  # counts: exactly equal
        else:
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=tol, abs=tol), key


def test_the_losses_a_loops_are_built():
    assert native.module() is not None, native.STATUS
    for name in ("gpg", "dro", "cispo", "sapo_gate", "sapo", "gspo_logratio", "gspo", "geo_mean"):
        assert hasattr(native.module(), name), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [1, 7, 8, 9, 63, 4096 + 3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kl", ["low_var_kl", "kl", "abs", "mse", "low_var_kl+", "k1+"])
def test_compiled_and_torch_ops_agree_on_every_width(mode, dtype, width, kl):
    # widths below, at and past one vector (8 floats / 4 doubles) and a ragged tail; per-token
    # advantages so that both signs meet in one row; every KL estimator (computed in the loss's pass)
    t = _batch(5, width, dtype, seed=width, token_adv=True)
    t["response_mask"][2] = False  # an all-masked row
    config = LossConfig(
        loss_mode=mode,
        use_kl_loss=True,
        entropy_coeff=0.01,
        kl_loss_type=kl,
        dro_beta=0.1 if mode == "dro" else None,
    )
    compiled, ops = _both(config, t)
    _agree(compiled, ops, 1e-6 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_the_loops_sums_are_the_per_token_values_of_the_torch_ops(mode):
    # each loop's row sums against the torch-op formula of the same mode, computed here in float64
    t = _batch(6, 37, torch.float64, seed=3, spread=2.0, token_adv=True)
    mask = t["response_mask"]
    inputs = native.Inputs({k: t[k] for k in FLOATS}, mask.view(torch.uint8))
    lp, old, adv, m = t["log_prob"], t["old_log_prob"], t["advantages"], mask.double()
    d = lp - old
    dc = d.clamp(-20.0, 20.0)
    r = dc.exp()
    if mode == "gpg":
        rows, extra = inputs.gpg()[0], {}
        want = (lp * adv * m).sum(-1)
    elif mode == "dro":
        rows, kl, _ = inputs.dro(0.05)
        want, extra = ((lp * adv - 0.05 * d.square()) * m).sum(-1), {kl: (d * m).sum()}
    elif mode == "cispo":
        rows, kl, hits, _ = inputs.cispo(r.clone(), 0.8, 1.2)
        want = (r.clamp(0.8, 1.2) * adv * lp * m).sum(-1)
        extra = {kl: (dc * m).sum(), hits: ((r != r.clamp(0.8, 1.2)) & mask).sum()}
    elif mode == "sapo":
        x = r.clone()
        kl, _ = inputs.sapo_gate(x, x, 1.0, 1.05)
        tau = torch.full_like(adv, 1.05).masked_fill_(adv > 0, 1.0)
        assert torch.equal(x, (r - 1) * tau)
        rows = inputs.sapo(x.sigmoid_(), 4.0, 4 / 1.05)
        want = (torch.sigmoid((r - 1) * tau) * (4 / tau) * adv * m).sum(-1)
        extra = {kl: (dc * m).sum()}
    elif mode == "gspo":
        dm, _ = inputs.gspo_logratio(torch.empty_like(lp))
        assert torch.equal(dm, d * m)
        s = torch.exp(torch.clamp(dm.sum(-1) / mask.sum(-1).clamp(min=1), max=10.0))
        rows, hits = inputs.gspo(s, 0.9, 1.1)
        sc = s[:, None]
        l1, l2 = -adv * sc, -adv * sc.clamp(0.9, 1.1)
        want = -(torch.maximum(l1, l2) * m).sum(-1)
        extra = {hits: ((l2 > l1) & mask).sum()}
    else:
        rows, adv_rows, kl, pos, neg, _ = inputs.geo_mean(0.2, 0.3)
        sgn = torch.sign(adv)
        want = (sgn * torch.minimum(sgn * d, sgn * d.clamp(-0.2, 0.3)) * m).sum(-1)
        clipped = (d != d.clamp(-0.2, 0.3)) & mask
        extra = {kl: (d * m).sum(), pos: (clipped & (adv > 0)).sum(), neg: (clipped & (adv < 0)).sum()}
        assert adv_rows == pytest.approx((adv * m).sum(-1).tolist(), rel=1e-12, abs=1e-12)
    sign = -1.0 if mode == "gspo" else 1.0
    assert [sign * v for v in rows] == pytest.approx(want.tolist(), rel=1e-12, abs=1e-12)
    for got, value in extra.items():
        assert got == pytest.approx(float(value), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("kl", [None, "k1", "abs", "k2", "k3"])
@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("f64", [False, True])
def test_the_entropy_and_kl_terms_in_each_pass_are_the_aux_loops(entropy, kl, check, f64):
    # every pass that reads logp runs the aux loop's body too: the same row sums and k2 check
    t = _batch(5, 4096 + 3, torch.float64 if f64 else torch.float32, seed=1, spread=8.0, token_adv=True)
    inputs = native.Inputs({k: t[k] for k in FLOATS}, t["response_mask"].view(torch.uint8))
    e = torch.sub(t["ref_log_prob"], t["log_prob"]).clamp_(-20.0, 20.0).exp_() if kl == "k3" else None
    want = inputs.aux(entropy=entropy, kl=kl, check=check, e=e)
    r = torch.sub(t["log_prob"], t["old_log_prob"]).clamp_(-20.0, 20.0).exp_()
    passes = {
        "gpg": lambda side: inputs.gpg(side)[-1],
        "dro": lambda side: inputs.dro(0.05, side)[-1],
        "cispo": lambda side: inputs.cispo(r.clone(), 0.8, 1.2, side)[-1],
        "sapo_gate": lambda side: inputs.sapo_gate(r, torch.empty_like(r), 1.0, 1.05, side)[-1],
        "gspo_logratio": lambda side: inputs.gspo_logratio(torch.empty_like(r), side)[-1],
        "geo_mean": lambda side: inputs.geo_mean(0.2, 0.2, side)[-1],
    }
    for name, run in passes.items():
        got = run(inputs.side_terms(entropy=entropy, kl=kl, check=check, e=e))
        assert got == want, name  # the same floats summed in the same order: equal, not close


@pytest.mark.parametrize("f64", [False, True])
@pytest.mark.parametrize("width", [1, 7, 8, 9, 63])
def test_the_log_ratios_for_torchs_exp_are_torchs_sub_and_clamp(f64, width):
    t = _batch(3, width, torch.float64 if f64 else torch.float32, seed=width, spread=25.0)
    inputs = native.Inputs({k: t[k] for k in FLOATS}, t["response_mask"].view(torch.uint8))
    r, e = torch.full_like(t["log_prob"], math.nan), torch.full_like(t["log_prob"], math.nan)
    inputs.logratios(r, e)
    assert torch.equal(r, torch.sub(t["log_prob"], t["old_log_prob"]).clamp_(-20.0, 20.0))
    assert torch.equal(e, torch.sub(t["ref_log_prob"], t["log_prob"]).clamp_(-20.0, 20.0))
    assert r.abs().max() == 20.0  # the clamp was hit
    e.fill_(7.0)
    inputs.logratios(None, e)
    inputs.logratios(r, None)
    assert torch.equal(e, torch.sub(t["ref_log_prob"], t["log_prob"]).clamp_(-20.0, 20.0))


def test_the_losses_a_wrappers_refuse_buffers_the_loops_cannot_read():
    t = _batch(4, 16)
    inputs = native.Inputs({k: t[k] for k in FLOATS}, t["response_mask"].view(torch.uint8))
    for scratch in (torch.empty(4, 15), torch.empty(4, 16, dtype=torch.float64), torch.empty(16, 4).t()):
        with pytest.raises(ValueError):
            inputs.cispo(scratch, 0.8, 1.2)
        with pytest.raises(ValueError):
            inputs.sapo_gate(scratch, torch.empty(4, 16), 1.0, 1.05)
        with pytest.raises(ValueError):
            inputs.sapo_gate(None, scratch, 1.0, 1.05)
        with pytest.raises(ValueError):
            inputs.sapo(scratch, 4.0, 3.8)
        with pytest.raises(ValueError):
            inputs.gspo_logratio(scratch)
    for per_row in (torch.ones(3), torch.ones(4, dtype=torch.float64), torch.ones(8)[::2], torch.ones(4, 1)):
        with pytest.raises(ValueError):
            inputs.gspo(per_row, 0.8, 1.2)
    with pytest.raises(ValueError):
        inputs.logratios(torch.empty(4, 15), None)
    with pytest.raises(ValueError):
        inputs.logratios(None, torch.empty(4, 16, dtype=torch.float64))
    with native.exp_between_passes():
        with pytest.raises(ValueError):
            inputs.side_terms(kl="k3")  # k3 without its exp buffer, and no inline exp
        with pytest.raises(ValueError):
            inputs.cispo(None, 0.8, 1.2)
        with pytest.raises(ValueError):
            inputs.sapo_gate(None, torch.empty(4, 16), 1.0, 1.05)
    with pytest.raises(ValueError):
        inputs.side_terms(kl="k3", e=torch.empty(4, 15))
    bare = native.Inputs({k: t[k] for k in ("log_prob", "old_log_prob", "advantages")}, inputs.mask)
    for kw in ({"entropy": True}, {"kl": "k1"}, {"check": True}):
        with pytest.raises(ValueError):
            bare.side_terms(**kw)
    with pytest.raises(ValueError):
        bare.logratios(None, torch.empty(4, 16))


def _stepping(bound: float, n: int = 40) -> list[torch.Tensor]:
    """float32 values stepping one float at a time from n below ``bound`` to n above it."""
    x = torch.tensor(bound, dtype=torch.float32)
    for _ in range(n):
        x = torch.nextafter(x, torch.tensor(-100.0))
    out = []
    for _ in range(2 * n):
        out.append(x.clone())
        x = torch.nextafter(x, torch.tensor(100.0))
    return out


@pytest.mark.parametrize("mode", CLIPPING)
def test_values_on_the_clip_bounds_count_exactly_as_the_torch_ops_count_them(mode):
    lo, hi = 0.8, 1.2  # clip_ratio_low / high 0.2
    if mode == "geo_mean":  # bounds on the log-ratio itself: -0.2 and 0.2
        d = torch.stack(_stepping(-0.2) + _stepping(0.2))
    else:  # bounds on the ratio: log-ratios around log(0.8), log(1.2), ratios by torch's exp
        d = torch.stack(_stepping(math.log(lo)) + _stepping(math.log(hi)))
    n = d.numel()
    if mode == "gspo":  # one valid token per row: the sequence ratio is that token's ratio
        log_prob = torch.full((n, 3), -1.0)
        log_prob[:, 1] = d - 1.0
        mask = torch.zeros(n, 3, dtype=torch.bool)
        mask[:, 1] = True
        adv = torch.tensor([1.0, -1.0, 0.5, -2.5]).repeat(n // 4 + 1)[:n, None].expand(n, 3).contiguous()
    else:
        log_prob = d.repeat_interleave(4)[None, :] - 1.0
        mask = torch.ones_like(log_prob, dtype=torch.bool)
        adv = torch.tensor([1.0, -1.0, 0.37, -2.5]).repeat(n)[None, :]
    t = {
        "log_prob": log_prob,
        "old_log_prob": torch.full_like(log_prob, -1.0),
        "advantages": adv,
        "response_mask": mask,
    }
    compiled, ops = _both(LossConfig(loss_mode=mode), t)
    _agree(compiled, ops, 1e-6)
    assert 0 < compiled["pg_clipfrac"] < 1
    if mode == "geo_mean":
        assert 0 < compiled["pg_clipfrac_lower"] < 1


def test_gspo_sequence_ratios_exactly_on_the_lower_bound_are_not_clipped():
    # clip_ratio_low 0: the lower bound is 1, and rows with logp == old have s = exp(0) = 1 exactly
    t = _batch(6, 50, token_adv=False)
    t["old_log_prob"][:3] = t["log_prob"][:3]
    config = LossConfig(loss_mode="gspo", clip_ratio_low=0.0)
    compiled, ops = _both(config, t)
    _agree(compiled, ops, 1e-6)


@pytest.mark.parametrize("where", ["masked", "valid"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("mode", MODES)
def test_a_non_finite_value_anywhere_gives_what_the_torch_ops_give(mode, name, value, where):
    # both paths then take verl's op sequence (or, for an input the loss does not read, agree anyway)
    t = _batch(3, 20, token_adv=True)
    mask = t["response_mask"]
    i, j = (0, int((~mask[0]).nonzero()[0])) if where == "masked" else (1, int(mask[1].nonzero()[0]))
    t[name] = t[name].clone()
    t[name][i, j] = value
    compiled, ops = _both(_config(mode), t)
    _agree(compiled, ops, 1e-6)


def _outcome(config: LossConfig, t: dict) -> dict | str:
    try:
        return recompute(config, **t)
    except ValueError as exc:
        return f"ValueError: {exc}"


@pytest.mark.parametrize("mode", MODES)
def test_a_fully_masked_batch_gives_what_the_torch_ops_give(mode):
    t = _batch(3, 20)
    t["response_mask"][:] = False
    compiled = _outcome(_config(mode), t)
    with native.disabled():
        ops = _outcome(_config(mode), t)
    if isinstance(ops, str):
        assert compiled == ops
    else:
        _agree(compiled, ops, 1e-6)


@settings(max_examples=40, deadline=None)
@given(
    mode=st.sampled_from(MODES),
    rows=st.integers(1, 6),
    width=st.integers(1, 70),
    spread=st.floats(0.0, 30.0),
    low=st.floats(0.0, 0.9),
    high=st.floats(0.0, 3.0),
    tau_pos=st.floats(0.1, 5.0),
    tau_neg=st.floats(0.1, 5.0),
    seed=st.integers(0, 2**16),
    f64=st.booleans(),
    token_adv=st.booleans(),
)
def test_compiled_and_torch_ops_agree_on_random_batches(
    mode, rows, width, spread, low, high, tau_pos, tau_neg, seed, f64, token_adv
):
    # spread up to 30: log-ratios past the +-20 clamp and gspo's 10 cap; clip bounds anywhere
    t = _batch(
        rows, width, torch.float64 if f64 else torch.float32, seed=seed, spread=spread, token_adv=token_adv
    )
    config = _config(mode, clip_ratio_low=low, clip_ratio_high=high, tau_pos=tau_pos, tau_neg=tau_neg)
    compiled, ops = _both(config, t)
    _agree(compiled, ops, 1e-12 if f64 else 2e-6)


def _prefix_mask(rows: int, width: int, seed: int) -> torch.Tensor:
    """Right-padded responses (a valid prefix per row) mixed with scattered rows: chunks of EXP_CHUNK
    (512) tokens that are all valid, partly valid and all masked."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    lengths[0], lengths[-1] = width, 0
    mask = torch.arange(width)[None, :] < lengths[:, None]
    mask[1] = torch.rand(width, generator=g) < 0.1
    return mask


@pytest.mark.skipif(not native.inline_exp(), reason="torch's exp is not MKL's here: nothing is inline")
@pytest.mark.parametrize("f64", [False, True])
@pytest.mark.parametrize("width", [1, 9, 511, 512, 513, 1500, 4096 + 3])
@pytest.mark.parametrize("poison", [None, "nan_masked", "inf_masked", "nan_valid"])
def test_the_inline_exp_gives_the_passes_what_torchs_exp_buffers_give(f64, width, poison):
    # each pass with exp inline (no r / e buffers: taken per chunk, only where the chunk has valid
    # tokens) against the same pass over torch's exp of every token: the same floats, summed in the
    # same order, so equal; a non-finite input, masked or not, still makes the same sums non-finite
    t = _batch(6, width, torch.float64 if f64 else torch.float32, seed=width, spread=8.0, token_adv=True)
    t["response_mask"] = _prefix_mask(6, width, width)
    masked = (~t["response_mask"]).nonzero()
    valid = t["response_mask"].nonzero()
    if poison and (masked if poison.endswith("masked") else valid).numel():
        i, j = (masked if poison.endswith("masked") else valid)[-1].tolist()
        for name in ("old_log_prob", "ref_log_prob"):
            t[name][i, j] = math.nan if poison.startswith("nan") else math.inf
    inputs = native.Inputs({k: t[k] for k in FLOATS}, t["response_mask"].view(torch.uint8))
    r = torch.sub(t["log_prob"], t["old_log_prob"]).clamp_(-20.0, 20.0).exp_()
    e = torch.sub(t["ref_log_prob"], t["log_prob"]).clamp_(-20.0, 20.0).exp_()

    def flat(a) -> list[float]:
        if isinstance(a, (tuple, list)):
            return [x for v in a for x in flat(v)]
        if isinstance(a, torch.Tensor):
            return a.double().flatten().tolist()
        return [] if a is None else [float(a)]

    def same(a, b) -> bool:
        a, b = flat(a), flat(b)
        if poison and poison.startswith("nan"):
            # where a NaN lands may differ (a masked token's r is 0 inline); that one lands may not
            return not all(map(math.isfinite, a)) and not all(map(math.isfinite, b))
        return len(a) == len(b) and all(
            x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True)
        )

    def passes(entropy: bool, kl: str, check: bool, buffered: bool) -> dict:
        """Every losses-A pass, given torch's exp buffers (r, and e for k3) or taking exp inline."""
        side = inputs.side_terms(
            entropy=entropy, kl=kl, check=check, e=e if buffered and kl == "k3" else None
        )
        ratio = r if buffered else None
        gates = torch.empty_like(r)
        out = {
            "gpg": inputs.gpg(side),
            "dro": inputs.dro(0.05, side),
            "geo_mean": inputs.geo_mean(0.2, 0.2, side),
            "gspo_logratio": inputs.gspo_logratio(torch.empty_like(r), side),
            "cispo": inputs.cispo(ratio, 0.8, 1.2, side),
            "sapo_gate": inputs.sapo_gate(ratio, gates, 1.0, 1.05, side),
            # the shared aux loop, for the modes that take entropy / KL apart from their loss
            "aux": inputs.aux(entropy=entropy, kl=kl, check=check, e=e if buffered and kl == "k3" else None),
        }
        return out, gates

    for plan in [(True, "k3", False), (False, "k3", True), (True, "k1", False)]:
        (buffered, x1), (inline, x2) = passes(*plan, True), passes(*plan, False)
        for name in buffered:
            assert same(buffered[name], inline[name]), (name, plan)
        # the gate of a valid token is the same; a masked one reads r = 0 inline, and is never summed
        m = t["response_mask"]
        assert torch.equal(x1[m].nan_to_num(7.0), x2[m].nan_to_num(7.0))
    if not poison or poison == "inf_masked":  # and so is each mode's audit, end to end
        batch = {**{k: t[k] for k in FLOATS}, "response_mask": t["response_mask"]}
        for mode in [*MODES, "vanilla", "dppo_tv", "dppo_kl", "kl_cov", "bypass_mode"]:
            inline = recompute(_config(mode), **batch)
            with native.exp_between_passes():
                between = recompute(_config(mode), **batch)
            assert between.keys() == inline.keys(), mode
            if poison:
                # recompute's batch is sparse: vanilla's inline pass leaves the masked inf unread and
                # stays fast, the pass before torch's exp still sees it and takes verl's op sequence
                assert list(between.values()) == pytest.approx(
                    list(inline.values()), rel=1e-6, abs=1e-7, nan_ok=True
                ), mode
            else:
                assert same(list(between.values()), list(inline.values())), mode
