"""The audit's float64 passes hold little beside the batch itself: each runs in a fresh process on a
~100 MiB float32 batch and its peak resident growth (``ru_maxrss``, exact, not sampled) stays well under
the batch's size. Whole-batch float64 copies, selections and sorts peaked at 1.4-2.9x here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import gc, json, resource, sys, torch
from rlvitals.analyzers.verdicts.auditing import _batch, _on_policy_gap
from rlvitals.analyzers.verdicts.entropy_dynamics import batch_covariance
from rlvitals.analyzers.verdicts.histograms import batch_histograms
torch.manual_seed(0)
B, T = 640, 8192
t = {
    "log_prob": torch.randn(B, T) * 0.1 - 1,
    "old_log_prob": torch.randn(B, T) * 0.1 - 1,
    "advantages": torch.randn(B, 1).expand(B, T).contiguous(),
    "response_mask": (torch.rand(B, T) < 0.8).to(torch.float32),
    "entropy": torch.rand(B, T),
}
size = sum(v.numel() * v.element_size() for v in t.values())
batch = _batch(t) if sys.argv[1] == "gap" else None
gc.collect()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
{"cov": lambda: batch_covariance(t), "hist": lambda: batch_histograms(t), "gap": lambda: _on_policy_gap(batch)}[sys.argv[1]]()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"size": size, "growth": after - before}))
"""


# a fresh process and a ~100 MiB batch each: `make test-fast` measures one pass, `make test` all three
@pytest.mark.parametrize(
    "step",
    ["cov", pytest.param("hist", marks=pytest.mark.heavy), pytest.param("gap", marks=pytest.mark.heavy)],
)
def test_an_audit_pass_holds_well_under_the_batch_beside_it(step):
    out = subprocess.run([sys.executable, "-c", SCRIPT, step], capture_output=True, text=True, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    ratio = measured["growth"] / measured["size"]
    print(f"{step}: peak growth {ratio:.2f}x the batch")
    assert ratio < 0.8, ratio
