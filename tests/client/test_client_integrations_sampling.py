"""The audit sampling policy the integrations share (``AuditSampler``) and the run hooks it uses
(``log_batch(sampled=True)``, ``update_config``)."""

from __future__ import annotations

import pytest
import torch
from rlvitals.client.integrations._common import AuditSampler
from rlvitals.client.testing import FakeServer

import rlvitals


def _drive(sampler, steps, calls_per_step, position=None):
    """(step, position) of every captured call when each step makes ``calls_per_step`` loss calls."""
    taken = []
    for step in steps:
        for call in range(calls_per_step):
            pos = None if position is None else position(step, call)
            got = sampler.take(step, pos)
            if got is not None:
                taken.append((step, got))
    return taken


def test_counted_positions_rotate_through_every_micro_batch_of_a_step():
    # verl: 4 loss calls per step (2 mini-batches x 2 micro-batches), one rollout per step
    taken = _drive(AuditSampler(5), range(1, 31), 4)
    assert taken == [(5, 0), (10, 1), (15, 2), (20, 3), (25, 0), (30, 1)]


def test_one_capture_per_armed_step_and_nothing_between():
    taken = _drive(AuditSampler(3), range(1, 10), 2)
    assert [step for step, _ in taken] == [3, 6, 9]


def test_given_cycle_positions_span_several_optimizer_steps():
    # TRL: gradient_accumulation_steps=2, steps_per_generation=2, num_iterations=2 -> a cycle of 4
    # micro-batches over 2 optimizer steps; position = trainer._step % 4
    calls = iter(range(1000))
    sampler = AuditSampler(2, cycle=4)
    taken = _drive(sampler, range(1, 17), 2, position=lambda step, call: next(calls))
    assert [pos for _, pos in taken] == [0, 1, 2, 3, 0, 1, 2, 3]
    # odd steps hold positions 0-1, even steps 2-3: a target the armed step lacks is taken at the next
    # step that holds it (armed at 2, position 0 taken at 3; armed at 4, position 1 taken at 5)
    assert taken[:4] == [(3, 0), (5, 1), (6, 2), (8, 3)]


def test_every_one_audits_every_step_and_still_rotates():
    assert _drive(AuditSampler(1), range(1, 5), 3) == [(1, 0), (2, 1), (3, 2), (4, 0)]


def test_all_calls_captures_every_call_of_the_due_steps():
    assert _drive(AuditSampler(2, all_calls=True), range(1, 5), 2) == [(2, 0), (2, 1), (4, 0), (4, 1)]


def test_a_resumed_run_arms_at_its_first_step():
    assert _drive(AuditSampler(10), range(1234, 1242), 1) == [(1234, 0), (1240, 0)]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10"])
def test_bad_every_is_refused(bad):
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        AuditSampler(bad)


def test_for_run_follows_the_run_settings(tmp_path):
    run = rlvitals.init(project="p", name="n", mode="offline", spool_dir=tmp_path, batch_every=7)
    try:
        sampler = AuditSampler.for_run(run, cycle=3)
        assert (sampler.every, sampler.cycle, sampler.all_calls) == (7, 3, False)
    finally:
        run.finish(timeout=1)


def _tensors():
    x = torch.zeros(2, 3)
    return {
        "log_prob": x,
        "old_log_prob": x,
        "advantages": x,
        "response_mask": torch.ones(2, 3, dtype=torch.bool),
    }


def test_log_batch_keeps_what_the_caller_sampled_at_any_step(tmp_path):
    server = FakeServer()
    run = rlvitals.init(project="p", name="n", transport=server.transport, spool_dir=tmp_path, batch_every=10)
    assert run.log_batch(3, **_tensors(), micro_batch=2, sampled=True)  # not a multiple of batch_every
    assert not run.log_batch(10, **_tensors(), sampled=False)
    assert not run.log_batch(11, **_tensors())  # the run's own rule when the caller does not decide
    run.finish(timeout=5)
    assert len(server.batches[run.id]) == 1


def test_update_config_resends_the_config_to_the_run(tmp_path):
    server = FakeServer()
    run = rlvitals.init(
        project="p", name="n", config={"a": 1}, transport=server.transport, spool_dir=tmp_path
    )
    run.log({"x": 1.0}, 1)
    run.update_config({"num_iterations": 2})
    run.log({"x": 2.0}, 2)
    run.finish(timeout=5)
    assert server.run_configs[run.id] == {"a": 1, "num_iterations": 2}
    assert server.series(run.id, "x") == {1: 1.0, 2: 2.0}
    with pytest.raises(TypeError, match="config must be a dict"):
        run.update_config([("a", 1)])
