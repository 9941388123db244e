"""The names an audit checks, and the trainers' spellings of them (no torch: the service's read path
uses this to pair a reported name with its recomputed one)."""

from __future__ import annotations

ALIASES = {
    "clip_ratio/region_mean": "pg_clipfrac",  # TRL
    "ppo_clip_ratio": "pg_clipfrac",  # OpenRLHF
}

OWN_PREFIXES = ("distillation/",)  # metric families audited by their own step, never as loss metrics


def canonical_name(name: str) -> str:
    """``actor/pg_loss`` -> ``pg_loss`` (verl prefixes most metrics, not ``kl_loss``); TRL and
    OpenRLHF spellings of the clip fraction -> ``pg_clipfrac``. ``distillation/*`` names stay whole: verl's
    distillation loss reports its own ``pg_clipfrac``/``ppo_kl`` there, which are not the policy loss's."""
    if name.startswith(OWN_PREFIXES):
        return name
    for alias, canonical in ALIASES.items():
        if name == alias or name.endswith("/" + alias):
            return canonical
    return name.rsplit("/", 1)[-1]
