"""rlvitals.analyzers: verl-exact loss recomputation, audits and health rules (pure torch, no I/O).

Names are resolved lazily from their modules so importing one part never pays for the others.
To export a new public name, add it to ``_EXPORTS``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    # contract/config.py
    "LossConfig": "contract.config",
    # reference/losses.py
    "recompute": "fast.dispatch",
    "compute_policy_loss_vanilla": "reference.losses",
    "agg_loss": "reference.losses",
    "kl_penalty": "reference.losses",
    "ppo_loss": "reference.policy_losses",
    "register_agg_mode": "reference.losses",
    "register_kl_estimator": "reference.losses",
    # reference/policy_losses.py
    "register_policy_loss": "reference.policy_losses",
    "get_policy_loss": "reference.policy_losses",
    "POLICY_LOSSES": "reference.policy_losses",
    "LossMode": "reference.policy_losses",
    # reference/advantages.py
    "grpo_advantages": "reference.advantages",
    "group_diagnostics": "reference.advantages",
    "GroupDiagnostics": "reference.advantages",
    "compute_advantages": "reference.advantages",
    "register_adv_estimator": "reference.advantages",
    "register_batch_normalisation": "reference.advantages",
    "BATCH_NORMALISED": "reference.advantages",
    "AdvEstimator": "reference.advantages",
    "ADV_ESTIMATORS": "reference.advantages",
    # reference/rollout.py
    "rollout_correction": "fast.rollout",
    "rollout_corr_metrics": "fast.rollout",
    "rollout_debug_metrics": "fast.rollout",
    "RolloutCorrectionConfig": "contract.rollout_config",
    # reference/distillation.py
    "distillation_loss": "reference.distillation",
    "DistillationConfig": "contract.distillation_config",
    # verdicts/auditing.py (not audit.py: a submodule named like an export would shadow it once imported)
    "audit": "verdicts.auditing",
    "counterfactuals": "verdicts.auditing",
    "AuditReport": "verdicts.auditing",
    # contract/batch.py: the batch contract (one validation, one config parse, one audit_batch)
    "AuditBatch": "contract.batch",
    "BatchAudit": "verdicts.batch_audit",
    "BatchError": "contract.batch",
    "audit_batch": "verdicts.batch_audit",
    # reference/trl.py, trl_audit.py (TRL 1.16 GRPOTrainer's own loss)
    "TrlLossConfig": "contract.trl_config",
    "trl_loss": "reference.trl",
    "trl_audit": "verdicts.trl_audit",
    # health/
    "HealthMonitor": "health",
    "Finding": "health",
    "Severity": "health",
    "RULES": "health",
    "register_rule": "health",
    "canonical_signals": "health",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlvitals.analyzers' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
