"""The reference layer: verl 0.9.1's and TRL 1.16's math as readable torch, the source of truth.

Losses and their aggregation (:mod:`.losses`, :mod:`.policy_losses`), advantages (:mod:`.advantages`),
rollout correction (:mod:`.rollout`), on-policy distillation (:mod:`.distillation`) and TRL's
GRPOTrainer loss (:mod:`.trl`). Imports only the contract layer.
"""
