"""The compiled token passes (analyzers/csrc, analyzers/fast/native.py): in use, checked, and equal to the
torch ops they replace. Parity with verl itself runs on both paths in the parity and loss modules."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rlvitals.analyzers import LossConfig, recompute
from rlvitals.analyzers.fast import native
from rlvitals.analyzers.fast.token_batch import TokenBatch

ROOT = Path(__file__).resolve().parents[2]


def _batch(rows: int, width: int, dtype=torch.float32, seed: int = 0, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    t = {
        "log_prob": lp,
        "old_log_prob": lp + torch.randn(rows, width, generator=g, dtype=torch.float64) * spread,
        "advantages": torch.randn(rows, width, generator=g, dtype=torch.float64),
        "ref_log_prob": lp + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.2,
        "entropy": torch.rand(rows, width, generator=g, dtype=torch.float64) * 2,
    }
    t = {k: v.to(dtype) for k, v in t.items()}
    t["response_mask"] = torch.rand(rows, width, generator=g) < 0.7
    return t


def _both(config: LossConfig, t: dict) -> tuple[dict, dict]:
    compiled = recompute(config, **t)
    with native.disabled():
        ops = recompute(config, **t)
    return compiled, ops


def test_the_compiled_passes_are_built_current_and_in_use():
    # CI installs with a C compiler: the fast path must be the one the suite tests
    assert native.module() is not None, native.STATUS
    assert native.STATUS.startswith("compiled"), native.STATUS
    assert TokenBatch(**_batch(4, 32)).native is not None


def test_a_build_older_than_its_sources_is_not_used(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(ROOT / "analyzers" / "csrc", csrc)
    assert native._load(csrc)[0] is not None
    (csrc / "kernels.h").write_text((csrc / "kernels.h").read_text() + "\n/* edited */\n")
    module, status = native._load(csrc)
    assert module is None and status.startswith("stale build")


@pytest.mark.heavy
def test_rlvitals_native_0_runs_the_torch_ops():
    code = (
        "from rlvitals.analyzers import recompute, LossConfig; from rlvitals.analyzers.fast import native; import torch;"
        "from rlvitals.analyzers.fast.token_batch import TokenBatch;"
        "t = dict(log_prob=torch.zeros(2, 8), old_log_prob=torch.zeros(2, 8), advantages=torch.ones(2, 8),"
        " response_mask=torch.ones(2, 8, dtype=torch.bool));"
        "assert TokenBatch(**t).native is None;"
        "print(native.STATUS, recompute(LossConfig(), **t)['pg_loss'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "RLVITALS_NATIVE": "0"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("disabled (RLVITALS_NATIVE=0)") and out.split()[-1] == "-1.0"


@pytest.mark.parametrize(
    "bad",
    [
        lambda t: {**t, "log_prob": t["log_prob"].t().contiguous().t()},  # not contiguous
        lambda t: {**t, "advantages": t["advantages"].double()},  # another dtype
        lambda t: {**t, "entropy": t["entropy"][:, :-1]},  # another shape
        lambda t: {**t, "log_prob": t["log_prob"].half()},
    ],
)
def test_inputs_refuse_what_the_loops_cannot_read(bad):
    t = _batch(4, 16)
    mask = t.pop("response_mask").view(torch.uint8)
    with pytest.raises(ValueError):
        native.Inputs(bad(t), mask)
    with pytest.raises(ValueError):
        native.Inputs(t, mask[:, :8])  # the mask of another shape
    with pytest.raises(ValueError):
        native.Inputs(t, mask.to(torch.int32))
    inputs = native.Inputs(t, mask)
    for scratch in (torch.empty(4, 15), torch.empty(4, 16, dtype=torch.float64), torch.empty(16, 4).t()):
        with pytest.raises(ValueError):
            inputs.aux(entropy=False, kl="k3", check=False, e=scratch)


def test_a_batch_the_loops_cannot_read_in_place_is_copied_once_or_takes_the_torch_ops():
    t = _batch(4, 40)
    strided = {**t, "log_prob": torch.cat([t["log_prob"], t["log_prob"]], dim=1)[:, ::2]}
    assert TokenBatch(**strided).native is not None  # made contiguous once
    config = LossConfig(use_kl_loss=True, entropy_coeff=0.01)
    a, b = _both(config, strided)
    assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
    half = {k: (v.half() if v.is_floating_point() else v) for k, v in t.items()}
    assert TokenBatch(**half).native is None  # half precision: verl's op sequence in its dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [1, 7, 8, 9, 63, 4096 + 3])
@pytest.mark.parametrize("kl", ["low_var_kl", "kl", "abs", "mse", "low_var_kl+", "k1+"])
def test_compiled_and_torch_ops_agree_on_every_width_and_kl_estimator(dtype, width, kl):
    # widths below, at and past one vector (8 floats / 4 doubles) and a ragged tail
    t = _batch(5, width, dtype, seed=width)
    config = LossConfig(use_kl_loss=True, entropy_coeff=0.01, kl_loss_type=kl, clip_ratio_c=2.0)
    compiled, ops = _both(config, t)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert compiled.keys() == ops.keys()
    for key in compiled:
        assert compiled[key] == pytest.approx(ops[key], rel=tol, abs=tol), key
    batch = TokenBatch(**t)
    stats = batch.policy(0.2, 0.2, 2.0)
    with native.disabled():
        ref = TokenBatch(**t).policy(0.2, 0.2, 2.0)
    assert (stats.n_clipped, stats.n_dual_clipped) == (ref.n_clipped, ref.n_dual_clipped)  # exact


def test_tokens_on_the_clip_bounds_count_exactly_as_verl_counts_them():
    # log-ratios stepping float by float across log(1 - eps), log(1 + eps) and log(c), so the ratios
    # (torch's exp, as in verl) land on, just under and just over each bound
    lo, hi, c = 0.8, 1.2, 3.0
    steps = []
    for bound in (lo, hi, c):
        x = torch.tensor(math.log(bound), dtype=torch.float32)
        for _ in range(40):
            x = torch.nextafter(x, torch.tensor(-1.0))
        for _ in range(80):
            steps.append(x.clone())
            x = torch.nextafter(x, torch.tensor(9.0))
    d = torch.stack(steps)
    n = d.numel()
    adv = torch.tensor([1.0, -1.0, 0.37, -2.5]).repeat(n)[None, :]
    log_prob = d.repeat_interleave(4)[None, :] - 1.0
    t = {
        "log_prob": log_prob,
        "old_log_prob": torch.full_like(log_prob, -1.0),
        "advantages": adv,
        "response_mask": torch.ones_like(log_prob, dtype=torch.bool),
    }
    compiled, ops = _both(LossConfig(clip_ratio_c=c), t)
    # verl's compute_policy_loss_vanilla, its own ops
    ratio = torch.exp(torch.clamp(t["log_prob"] - t["old_log_prob"], -20.0, 20.0))
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, lo, hi)
    clipped = torch.maximum(l1, l2)
    lower = (torch.min(-adv * c, clipped) < clipped) & (adv < 0)
    want = float((l2 > l1).float().mean()), float(lower.float().mean())
    assert (compiled["pg_clipfrac"], compiled["pg_clipfrac_lower"]) == pytest.approx(want, abs=1e-7)
    assert (compiled["pg_clipfrac"], compiled["pg_clipfrac_lower"]) == (
        ops["pg_clipfrac"],
        ops["pg_clipfrac_lower"],
    )
    assert 0 < want[0] < 1 and want[1] > 0


@pytest.mark.parametrize("where", ["masked", "valid"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("name", ["log_prob", "old_log_prob", "advantages", "ref_log_prob", "entropy"])
def test_a_non_finite_value_anywhere_sends_both_paths_to_verls_op_sequence(where, value, name):
    t = _batch(3, 20)
    mask = t["response_mask"]
    i, j = (0, int((~mask[0]).nonzero()[0])) if where == "masked" else (1, int(mask[1].nonzero()[0]))
    t[name] = t[name].clone()
    t[name][i, j] = value
    config = LossConfig(use_kl_loss=True, entropy_coeff=0.01)
    compiled, ops = _both(config, t)
    assert compiled.keys() == ops.keys()
    for key in compiled:
        a, b = compiled[key], ops[key]
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-7), key


@pytest.mark.parametrize("shape", [(4, 0), (0, 4)])
@pytest.mark.parametrize("mode", ["vanilla", "gpg", "dro", "cispo", "sapo", "gspo", "geo_mean"])
def test_an_empty_batch_takes_the_torch_ops(shape, mode):
    # a tensor with no elements may have data_ptr 0, which the loops read as an absent tensor (its row
    # sums left unwritten): the compiled passes refuse empty inputs, and both paths give verl's values
    t = {k: v[: shape[0], : shape[1]] for k, v in _batch(4, 4).items()}
    assert TokenBatch(**t).native is None
    extra = {"dro_beta": 0.1} if mode == "dro" else {}
    config = LossConfig(
        use_kl_loss=True, entropy_coeff=0.01, kl_loss_type="low_var_kl", loss_mode=mode, **extra
    )
    compiled, ops = _both(config, t)
    assert compiled.keys() == ops.keys()
    for key in compiled:
        a, b = compiled[key], ops[key]
        assert (math.isnan(a) and math.isnan(b)) or a == b, key


def test_threads_audit_concurrently_with_their_own_buffers():
    batches = [_batch(8, 300 + 17 * i, seed=i) for i in range(4)]
    config = LossConfig(use_kl_loss=True, entropy_coeff=0.01)
    with native.disabled():
        want = [recompute(config, **t) for t in batches]
    got: dict[int, list] = {}

    def work(k: int) -> None:
        got[k] = [recompute(config, **batches[(k + n) % 4]) for n in range(12)]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for k, results in got.items():
        for n, result in enumerate(results):
            assert result == pytest.approx(want[(k + n) % 4], rel=1e-6, abs=1e-7)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    width=st.integers(1, 70),
    spread=st.floats(0.0, 30.0),
    low=st.floats(0.0, 0.9),
    high=st.floats(0.0, 3.0),
    c=st.floats(1.0, 10.0),
    seed=st.integers(0, 2**16),
    f64=st.booleans(),
)
def test_compiled_and_torch_ops_agree_on_random_batches(rows, width, spread, low, high, c, seed, f64):
    # spread up to 30: log-ratios past the +-20 clamp; clip bounds anywhere
    t = _batch(rows, width, torch.float64 if f64 else torch.float32, seed=seed, spread=spread)
    config = LossConfig(
        use_kl_loss=True,
        entropy_coeff=0.01,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=max(c, 1.0 + 1e-3),
    )
    compiled, ops = _both(config, t)
    tol = 1e-12 if f64 else 2e-6
    assert compiled.keys() == ops.keys()
    for key in compiled:  # NaN where both are NaN (an all-masked batch)
        a, b = compiled[key], ops[key]
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=tol, abs=tol), key


def test_row_counts_and_lengths_are_the_torch_ops_values():
    # verl's per-row T + 1e-8 in float32 (seq-mean modes divide by it) and the counts, from one loop
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(9, 37, generator=g) < 0.5
    mask[2] = False  # an empty row: 1e-8 in float32
    mask[5] = True
    counted = native.count_rows(mask.view(torch.uint8))
    assert counted is not None
    counts, lengths, total = counted
    want = mask.sum(dim=-1)
    assert counts == want.tolist() and total == int(want.sum())
    assert lengths == (want.to(torch.float32) + 1e-8).tolist()
    batch = TokenBatch(**{**_batch(9, 37), "response_mask": mask})
    assert (batch.n_tokens, batch.n_seqs) == (int(want.sum()), 8)
    with native.disabled():
        assert native.count_rows(mask.view(torch.uint8)) is None


@pytest.mark.parametrize("width", [1, 7, 8, 9, 15, 16, 17, 2039, 2040, 2041, 2047, 2048, 2049, 4099, 16384])
def test_row_counts_count_every_non_zero_byte_eight_at_a_time(width):
    # the loop counts 8 bytes per step in byte lanes folded every 255 words (2040 bytes): any byte value
    # (a bool tensor viewed from uint8 may hold 2..255), runs of zeros and of 0x80 / 0x7f / 0xff, widths
    # around the word and the fold, ragged tails
    g = torch.Generator().manual_seed(width)
    raw = torch.randint(0, 256, (6, width), dtype=torch.uint8, generator=g)
    raw[1] = 0
    raw[2] = 0xFF
    raw[3, ::2] = 0x80
    raw[3, 1::2] = 0
    raw[4] = torch.where(raw[4] < 200, 0, raw[4])  # sparse
    raw[5] = torch.where(raw[5] < 128, 0x7F, 0)
    counts, lengths, total = native.count_rows(raw)
    want = (raw != 0).sum(dim=-1)
    assert counts == want.tolist() and total == int(want.sum())
    assert lengths == (want.to(torch.float32) + 1e-8).tolist()


def test_inline_exp_is_torchs_exp_bit_for_bit():
    # the loops call torch's own exp (MKL's vsExp / vdExp on this build) only after this check passed
    # at import; here on other values: random log-ratios, in a ragged length
    assert native.inline_exp(), native.STATUS
    g = torch.Generator().manual_seed(11)
    for dtype, bits in ((torch.float32, torch.int32), (torch.float64, torch.int64)):
        x = (torch.randn(100_003, generator=g, dtype=torch.float64) * 7).clamp(-20, 20).to(dtype)
        got = torch.empty_like(x)
        assert native._MODULE.exp_chunks(dtype == torch.float64, x.data_ptr(), got.data_ptr(), x.numel())
        assert torch.equal(got.view(bits), torch.exp(x).view(bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [1, 7, 9, 511, 512, 513, 4096 + 3])
@pytest.mark.parametrize("kl", ["low_var_kl", "k1", "abs", "mse", "low_var_kl+", None])
def test_vanilla_with_exp_inline_equals_exp_between_passes(dtype, width, kl):
    # the one-pass loop (exp inline, in chunks of 512) and the three-pass one (exp by torch between)
    # see the same floats: equal counts, row sums equal to float64 summation order
    t = _batch(4, width, dtype, seed=width)
    t["response_mask"][1] = False  # an all-masked row: its chunks skip the exp
    t["response_mask"][2, : width // 2] = True
    if kl is None:
        del t["ref_log_prob"]
    config = LossConfig(use_kl_loss=kl is not None, entropy_coeff=0.01, kl_loss_type=kl or "low_var_kl")
    inline = TokenBatch(**t)
    stats = inline.policy(0.2, 0.28, 3.0, config=config)
    with native.exp_between_passes():
        passes = TokenBatch(**t)
        want = passes.policy(0.2, 0.28, 3.0, config=config)
        assert (stats.n_clipped, stats.n_dual_clipped) == (want.n_clipped, want.n_dual_clipped)
        assert stats.rows.rows == pytest.approx(want.rows.rows, rel=1e-12, abs=1e-12)
        assert inline.ppo_kl == pytest.approx(passes.ppo_kl, rel=1e-12, abs=1e-15)
        assert recompute(config, **t) == pytest.approx(_both(config, t)[0], rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("where", ["masked", "valid"])
@pytest.mark.parametrize("name", ["log_prob", "old_log_prob", "advantages", "ref_log_prob", "entropy"])
def test_inline_exp_sends_a_non_finite_input_to_verls_ops(where, name):
    # a NaN in a chunk the one-pass loop skips (no valid token) is still seen: by the guard sum
    t = _batch(2, 1200)
    t["response_mask"][0] = False
    t["response_mask"][1, 600:] = False
    i, j = (0, 100) if where == "masked" else (1, 10)
    t[name] = t[name].clone()
    t[name][i, j] = math.nan
    config = LossConfig(use_kl_loss=True, entropy_coeff=0.01)
    compiled, ops = _both(config, t)
    for key in compiled:
        a, b = compiled[key], ops[key]
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-7), key


_ISA_SCRIPT = r"""
import contextlib, json, sys, torch
from rlvitals.analyzers import (LossConfig, recompute, rollout_corr_metrics, rollout_correction,
                                rollout_debug_metrics)
