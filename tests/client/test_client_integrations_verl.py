"""verl integration on real verl 0.9.1: (a) the registered policy loss, (b) the ``set_loss_fn`` wrapper,
(c) the tracking logger and the JSONL tail.

The module builds the shared verl side env (``tests/support/sideenv.py``, recipe ``VERL``: verl 0.9.1
``--no-deps`` + its small import-time dependencies, torch 2.13.0 CPU) and runs ``verl_side.py`` in it once:
real verl actor updates (``RayPPOTrainer._update_actor`` -> ``TrainingWorker.train_mini_batch`` ->
``train_batch`` -> ``FSDPEngine.forward_backward_batch`` -> the loss bound with ``set_loss_fn``, over 2 PPO
epochs x 2 shuffled mini-batches x 2 micro-batches) with the hooks in place, next to the same updates
without them. ``rlvitals.client.integrations.verl`` is loaded the way verl loads it
(``VERL_USE_EXTERNAL_MODULES``). The tests below then check, in the project's environment:

- the hooks change nothing in verl's training (metrics of every step and the final weights are identical);
- every batch the client sent audits ok with ``rlvitals.analyzers`` and the server's batch contract (``AuditBatch.validate`` + ``audit_batch``);
- the sampler reaches later mini-batches and epochs, where ``old_log_prob != log_prob`` and verl clips;
- ``rollout_log_probs`` travel from verl's batch to the upload; GRPO groups only when whole;
- every loss in verl's ``POLICY_LOSS_REGISTRY`` returns unchanged through the registered ``rlvitals`` loss.

What is not verl's code in those runs (see ``verl_side.py``): the model (a logit table instead of an FSDP
transformer: FSDP, peft and flash-attn are not installable here), plain SGD, one gloo process, a CPU
"platform" (verl has none), worker/trainer objects built without Ray, and inert stubs for modules verl
imports at top level but never uses on these paths. No copy of verl's code remains.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
from rlvitals.analyzers import LossConfig, audit, recompute
from rlvitals.analyzers.contract.batch import AuditBatch
from rlvitals.analyzers.verdicts.batch_audit import audit_batch
from rlvitals.client.integrations import _common
from rlvitals.client.integrations import verl as rv
from rlvitals.client.testing import FakeServer
from safetensors.torch import load, save

import rlvitals
from tests.support.sideenv import VERL, ensure, rlvitals_path

pytestmark = pytest.mark.timeout(1200)  # a cold side env build + the verl runs, on a 2-core machine

SCRIPT = Path(__file__).with_name("verl_side.py")
CALLS_PER_STEP = 8  # 2 epochs x 2 mini-batches x 2 micro-batches (verl_side.py)
LOSS_NAMES = ("log_prob", "old_log_prob", "advantages", "response_mask", "ref_log_prob", "entropy")


def server_audit(config, tensors, reported):
    """What the server does with an upload: the batch contract validates it, then audits it."""
    return audit_batch(AuditBatch.validate(tensors, config=config, reported=reported))


@pytest.fixture(scope="module")
def side(tmp_path_factory) -> dict:
    python = ensure("verl", VERL)
    out = tmp_path_factory.mktemp("verl-side")
    env = {
        **os.environ,
        "PYTHONPATH": str(rlvitals_path()),
        "VERL_USE_EXTERNAL_MODULES": "rlvitals.client.integrations.verl",
    }
    proc = subprocess.run(
        [str(python), str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    return {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}


def _decode(payload_hex: str) -> tuple[dict[str, torch.Tensor], dict, dict, dict]:
    payload = bytes.fromhex(payload_hex)
    header = json.loads(payload[8 : 8 + int.from_bytes(payload[:8], "little")])
    meta = header["__metadata__"]
    return load(payload), meta, json.loads(meta["config"]), json.loads(meta["reported"])


def _recomputed(tensors: dict, config: dict) -> dict:
    return recompute(LossConfig.from_verl(config), **{k: tensors[k] for k in LOSS_NAMES if k in tensors})


# ------------------------------------------------------------------------------------------- loading


def test_verl_loads_the_integration_through_verl_use_external_modules(side):
    assert side["meta"] == {"verl": "0.9.1", "registered": True}


# ------------------------------------------------------------------------- (b) the set_loss_fn wrapper


def test_set_loss_fn_wrapper_changes_nothing_in_verls_training(side):
    result = side["set_loss_fn"]
    assert result["failures"] == 0
    assert [s["metrics"] for s in result["hooked"]["steps"]] == [
        s["metrics"] for s in result["plain"]["steps"]
    ]
    assert result["hooked"]["table"] == result["plain"]["table"]  # the weights after 6 updates: bit-identical
    assert (
        len(result["plain"]["steps"]) == 6
        and result["plain"]["steps"][-1]["metrics"]["actor/pg_clipfrac"] > 0
    )


def test_set_loss_fn_batches_audit_ok_against_what_verl_reported(side):
    batches = [_decode(p) for p in side["set_loss_fn"]["batches"]]
    assert len(batches) == 6  # batch_every=1: one micro-batch per step
    for tensors, _, config, reported in batches:
        again = _recomputed(tensors, config)
        assert again["policy_loss"] == pytest.approx(reported["policy_loss"], rel=1e-5, abs=1e-6)
        assert again["pg_loss"] == pytest.approx(reported["actor/pg_loss"], rel=1e-5, abs=1e-6)
        assert again["pg_clipfrac"] == pytest.approx(reported["actor/pg_clipfrac"], abs=1e-6)
        assert again["pg_clipfrac_lower"] == pytest.approx(reported["actor/pg_clipfrac_lower"], abs=1e-6)
        assert again["ppo_kl"] == pytest.approx(reported["actor/ppo_kl"], rel=1e-5, abs=1e-6)
        assert again["kl_loss"] == pytest.approx(reported["kl_loss"], rel=1e-5, abs=1e-6)
        assert again["entropy_loss"] == pytest.approx(reported["actor/entropy_loss"], rel=1e-5)
        assert config["batch_num_tokens"] > int(tensors["response_mask"].sum())  # the mini-batch's, from verl
        result = server_audit(config, tensors, reported).to_dict()  # what the server does with the upload
        assert result["ok"], result


@pytest.mark.parametrize(
    "mode", ["token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]
)
def test_every_loss_agg_mode_and_kl_estimator_audits_ok_on_the_real_update(side, mode):
    result = side["agg_modes"][mode]
    assert result["failures"] == 0
    batches = [_decode(p) for p in result["batches"]]
    assert len(batches) == CALLS_PER_STEP
    for tensors, _, config, reported in batches:
        assert config["loss_agg_mode"] == mode
        again = _recomputed(tensors, config)
        assert again["policy_loss"] == pytest.approx(reported["policy_loss"], rel=1e-5, abs=1e-6)
        assert again["kl_loss"] == pytest.approx(reported["kl_loss"], rel=1e-5, abs=1e-6)
        assert server_audit(config, tensors, reported).ok


def test_rollout_is_weights_travel_with_the_batch_and_the_weighted_loss_is_audited(side):
    result = side["is_weights"]
    assert result["warnings"] == []
    batches = [_decode(p) for p in result["batches"]]
    assert len(batches) == CALLS_PER_STEP
    for tensors, _, config, reported in batches:
        assert {"actor/pg_loss", "policy_loss", "actor/pg_clipfrac", "kl_loss"} <= set(reported)
        assert config["algorithm"]["rollout_correction"]["rollout_is"] == "token"
        result = server_audit(config, tensors, reported).result
        assert result["ok"] and result["rollout"]["sent_weights"]["ok"], result["explanation"]
        assert result["verdicts"]["pg_loss"]["ok"]  # verl's weighted pg_loss, recomputed with the weights
        unweighted = {k: v for k, v in tensors.items() if k != "rollout_is_weights"}
        no_config = {k: v for k, v in config.items() if k != "algorithm"}
        bad = server_audit(
            no_config, unweighted, reported
        ).result  # weights applied, neither sent nor configured
        assert not bad["ok"] and not bad["verdicts"]["pg_loss"]["ok"]


def test_tampered_report_from_real_verl_is_flagged(side):
    tensors, _, config, reported = _decode(side["set_loss_fn"]["batches"][3])
    report = audit(
        LossConfig.from_verl(config), tensors, {**reported, "actor/pg_loss": 2 * reported["actor/pg_loss"]}
    )
    assert not report.ok


def test_audits_rotate_into_later_mini_batches_and_epochs_where_verl_clips(side):
    batches = [_decode(p) for p in side["set_loss_fn"]["batches"]]
    positions = [int(meta["micro_batch"]) for _, meta, _, _ in batches]
    assert positions == [0, 1, 2, 3, 4, 5]  # epoch 0: mini-batch 0 (0, 1), 1 (2, 3); epoch 1: mini-batch 0
    ratio_one = []
    for tensors, _, _, reported in batches:
        mask = tensors["response_mask"].bool()
        ratio_one.append(torch.equal(tensors["log_prob"][mask], tensors["old_log_prob"][mask]))
        if not ratio_one[-1]:
            assert reported["actor/ppo_kl"] != 0
    # before the first optimizer step (mini-batch 0 of epoch 0) the policy is the rollout's: ratio 1
    assert ratio_one == [True, True, False, False, False, False]
    clip = {int(meta["micro_batch"]): reported["actor/pg_clipfrac"] for _, meta, _, reported in batches}
    assert clip[0] == clip[1] == 0.0
    assert clip[4] > 0 and clip[5] > 0  # epoch 1: clipping, seen by the audit (checked exact above)


def test_rollout_log_probs_reach_the_upload(side):
    rollouts = side["set_loss_fn"]["hooked"]["rollouts"]
    for tensors, meta, _, _ in (_decode(p) for p in side["set_loss_fn"]["batches"]):
        step = rollouts[int(meta["step"]) - 1]
        rows = {
            tuple(old): rollout
            for old, rollout in zip(step["old_log_probs"], step["rollout_log_probs"], strict=True)
        }
        sent = tensors["rollout_log_probs"]
        assert sent.shape == tensors["old_log_prob"].shape
        for old, rollout in zip(tensors["old_log_prob"].tolist(), sent.tolist(), strict=True):
            assert rollout == rows[tuple(old)]  # the row verl's batch held, after verl's shuffle
        assert not torch.equal(sent, tensors["old_log_prob"])


def test_grpo_groups_are_sent_only_whole(side):
    for tensors, _, _, _ in (_decode(p) for p in side["set_loss_fn"]["batches"]):
        assert "group_index" not in tensors  # 2-row micro-batches of 4-response groups, shuffled
        assert "token_level_rewards" in tensors
    whole = [_decode(p) for p in side["groups"]["batches"]]
    assert len(whole) == 4  # 2 epochs x 2 mini-batches, one micro-batch each, all sampled
    for tensors, _, config, reported in whole:
        assert len(set(tensors["group_index"].tolist())) == 1
        audited = server_audit(config, tensors, reported)
        result, groups = audited.to_dict(), audited.groups
        assert result["ok"] and result["advantages"]["ok"], result
        assert groups is not None


def test_a_recording_failure_never_reaches_verl(side):
    result = side["broken"]
    assert result["hooked"]["table"] == result["plain"]["table"]
    assert result["failures"] == CALLS_PER_STEP
    assert result["warnings"] == [
        "rlvitals: recording a verl micro-batch failed: OSError: disk full; "
        "training continues, further failures are counted silently"
    ]


# -------------------------------------------------------------------- (a) the registered policy loss


def test_registered_loss_inside_verls_own_ppo_loss_changes_nothing_and_audits_ok(side):
    result = side["registered"]
    assert result["failures"] == 0
    assert result["hooked"]["table"] == result["plain"]["table"]
    assert [s["metrics"] for s in result["hooked"]["steps"]] == [
        s["metrics"] for s in result["plain"]["steps"]
    ]
    batches = [_decode(p) for p in result["batches"]]
    assert [int(m["micro_batch"]) for _, m, _, _ in batches] == [0, 1, 2]
    for tensors, _, config, reported in batches:
        assert set(tensors) == {"log_prob", "old_log_prob", "advantages", "response_mask"}
        again = _recomputed(tensors, config)
        assert again["pg_loss"] == pytest.approx(reported["actor/pg_loss"], rel=1e-5, abs=1e-6)
        assert again["pg_clipfrac"] == pytest.approx(reported["actor/pg_clipfrac"], abs=1e-6)
        assert again["ppo_kl"] == pytest.approx(reported["actor/ppo_kl"], rel=1e-5, abs=1e-6)
        assert server_audit(config, tensors, reported).ok


def test_both_hooks_send_one_batch_per_micro_batch(side):
    batches = [_decode(p) for p in side["both"]["batches"]]
    assert len(batches) == side["both"]["calls"]  # the inner registered loss stayed silent
    assert all("policy_loss" in reported for _, _, _, reported in batches)  # every one from (b)


def test_every_registered_verl_loss_returns_unchanged_through_the_rlvitals_loss(side):
    modes = side["delegates"]["modes"]
    assert set(modes) >= {"vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo"}
    for mode, result in modes.items():
        assert "verl_error" not in result, (mode, result)
        assert result["same_loss"] and result["same_metrics"], mode
        if result["batches"]:  # the mode travels as verl names it, with the actor's settings: audits ok
            [payload] = result["batches"]
            tensors, _, config, reported = _decode(payload)
            assert config.get("loss_mode") == mode
            # SAPO's temperatures live in the actor section, not policy_loss (the scenario sets them off
            # their defaults, so a mapping that drops them gives a pg_loss mismatch here)
            assert (config["tau_pos"], config["tau_neg"]) == (1.5, 2.5)
            audited = server_audit(config, tensors, reported)
            assert audited.ok, (mode, audited.result["explanation"])
        else:  # analyzers that cannot audit it yet refuse the batch, once, naming the mode
            assert len(result["warnings"]) == 1 and f"got {mode!r}" in result["warnings"][0], result


# ------------------------------------------------------------------------------- (c) tracking, tail


def test_tracking_logger_inside_verls_tracking(side):
    result = side["tracking"]
    for name, series in result["series"].items():
        assert series == {str(s["step"]): s["metrics"][name] for s in result["steps"]}, name
    lines = [json.loads(line) for line in result["file_lines"]]  # verl's own file backend, same run
    assert [line["data"]["actor/pg_clipfrac"] for line in lines] == [
        s["metrics"]["actor/pg_clipfrac"] for s in result["steps"]
    ]


def test_tailer_follows_verl_file_logger_lines(side, tmp_path):
    server = FakeServer()
    run = rlvitals.init(project="verl", name="tail", transport=server.transport, spool_dir=tmp_path / "s")
    path = tmp_path / "exp.jsonl"
    lines = side["tracking"]["file_lines"]
    path.write_text(lines[0] + "\n" + lines[1][:10])  # second line still being written
    tailer = rv.JsonlTailer(path, run, interval=0.05)
    assert tailer.poll() == 1
    path.write_text(lines[0] + "\n" + lines[1] + "\n" + "{not json\n" + lines[2] + "\n")
    assert tailer.poll() == 2 and tailer.skipped == 1
    path.write_text(lines[0] + "\n")  # verl reopened the file with "wb": start over
    assert tailer.poll() == 1
    run.finish(timeout=5)
    want = {s["step"]: s["metrics"]["actor/ppo_kl"] for s in side["tracking"]["steps"]}
    assert server.series(run.id, "actor/ppo_kl") == pytest.approx(want)


def test_tailer_thread_and_env_path(side, tmp_path, monkeypatch):
    server = FakeServer()
    run = rlvitals.init(project="verl", name="tail2", transport=server.transport, spool_dir=tmp_path / "s")
    path = tmp_path / "exp.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    tailer = rv.JsonlTailer(run=run, interval=0.02).start()
    path.write_text("\n".join(side["tracking"]["file_lines"]) + "\n")
    assert tailer.stop() == 3
    run.finish(timeout=5)
    assert sorted(server.series(run.id, "actor/pg_clipfrac")) == [1, 2, 3]


def test_read_verl_jsonl_names_the_bad_line(side, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(side["tracking"]["file_lines"][0] + '\n{"step": -1, "data": {}}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: step must be an int >= 0"):
        list(rv.read_verl_jsonl(path))


def test_tracking_logger_config_and_text_values(tmp_path):
    server = FakeServer()
    run = rlvitals.init(project="verl", name="trk", transport=server.transport, spool_dir=tmp_path / "s")
    logger = rv.VerlTrackingLogger(
        "verl", "trk", {"actor_rollout_ref": {"actor": {"ppo_epochs": 1}}}, run=run
    )
    logger.log(data={"actor/pg_clipfrac": 0.2, "timing/gen": 1.5, "note": "x"}, step=7)
    logger.finish()
    assert server.series(run.id, "actor/pg_clipfrac") == {7: 0.2}
    assert server.series(run.id, "note") == {}


# ------------------------------------------------------------------------------- the step clock


def test_step_clock_precedence():
    now = [0.0]
    clock = _common.StepClock(gap_s=5.0, clock=lambda: now[0])
    assert [clock.tick() for _ in range(3)] == [1, 1, 1]
    now[0] = 10.0  # a rollout-long pause
    assert clock.tick() == 2
    assert clock.tick(new_step=True) == 3
    clock.set(42)
    now[0] = 100.0
    assert clock.tick() == 42 and clock.tick(new_step=True) == 42
    counted = _common.StepClock(calls_per_step=2)
    assert [counted.tick() for _ in range(5)] == [1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="calls_per_step"):
        _common.StepClock(calls_per_step=0)


def test_bad_step_settings_in_the_environment_are_ignored_with_a_warning(monkeypatch):
    monkeypatch.setenv(rv.ENV_CALLS_PER_STEP, "four")
    with pytest.warns(rv.RecordingError, match="ignoring RLVITALS_VERL_CALLS_PER_STEP='four'"):
        clock = rv._clock_from_env()
    assert clock.calls_per_step is None
    monkeypatch.setenv(rv.ENV_CALLS_PER_STEP, "4")
    assert rv._clock_from_env().calls_per_step == 4


def test_last_mini_batch_flag_flip_starts_a_step():
    recorder = rv._Recorder()
    flags = [False, False, True, True, False, True, False]
    assert [recorder.boundary(f) for f in flags] == [False, False, False, False, True, False, True]


# --------------------------------------- rollout correction and distillation, through a real server


def _upload_all(server, payloads: list[bytes]) -> list[dict]:
    """POST each payload to a real ``rlvitals serve`` and wait for its audit."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        run_id = client.post("/api/v1/runs", json={"project": "verl-side", "name": "uploads"}).json()["id"]
        ids = []
        for body in payloads:
            response = client.post(
                f"/api/v1/runs/{run_id}/batches", content=body,
                headers={"content-type": "application/octet-stream"},
            )  # fmt: skip
            assert response.status_code == 202, response.text
            ids.append(response.json()["id"])
        audits = []
        for audit_id in ids:
            deadline = time.monotonic() + 60
            while True:
                audit = client.get(f"/api/v1/audits/{audit_id}").json()
                if audit["status"] != "pending" or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert audit["status"] == "done", audit
            audits.append(audit)
    return audits


