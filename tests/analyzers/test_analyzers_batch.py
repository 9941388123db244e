"""The batch contract (``rlvitals.analyzers.contract.batch``): one rule table, one validation, one config parse,
one decode of ``reported``, one ``audit_batch`` — and every caller (client capture, server upload,
audit worker, dashboard histograms) goes through it."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rlvitals.analyzers import LossConfig, audit, group_diagnostics, recompute
from rlvitals.analyzers.contract import batch_rules
from rlvitals.analyzers.contract.batch import (
    AuditBatch,
    BatchError,
    CheckedTensors,
    CheckedUpload,
    ConfigError,
    ParsedBatch,
    TensorLayout,
    TooManyTokens,
    check_tensors,
    parse_config,
)
from rlvitals.analyzers.reference.trl import TrlLossConfig
from rlvitals.analyzers.verdicts.algorithm import AlgorithmConfig
from rlvitals.analyzers.verdicts.batch_audit import audit_batch
from rlvitals.analyzers.verdicts.histograms import batch_histograms

ROOT = Path(__file__).resolve().parents[2]


def _tensors(b: int = 4, t: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(b, t, generator=g, dtype=torch.float64) * 0.1 - 1.0
    return {
        "log_prob": old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.05,
        "old_log_prob": old,
        "advantages": torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).contiguous(),
        "response_mask": (torch.rand(b, t, generator=g) > 0.2).to(torch.int64),
    }


def _reported(tensors, config: LossConfig) -> dict[str, float]:
    return {k: float(v) for k, v in recompute(config, **tensors).items()}


# --- the rule table -------------------------------------------------------------------------------


def test_rule_table_is_pure_python_and_every_part_reads_it():
    code = "import sys, rlvitals.analyzers.contract.batch_rules; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
    from rlvitals.client import capture
    from rlvitals.service import batches, encoding

    assert capture.ALL_NAMES == batches.ALLOWED == batch_rules.ALLOWED
    assert capture.REQUIRED == batches.REQUIRED == batch_rules.REQUIRED
    assert encoding.NON_FINITE_STRINGS is batch_rules.NON_FINITE


def test_the_non_finite_spelling_is_written_once():
    """The decoding table {"NaN": nan, "Infinity": inf, "-Infinity": -inf} lives in batch_rules only
    (telemetry's map to Prometheus' spelling, string to string, is another table)."""
    found = []
    for folder in ("analyzers", "client", "service"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                keys = (
                    {k.value for k in node.keys if isinstance(k, ast.Constant)}
                    if isinstance(node, ast.Dict)
                    else set()
                )
                to_strings = all(
                    isinstance(v, ast.Constant) and isinstance(v.value, str)
                    for v in getattr(node, "values", [])
                )
                if keys >= {"NaN", "Infinity", "-Infinity"} and not to_strings:
                    found.append(str(path.relative_to(ROOT)))
    assert found == ["analyzers/contract/batch_rules.py"], found


def test_spell_and_decode_invert_each_other():
    for value in (math.nan, math.inf, -math.inf, 1.5, 0.0):
        back = batch_rules.decode(batch_rules.spell(value))
        assert back == value or (math.isnan(back) and math.isnan(value))
    assert batch_rules.decode(None) is None
    with pytest.raises(KeyError):
        batch_rules.decode("nan")


def test_reported_is_decoded_once_with_the_servers_message():
    decoded = batch_rules.decode_reported({"a": 1, "b": "NaN", "c": "-Infinity", "d": None})
    assert decoded["a"] == 1.0 and math.isnan(decoded["b"]) and decoded["c"] == -math.inf
    assert decoded["d"] is None
    with pytest.raises(ValueError, match=r"reported\['x'\] must be a number, null, 'NaN'"):
        batch_rules.decode_reported({"x": True})


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.update(extra=torch.zeros(4, 16)), "unknown tensor(s) ['extra']"),
        (lambda t: t.pop("advantages"), "missing required tensor(s) ['advantages']"),
        (lambda t: t.update(entropy=torch.zeros(4, 15)), "entropy has shape [4, 15]"),
        (
            lambda t: t.update(entropy=torch.zeros(4, 16, dtype=torch.int64)),
            "entropy must be a floating-point",
        ),
        (lambda t: t.update(response_mask=torch.full((4, 16), 2)), "response_mask must contain only 0 and 1"),
        (lambda t: t.update(group_index=torch.zeros(4, dtype=torch.int32)), "group_index must be int64"),
        (
            lambda t: t.update(group_index=torch.zeros(4, dtype=torch.int64)),
            "group_index needs token_level_rewards",
        ),
    ],
)
def test_validation_names_what_is_wrong(change, message):
    tensors = _tensors()
    change(tensors)
    with pytest.raises(BatchError) as caught:
        AuditBatch.validate(tensors)
    assert message in str(caught.value)


def test_too_many_tokens_is_its_own_error_with_the_limit():
    with pytest.raises(TooManyTokens) as caught:
        check_tensors(_tensors(), max_tokens=63)
    assert caught.value.detail == {"tokens": 64, "limit": 63}


def test_the_config_is_parsed_once_into_the_right_trainers_config():
    loss, algorithm = parse_config({"clip_ratio": 0.3, "algorithm": {"adv_estimator": "rloo"}})
    assert isinstance(loss, LossConfig) and loss.clip_ratio == 0.3
    assert algorithm == AlgorithmConfig(adv_estimator="rloo")
    trl, _ = parse_config({"trainer": "trl", "loss_type": "grpo"})
    assert isinstance(trl, TrlLossConfig)
    with pytest.raises(ConfigError) as bad_loss:
        parse_config({"clip_ratio_c": 0.5})
    assert bad_loss.value.section == "loss"
    with pytest.raises(ConfigError) as bad_algorithm:
        parse_config({"algorithm": {"gamma": "x"}})
    assert bad_algorithm.value.section == "algorithm"


def test_validate_checks_once_and_stored_trusts_the_upload():
    tensors = _tensors()
    batch = AuditBatch.validate(tensors, config={"clip_ratio": 0.2}, reported={"pg_loss": "NaN"})
    assert batch.shape == (4, 16) and math.isnan(batch.reported["pg_loss"])
    assert isinstance(batch.loss, LossConfig)
    # a stored batch was validated at upload: its tensors are not checked again (only parsed config)
    odd = {**tensors, "response_mask": torch.full((4, 16), 2)}
    assert AuditBatch.stored(odd, config={}).shape == (4, 16)


def test_the_upload_check_and_the_audit_batch_hold_one_parse():
    """The server's torch-free ``CheckedUpload`` and the audit's ``AuditBatch`` are one ``ParsedBatch``
    (config, loss, algorithm, reported, shape, distillation), the audit's with its tensors besides."""
    tensors = _tensors()
    config = {"clip_ratio": 0.2, "distillation": {"enabled": True, "loss_mode": "k3"}}
    reported = {"pg_loss": "NaN", "pg_clipfrac": 0.1}
    layout = {
        name: TensorLayout(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors.items()
    }
    upload = CheckedUpload.validate(layout, mask_outliers=lambda: None, config=config, reported=reported)
    batch = AuditBatch.validate(tensors, config=config, reported=reported)
    stored = AuditBatch.stored(tensors, config=config, reported=reported)
    parsed = [f.name for f in dataclasses.fields(ParsedBatch)]
    assert [f.name for f in dataclasses.fields(AuditBatch)] == [*parsed, "tensors"]
    assert [f.name for f in dataclasses.fields(CheckedUpload)] == parsed
    for other in (batch, stored):
        assert isinstance(other, ParsedBatch) and isinstance(other.tensors, CheckedTensors)
        assert other.tensors == tensors
        for name in parsed:
            if name != "reported":
                assert repr(getattr(other, name)) == repr(getattr(upload, name)), name
        assert repr(dict(other.reported)) == repr(dict(upload.reported))
    assert upload.distillation is not None and upload.shape == (4, 16)


# --- audit_batch ----------------------------------------------------------------------------------


def test_audit_batch_is_the_analyzers_audit_plus_groups_advantages_and_histograms():
    config = LossConfig(clip_ratio=0.2)
    tensors = _tensors()
    reported = _reported(tensors, config)
    rewards = torch.zeros(4, 16, dtype=torch.float64)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    index = torch.tensor([0, 0, 1, 1])
    batch = AuditBatch.validate(
        {**tensors, "token_level_rewards": rewards, "group_index": index},
        config=config.to_dict(),
        reported=reported,
    )
    out = audit_batch(batch, histograms=True)
    plain = audit(config, tensors, reported).to_dict()
    assert out.result["verdicts"] == plain["verdicts"]
    assert out.groups == group_diagnostics(rewards, tensors["response_mask"], index).to_dict()
    assert out.result["groups"] == out.groups
    assert out.advantages["estimator"] == "grpo" and out.advantages["ok"] is False  # random advantages
    assert out.ok is False and "GRPO advantages" in out.result["explanation"]
    assert out.histograms == batch_histograms(tensors, config={"clip_ratio": 0.2})
    assert out.to_dict()["ok"] is False


def test_audit_batch_flags_a_tampered_report_and_spells_non_finite_values():
    config = LossConfig()
    tensors = _tensors(seed=3)
    reported = _reported(tensors, config)
    assert audit_batch(AuditBatch.validate(tensors, config={}, reported=reported)).ok is True
    tampered = {**reported, "pg_loss": reported["pg_loss"] * 2 + 1}
    out = audit_batch(AuditBatch.validate(tensors, config={}, reported=tampered))
    assert out.ok is False and out.result["verdicts"]["pg_loss"]["ok"] is False
    nan = audit_batch(AuditBatch.validate(tensors, config={}, reported={**reported, "pg_loss": "NaN"}))
    assert nan.ok is False and math.isnan(nan.result["reported"]["pg_loss"])
    assert nan.result["verdicts"]["pg_loss"]["abs_err"] == math.inf
    assert nan.to_dict()["reported"]["pg_loss"] == "NaN"
    assert nan.to_dict()["verdicts"]["pg_loss"]["abs_err"] == "Infinity"
    json.dumps(nan.to_dict(), allow_nan=False)  # JSON-safe: no bare NaN floats


def test_the_run_config_supplies_the_algorithm_when_the_batch_has_none():
    tensors = _tensors()
    rewards = torch.zeros(4, 16, dtype=torch.float64)
    rewards[:, -1] = 1.0
    batch = AuditBatch.validate({**tensors, "token_level_rewards": rewards}, config={})
    assert audit_batch(batch).advantages is None  # no group_index, no estimator named
    out = audit_batch(batch, run_config={"algorithm": {"adv_estimator": "reinforce_plus_plus"}})
    assert out.advantages["estimator"] == "reinforce_plus_plus"


# --- the client's capture reads the same table and the same parse ---------------------------------


def test_client_capture_uses_the_contracts_table_and_config_parse():
    from rlvitals.client.capture import capture

    tensors = {k: v.float() for k, v in _tensors().items()}
    captured = capture(
        step=1,
        rank=0,
        micro_batch=0,
        tensors={**tensors, "rollout_is_weights": torch.ones(4, 16)},
        config={"clip_ratio": 0.3, "algorithm": {"adv_estimator": "rloo"}},
        reported={},
    )
    assert "rollout_is_weights" in captured.tensors  # OPTIONAL of the shared table
    sent = json.loads(captured.metadata["config"])
    loss, algorithm = parse_config(sent)  # what the client sends parses to what it was given
    assert loss.clip_ratio == 0.3 and algorithm.adv_estimator == "rloo"
    trl = json.loads(
        capture(
            step=1,
            rank=0,
            micro_batch=0,
            tensors=tensors,
            config={"trainer": "trl", "loss_type": "grpo"},
            reported={},
        ).metadata["config"]
    )
    assert isinstance(parse_config(trl)[0], TrlLossConfig)
    with pytest.raises(ValueError, match="clip_ratio_c"):  # misuse raises in the caller, as before
        capture(step=1, rank=0, micro_batch=0, tensors=tensors, config={"clip_ratio_c": 0.5}, reported={})
    with pytest.raises(TypeError, match="log_batch: group_index needs token_level_rewards"):
        capture(
            step=1,
            rank=0,
            micro_batch=0,
            tensors={**tensors, "group_index": torch.zeros(4, dtype=torch.int64)},
            config=None,
            reported={},
        )


# --- the per-tensor rules run once on the audit path ------------------------------------------------


def test_the_per_tensor_rules_run_once_per_audit_and_still_for_a_direct_caller(monkeypatch):
    from rlvitals.analyzers import audit, recompute
    from rlvitals.analyzers.contract import batch as contract

    calls = []
    check = contract.check_token_tensors
    monkeypatch.setattr(contract, "check_token_tensors", lambda t: calls.append(1) or check(t))
    tensors = _tensors()
    batch = AuditBatch.validate(tensors, config={})
    assert len(calls) == 1  # the validation
    audit_batch(batch)
    assert len(calls) == 1  # the audit builds its TokenBatch from the checked tensors
    audit_batch(AuditBatch.stored(tensors, config={}))  # validated at upload: not checked again
    assert len(calls) == 1
    core = {k: tensors[k] for k in ("log_prob", "old_log_prob", "advantages", "response_mask")}
    audit(LossConfig(), core, {})
    recompute(LossConfig(), **core)
    assert len(calls) == 3  # a direct caller's tensors are checked, once per call


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.update(advantages=t["advantages"][:, :-1]), "advantages has shape [4, 15]"),
        (lambda t: t.update(log_prob=t["log_prob"][0]), "log_prob must be 2-D"),
        (lambda t: t.update(old_log_prob=t["old_log_prob"].long()), "old_log_prob must be a floating-point"),
        (
            lambda t: t.update(entropy=t["log_prob"].to("meta")),
            "entropy is on meta but response_mask is on cpu",
        ),
        (
            lambda t: t.update(response_mask=t["response_mask"].to(torch.complex64)),
            "response_mask must be one of",
        ),
        (lambda t: t.update(entropy=[1.0]), "entropy must be a torch.Tensor; got list"),
    ],
)
def test_a_direct_audit_caller_gets_the_contracts_errors(change, message):
    from rlvitals.analyzers import audit

    tensors = {
        k: v
        for k, v in _tensors().items()
        if k in ("log_prob", "old_log_prob", "advantages", "response_mask")
    }
    change(tensors)
    with pytest.raises(ValueError) as caught:
        audit(LossConfig(), tensors, {"pg_loss": 0.0})
    assert message in str(caught.value)
