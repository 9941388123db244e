"""verl 0.9.1 with a data-parallel size of 2: two gloo processes run verl's actor update
(``RayPPOTrainer._update_actor`` -> each rank's chunk of the batch, as verl's worker group dispatches it ->
``TrainingWorker.train_mini_batch`` -> ``FSDPEngine.forward_backward_batch``, which all-reduces the token
count over the ranks and sets ``dp_size``) with the ``set_loss_fn`` hook in place (``verl_side.py``,
scenario ``dp2``; the model and what is not verl's code are described there).

Every rank's batches carry the global normalisers verl used on that rank and audit ok; the hook changes
nothing in either rank's training; an audit told ``dp_size=1`` disagrees (the normalisers matter)."""

from __future__ import annotations

import json

import pytest

from tests.client.test_client_integrations_verl import SCRIPT, _decode, _recomputed, server_audit
from tests.support.ranks import run_two_ranks
from tests.support.sideenv import VERL, ensure, rlvitals_path

pytestmark = pytest.mark.timeout(1200)

MODES = ("token-mean", "seq-mean-token-sum")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, dict]:
    python = ensure("verl", VERL)
    work = tmp_path_factory.mktemp("verl-dp2")
    env = {
        "PYTHONPATH": str(rlvitals_path()),
        "VERL_USE_EXTERNAL_MODULES": "rlvitals.client.integrations.verl",
        "RLVITALS_VERL_DP": "2",
        "RLVITALS_VERL_DP_INIT": f"file://{work / 'rendezvous'}",
        "OMP_NUM_THREADS": "1",
    }
    run_two_ranks([str(python), str(SCRIPT), str(work / "rank{rank}"), "dp2"], env)
    return {r: json.loads((work / f"rank{r}" / "dp2.json").read_text()) for r in (0, 1)}


def test_two_ranks_trained_one_synchronised_model_and_the_hook_changed_nothing(ranks):
    assert [ranks[r]["rank"] for r in (0, 1)] == [0, 1]
    for mode in MODES:
        for r in (0, 1):
            result = ranks[r]["modes"][mode]
            assert result["failures"] == 0
            assert [s["metrics"] for s in result["hooked"]["steps"]] == [
                s["metrics"] for s in result["plain"]["steps"]
            ]
            assert result["hooked"]["table"] == result["plain"]["table"]
        # gradients were averaged over the ranks: both hold the same weights after the updates
        assert ranks[0]["modes"][mode]["hooked"]["table"] == ranks[1]["modes"][mode]["hooked"]["table"]


@pytest.mark.parametrize("mode", MODES)
def test_every_ranks_batches_carry_the_global_normalisers_and_audit_ok(ranks, mode):
    by_rank = {r: [_decode(p) for p in ranks[r]["modes"][mode]["batches"]] for r in (0, 1)}
    keyed = {}
    for r, batches in by_rank.items():
        # 2 steps x 2 epochs x 2 mini-batches; a rank holds 2 rows of each 4-row mini-batch: one micro-batch
        assert len(batches) == 2 * 4
        for tensors, meta, config, reported in batches:
            assert int(meta["rank"]) == r
            assert config["dp_size"] == 2
            assert config["global_batch_size"] == 4  # ppo_mini_batch_size x rollout.n, over both ranks
            assert config["loss_agg_mode"] == mode
            # the mini-batch's token count over BOTH ranks: more than this rank's micro-batch holds
            assert config["batch_num_tokens"] > int(tensors["response_mask"].sum())
            again = _recomputed(tensors, config)
            assert again["pg_loss"] == pytest.approx(reported["actor/pg_loss"], rel=1e-5, abs=1e-6)
            assert again["policy_loss"] == pytest.approx(reported["policy_loss"], rel=1e-5, abs=1e-6)
            result = server_audit(config, tensors, reported).to_dict()
            assert result["ok"], result
            keyed[(r, meta["step"], meta["micro_batch"])] = (tensors, config, reported)
    # a rank's mini-batch count is all-reduced: the same on both ranks for the same micro-batch position
    for (r, step, micro), (_, config, _) in keyed.items():
        if r == 0:
            assert keyed[(1, step, micro)][1]["batch_num_tokens"] == config["batch_num_tokens"]
    # the normalisers matter: the same batch audited as if it were one process disagrees
    tensors, config, reported = keyed[(0, *next((s, m) for (r, s, m) in keyed if r == 0))]
    single = server_audit({**config, "dp_size": 1}, tensors, reported).to_dict()
    assert single["ok"] is False