def _retold(payload_hex: str, **reported) -> bytes:
    """The payload with some reported values replaced (a tampered report of the same tensors)."""
    tensors, meta, _, old = _decode(payload_hex)
    record_id = f"{meta['record_id']}-{os.urandom(3).hex()}"  # another upload, not a resend of this one
    return save(tensors, {**meta, "reported": json.dumps({**old, **reported}), "record_id": record_id})


def test_verls_rollout_correction_through_the_hooks_audits_ok_on_a_real_server(side, serve):
    result = side["rollout_correction"]
    assert result["failures"] == 0
    assert result["hooked"]["table"] == result["plain"]["table"]  # the hooks changed nothing in training
    assert [s["metrics"] for s in result["hooked"]["steps"]] == [
        s["metrics"] for s in result["plain"]["steps"]
    ]
    decoded = [_decode(p) for p in result["batches"]]
    driver = [
        i for i, (_, _, _, reported) in enumerate(decoded) if "rollout_corr/rollout_is_mean" in reported
    ]
    assert (
        len(driver) == 2 and len(decoded) == 2 + 2 * CALLS_PER_STEP
    )  # one whole batch per step + micro-batches
    audits = _upload_all(serve(), [bytes.fromhex(p) for p in result["batches"]])
    for i, got in enumerate(audits):
        assert got["ok"] is True, got["explanation"]
        rollout = got["rollout"]
        assert rollout["ok"] is True and rollout["sent_weights"]["ok"] is True
        assert rollout["config"] == result["config"]
        if i in driver:  # verl's own rollout_corr/* numbers for the whole batch, every one recomputed
            reported = decoded[i][3]
            names = {k for k in reported if k.startswith("rollout_corr/")}
            assert set(rollout["verdicts"]) == names and len(names) > 20
            assert rollout["rejected_tokens"] > 0  # verl's token_k1 rejection, reproduced
            step = result["hooked"]["steps"][int(got["step"]) - 1]["metrics"]
            assert all(step[k] == pytest.approx(reported[k]) for k in names)  # what verl logged that step
        else:  # the actor's micro-batch: weighted loss on the mask after rejection
            assert got["verdicts"]["pg_loss"]["ok"] and got["verdicts"]["policy_loss"]["ok"]


