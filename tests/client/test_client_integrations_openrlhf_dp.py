"""OpenRLHF 0.11.2 with a data-parallel size of 2: two gloo processes run its ``training_step`` with the
normalisers of its own ``iter_grad_accum_global_norm`` (token and sequence counts of each optimizer step,
all-reduced over the ranks, ``dp_size`` from the group), ``RecordingPolicyLoss`` around ``PolicyLoss``
(``openrlhf_side.py``, scenario ``dp2``; what is and is not OpenRLHF's code is described there).

Every rank's batches carry the global normalisers and audit ok; the wrapper changes nothing on either
rank; the same batch audited as one process disagrees."""

from __future__ import annotations

import json

import pytest

from tests.client.test_client_integrations_openrlhf import OPENRLHF, SCRIPT, _decode, server_audit
from tests.support.ranks import run_two_ranks
from tests.support.sideenv import ensure, rlvitals_path

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, dict]:
    python = ensure("openrlhf", OPENRLHF)
    work = tmp_path_factory.mktemp("openrlhf-dp2")
    env = {
        "PYTHONPATH": str(rlvitals_path()),
        "RLVITALS_OPENRLHF_DP": "2",
        "RLVITALS_OPENRLHF_DP_INIT": f"file://{work / 'rendezvous'}",
        "OMP_NUM_THREADS": "1",
    }
    run_two_ranks([str(python), str(SCRIPT), str(work / "rank{rank}")], env)
    return {r: json.loads((work / f"rank{r}" / "dp2.json").read_text()) for r in (0, 1)}


@pytest.mark.parametrize("setting", ["ppo", "seq_mean"])
def test_every_ranks_batches_carry_the_global_normalisers_and_audit_ok(ranks, setting):
    keyed = {}
    for r in (0, 1):
        result = ranks[r]["losses"][setting]
        assert ranks[r]["rank"] == r and result["failures"] == 0
        assert result["hooked"] == result["plain"]  # the wrapper changes nothing on this rank
        batches = [_decode(p) for p in result["batches"]]
        assert len(batches) == 2 * 8  # 2 steps x 2 epochs x 4 micro-batches, every one sent
        for tensors, meta, config, reported in batches:
            assert int(meta["rank"]) == r and config["dp_size"] % 2 == 0
            total = "batch_num_tokens" if setting == "ppo" else "global_batch_size"
            own = tensors["response_mask"].sum() if setting == "ppo" else tensors["response_mask"].shape[0]
            assert config[total] > int(own)  # the optimizer step's count over both ranks
            audit = server_audit(config, tensors, reported).to_dict()
            assert audit["ok"], audit
            keyed[(r, meta["step"], meta["micro_batch"])] = (tensors, config, reported)
    # the two ranks' models stay one model: gradients are averaged before each optimizer step
    assert ranks[0]["losses"][setting]["hooked"]["table"] == ranks[1]["losses"][setting]["hooked"]["table"]
    # the counts are all-reduced: the same on both ranks for the same micro-batch position
    for (r, step, micro), (_, config, _) in keyed.items():
        if r == 0:
            other = keyed[(1, step, micro)][1]
            assert (other["batch_num_tokens"], other["global_batch_size"]) == (
                config["batch_num_tokens"],
                config["global_batch_size"],
            )
    tensors, config, reported = keyed[(0, "1", "0")]
    single = server_audit({**config, "dp_size": config["dp_size"] // 2}, tensors, reported).to_dict()
    assert single["ok"] is False  # the same batch audited as one process disagrees
