"""The verdict layer: audits of what a trainer reported, with explanations.

Verdicts and counterfactuals (:mod:`.auditing`, :mod:`.alternatives`), TRL's audit (:mod:`.trl_audit`),
the advantage and rollout-correction checks (:mod:`.algorithm`), the mismatch report (:mod:`.mismatch`)
and the dashboard's histograms (:mod:`.histograms`). May import every layer below it.
"""
