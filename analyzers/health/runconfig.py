"""What the health rules need to know about a run's trainer configuration: the names the rules call,
read by the contract layer's one reader per trainer (:mod:`rlvitals.analyzers.contract.trainers`).

:func:`flatten_config` turns a nested verl/TRL/OpenRLHF config (dicts, OmegaConf, or already dotted
keys) into ``{"dotted.key": scalar}`` with only JSON scalars kept, which is also what the monitor
persists. :func:`updates_per_batch` infers how many optimizer updates each rollout batch gets: with one,
the batch is used on-policy, ``old_log_prob == log_prob`` and pg_clipfrac is 0 by construction.
"""

from __future__ import annotations

from ..contract.trainers import (  # noqa: F401  (the names the rules import from here)
    CONFIG_KEYS,
    EXPLICIT_KEY,
    GRAD_CLIP_KEYS,
    LEARNING_RATE_KEYS,
    LOSS_MODE_KEYS,
    flatten_config,
    grad_clip,
    learning_rate,
    loss_mode,
    updates_per_batch,
)
from ..contract.trainers.verl import LOSS_MODE_KEY as VERL_LOSS_MODE  # noqa: F401