from rlvitals.analyzers.fast import native
from rlvitals.analyzers.reference.policy_losses import LossMode

def batch(rows, width, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    mask[0] = torch.rand(width, generator=g) < 0.7
    t = {
        "log_prob": lp,
        "old_log_prob": lp + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.5,
        "advantages": torch.randn(rows, width, generator=g, dtype=torch.float64),
        "ref_log_prob": lp + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.2,
        "entropy": torch.rand(rows, width, generator=g, dtype=torch.float64) * 2,
    }
    return {**{k: v.to(dtype) for k, v in t.items()}, "response_mask": mask}

out = {"isa": native.STATUS.split(";")[0]}
for dtype in (torch.float32, torch.float64):
    for width in (13, 1027):
        t = batch(5, width, dtype, width)
        for inline in (True, False):
            ctx = native.exp_between_passes() if not inline else contextlib.nullcontext()
            with ctx:
                for mode in [m.value for m in LossMode]:
                    extra = {"dro_beta": 0.1} if mode == "dro" else {}
                    if mode == "clip_cov":
                        torch.manual_seed(0)
                    config = LossConfig(loss_mode=mode, use_kl_loss=True, entropy_coeff=0.01,
                                        kl_loss_type="low_var_kl", **extra)
                    got = recompute(config, **t)
                    out[f"{dtype} {width} {inline} {mode}"] = {k: float(v).hex() for k, v in got.items()}
                rollout = t["old_log_prob"] + 0.1
                _, _, metrics = rollout_correction(t["old_log_prob"], rollout, t["response_mask"],
                                                   rollout_is="token", rollout_rs="token_k1",
                                                   rollout_rs_threshold="0.5_2.0")
                out[f"{dtype} {width} {inline} rc"] = {k: float(v).hex() for k, v in metrics.items()}
                dbg = rollout_debug_metrics(t["old_log_prob"], rollout, t["response_mask"])
                out[f"{dtype} {width} {inline} dbg"] = {k: float(v).hex() for k, v in dbg.items()}
                mask64 = t["response_mask"].to(torch.int64)  # the mask's bytes by rc_mask
                off = rollout_corr_metrics(t["old_log_prob"], rollout - 0.05, mask64)
                out[f"{dtype} {width} {inline} off"] = {k: float(v).hex() for k, v in off.items()}
                far = rollout.clone()
                far[1, 3] += 30.0  # |d| > 20: the buffered passes, from the inline one too
                _, _, metrics = rollout_correction(t["old_log_prob"], far, mask64, rollout_is="token")
                out[f"{dtype} {width} {inline} far"] = {k: float(v).hex() for k, v in metrics.items()}
json.dump(out, sys.stdout)
"""


@pytest.mark.heavy
@pytest.mark.skipif(native.module() is None or native.module().ISA != "avx2", reason="needs the AVX2 copy")
def test_the_portable_copy_gives_the_avx2_copys_numbers_exactly():
    # the portable copy (SSE2 pairs / NEON where there is no AVX2) is what other machines run: the same
    # floats in the same order, so every metric of every mode, rollout option and debug metric is equal,
    # bit for bit, on both exp paths
    import json

    runs = {}
    for isa in ("avx2", "base"):
        env = {**os.environ, "RLVITALS_NATIVE_ISA": isa}
        proc = subprocess.run(
            [sys.executable, "-c", _ISA_SCRIPT], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[isa] = json.loads(proc.stdout)
    assert runs["avx2"].pop("isa") == "compiled (avx2)"
    assert runs["base"].pop("isa") == "compiled (base)"
    assert len(runs["avx2"]) > 50
    assert runs["base"] == runs["avx2"]
