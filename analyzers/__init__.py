"""rlvitals.analyzers: verl-exact loss recomputation, audits and health rules (pure torch, no I/O).

Names are resolved lazily from their modules so importing one part never pays for the others.
To export a new public name, add it to ``_EXPORTS``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    # config.py
    "LossConfig": "config",
    # losses.py
    "recompute": "losses",
    "compute_policy_loss_vanilla": "losses",
    "agg_loss": "losses",
    "kl_penalty": "losses",
    "ppo_loss": "losses",
    "register_agg_mode": "losses",
    "register_kl_estimator": "losses",
    # policy_losses.py
    "register_policy_loss": "policy_losses",
    "get_policy_loss": "policy_losses",
    "POLICY_LOSSES": "policy_losses",
    "LossMode": "policy_losses",
    # advantages.py
    "grpo_advantages": "advantages",
    "group_diagnostics": "advantages",
    "GroupDiagnostics": "advantages",
    "compute_advantages": "advantages",
    "register_adv_estimator": "advantages",
    "register_batch_normalisation": "advantages",
    "BATCH_NORMALISED": "advantages",
    "AdvEstimator": "advantages",
    "ADV_ESTIMATORS": "advantages",
    # rollout.py
    "rollout_correction": "rollout",
    "rollout_corr_metrics": "rollout",
    "rollout_debug_metrics": "rollout",
    "RolloutCorrectionConfig": "rollout_config",
    # distillation.py
    "distillation_loss": "distillation",
    "DistillationConfig": "distillation",
    # auditing.py (not audit.py: a submodule named like an export would shadow it once imported)
    "audit": "auditing",
    "counterfactuals": "auditing",
    "AuditReport": "auditing",
    # batch.py: the batch contract (one validation, one config parse, one audit_batch)
    "AuditBatch": "batch",
    "BatchAudit": "batch",
    "BatchError": "batch",
    "audit_batch": "batch",
    # trl.py, trl_audit.py (TRL 1.16 GRPOTrainer's own loss)
    "TrlLossConfig": "trl",
    "trl_loss": "trl",
    "trl_audit": "trl_audit",
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
