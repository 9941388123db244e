"""`rlvitals import epoch-console`: the per-step lines a plain PyTorch RL loop prints (MiniMind's GRPO/PPO
trainers), read from a small sample written here in that format (tests/data/importers/)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
from rlvitals.client.importers import ImportFormatError, read_history, run_import, unmapped_names

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "importers" / "epoch_console_sample.log"


def test_steps_run_on_across_epochs_and_names_map_to_the_rules_names():
    history = read_history("epoch-console", SAMPLE)
    assert [s for s, _ in history.points] == [1, 2, 3, 4]  # epoch 2 step 1 -> (2-1)*3 + 1
    first = history.points[0][1]
    assert first["reward"] == 0.41 and first["kl"] == 0.0004 and first["loss"] == 0.0
    assert first["completions/mean_length"] == 129 and first["learning_rate"] == 1e-06
    assert first["rewards/format/mean"] == 1.0 and first["rewards/correct/mean"] == 0.0
    assert history.points[1][1]["reward"] == -0.25 and history.points[1][1]["kl"] == -0.005
    last = history.points[3][1]
    assert math.isnan(last["reward"]) and last["kl"] == 0.0015 and last["grad_norm"] == 3.2
    assert last["completions/mean_length"] == 212.5 and last["advantages/mean"] == 0.0
    # the mapped names are ones the health rules read
    assert not {"reward", "kl", "completions/mean_length", "grad_norm"} & set(unmapped_names(last))


def test_import_runs_the_rules_on_it(tmp_path):
    out = io.StringIO()
    result = run_import("epoch-console", SAMPLE, upload=False, out=out)
    assert result.steps == 4 and "rlvitals import epoch-console" in out.getvalue()


def test_a_file_without_epoch_lines_is_refused(tmp_path):
    other = tmp_path / "x.log"
    other.write_text("step:1 - actor/entropy:0.4\n")
    with pytest.raises(ImportFormatError, match="Epoch:"):
        read_history("epoch-console", other)


def test_trl_console_keeps_the_dicts_whose_values_print_as_bare_nan_or_inf():
    # Python prints a non-finite float as a bare name ('grad_norm': nan); those dicts are the ones that
    # matter most, so they must not be dropped as unparsable (sample written here, Unsloth/TRL layout)
    sample = SAMPLE.with_name("trl_console_nan_sample.log")
    history = read_history("trl-console", sample)
    assert [s for s, _ in history.points] == [1, 2, 3]  # the train_runtime summary left out
    first, second, third = (m for _, m in history.points)
    assert math.isnan(first["grad_norm"]) and first["reward"] == -3.25
    assert second["grad_norm"] == math.inf and third["kl"] == -math.inf and math.isnan(third["reward"])
    assert third["grad_norm"] == 0.5 and "note" not in third