def test_a_tampered_rollout_corr_value_from_real_verl_is_flagged_with_the_reason(side, serve):
    result = side["rollout_correction"]
    payload = next(p for p in result["batches"] if "rollout_corr/rollout_is_mean" in _decode(p)[3])
    honest = _decode(payload)[3]
    bodies = [
        _retold(payload, **{"rollout_corr/rollout_is_mean": honest["rollout_corr/rollout_is_mean"] * 1.1}),
        _retold(payload, **{"rollout_corr/rollout_rs_masked_fraction": 0.0}),
    ]
    first, second = _upload_all(serve(), bodies)
    assert (
        first["ok"] is False and first["rollout"]["verdicts"]["rollout_corr/rollout_is_mean"]["ok"] is False
    )
    assert "Rollout correction mismatch: rollout_corr/rollout_is_mean reported" in first["explanation"]
    assert (
        second["ok"] is False and "rollout_corr/rollout_rs_masked_fraction reported" in second["explanation"]
    )


def test_a_micro_batch_weighted_with_other_weights_is_flagged(side):
    result = side["rollout_correction"]
    payload = next(p for p in result["batches"] if "policy_loss" in _decode(p)[3])
    tensors, _, config, reported = _decode(payload)
    mask = tensors["response_mask"].bool()
    untruncated = (tensors["old_log_prob"] - tensors["rollout_log_probs"]).exp() * mask  # TIS forgotten
    bad = server_audit(config, {**tensors, "rollout_is_weights": untruncated}, reported).result
    assert bad["ok"] is False and "rollout_is_weights differ" in bad["explanation"]


