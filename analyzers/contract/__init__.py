"""The contract layer: what crosses every other layer, validated once, with no math.

The batch rules and the validated batch (:mod:`.batch`), every config dataclass (:mod:`.config`,
:mod:`.rollout_config`), one reader per trainer's config (:mod:`.trainers`: verl, TRL, OpenRLHF), the audit's
metric names (:mod:`.audit_names`) and the one spelling of non-finite numbers (:mod:`.batch_rules`).
Everything in analyzers/ may import it; it imports nothing else of analyzers/.
"""
