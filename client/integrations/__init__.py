"""Trainer integrations: verl, TRL and OpenRLHF without patching them.

Each module imports its framework lazily (none is a dependency of rlvitals):

- ``rlvitals.client.integrations.verl`` — a policy loss for verl's ``register_policy_loss`` registry
  (``actor_rollout_ref.actor.policy_loss.loss_mode=rlvitals``), a recording ``ppo_loss`` for
  ``set_loss_fn``, a tailer for verl's ``file`` logger JSONL and a verl tracking-backend logger.
- ``rlvitals.client.integrations.trl`` — a ``TrainerCallback`` for GRPOTrainer's logs and a mixin that
  captures the per-token tensors of its loss.
- ``rlvitals.client.integrations.openrlhf`` — a recording wrapper for ``PolicyLoss`` and its logs dict.

Every integration talks to a run through two calls only, ``run.log(metrics, step)`` and
``run.log_batch(step, **tensors)``; pass ``run=`` explicitly or let the integration start one from the
environment (``RLVITALS_URL``, ``RLVITALS_PROJECT``, ``RLVITALS_RUN_NAME``) on first use.
"""