@pytest.mark.parametrize("name", ["pg", "supervised"])
def test_verls_distillation_ppo_loss_through_the_hook_audits_ok_on_a_real_server(side, serve, name):
    result = side["distillation"][name]
    assert result["failures"] == 0
    assert result["hooked"]["table"] == result["plain"]["table"]
    assert [s["metrics"] for s in result["hooked"]["steps"]] == [
        s["metrics"] for s in result["plain"]["steps"]
    ]
    decoded = [_decode(p) for p in result["batches"]]
    assert len(decoded) == 2 * CALLS_PER_STEP
    for tensors, _, config, _ in decoded:
        assert (
            "teacher_log_probs" in tensors and tensors["teacher_log_probs"].shape == tensors["log_prob"].shape
        )
        assert config["distillation"]["distillation_loss"]["loss_mode"] == ("k3" if name == "pg" else "k2")
    audits = _upload_all(serve(), [bytes.fromhex(p) for p in result["batches"]])
    for got in audits:
        assert got["ok"] is True, got["explanation"]
        distilled = got["distillation"]
        assert (
            distilled["ok"] is True and distilled["verdicts"]["policy_loss"]["ok"]
        )  # PPO + coef * distillation
        expected = {
            "distillation/loss",
            "distillation/abs_loss",
            "distillation/loss_min",
            "distillation/loss_max",
        }
        if name == "pg":
            expected |= {"distillation/pg_clipfrac", "distillation/ppo_kl", "distillation/pg_clipfrac_lower"}
        assert expected | {"policy_loss"} == set(distilled["verdicts"])
        assert {"pg_loss", "pg_clipfrac", "ppo_kl"} <= set(got["verdicts"])  # the PPO part, as usual


def test_a_tampered_distillation_report_from_real_verl_is_flagged_with_the_reason(side, serve):
    payload = side["distillation"]["pg"]["batches"][5]
    honest = _decode(payload)[3]
    bad_loss, bad_total = _upload_all(
        serve(),
        [
            _retold(payload, **{"distillation/loss": honest["distillation/loss"] + 0.5}),
            _retold(payload, policy_loss=honest["policy_loss"] - 0.5 * honest["distillation/loss"] - 0.1),
        ],
    )
    assert (
        bad_loss["ok"] is False
        and "Distillation mismatch: distillation/loss reported" in bad_loss["explanation"]
    )
    assert bad_total["ok"] is False and bad_total["distillation"]["verdicts"]["policy_loss"]["ok"] is False
    assert all(v["ok"] for v in bad_total["verdicts"].values())  # the PPO metrics themselves agree
