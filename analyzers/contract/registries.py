"""The registries' names: policy losses, aggregation modes, KL estimators and advantage estimators.

Plain dicts filled by decorators; the reference layer registers its built-ins through them exactly as a
user's plugin does (:mod:`rlvitals.analyzers.plugins`), and the config dataclasses of this layer check a
name against them. A built-in name is always valid (its enum lists it) even before the reference layer
is imported; a duplicate registration raises; an unknown name raises listing the valid ones. No math."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

PolicyLossFn = Callable[..., tuple[Any, dict[str, Any]]]
BoundsFn = Callable[..., tuple[float, float]]


class LossMode(str, Enum):
    """The names verl 0.9.1 registers (``policy_loss.loss_mode``); the registry also takes others."""

    VANILLA = "vanilla"
    GSPO = "gspo"
    SAPO = "sapo"
    GPG = "gpg"
    CLIP_COV = "clip_cov"
    KL_COV = "kl_cov"
    GEO_MEAN = "geo_mean"
    DRO = "dro"
    CISPO = "cispo"
    DPPO_TV = "dppo_tv"
    DPPO_KL = "dppo_kl"
    BYPASS_MODE = "bypass_mode"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss. ``random``: the loss draws from torch's RNG (``clip_cov``), so ``pg_loss`` is
    only reproducible as a range, given by ``bounds(...) -> (low, high)`` (same arguments as ``fn``).
    ``uses_agg_mode``: whether ``loss_agg_mode`` changes ``pg_loss`` (counterfactuals use it)."""

    name: str
    fn: PolicyLossFn
    random: bool = False
    bounds: BoundsFn | None = None
    uses_agg_mode: bool = True  # False: the loss ignores loss_agg_mode (verl's sapo, geo_mean)


POLICY_LOSSES: dict[str, PolicyLoss] = {}
_BUILT_IN = frozenset(m.value for m in LossMode)


def register_policy_loss(
    name: str, *, random: bool = False, bounds: BoundsFn | None = None, uses_agg_mode: bool = True
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register ``fn`` as ``policy_loss.loss_mode = name`` (a duplicate name raises ``ValueError``)."""
    key = name.value if isinstance(name, Enum) else name
    if not isinstance(key, str) or not key:
        raise ValueError(f"a policy loss name must be a non-empty string; got {name!r}")

    def decorate(fn: PolicyLossFn) -> PolicyLossFn:
        if key in POLICY_LOSSES:
            raise ValueError(f"policy loss {key!r} is already registered")
        POLICY_LOSSES[key] = PolicyLoss(key, fn, random=random, bounds=bounds, uses_agg_mode=uses_agg_mode)
        return fn

    return decorate


def loss_mode_name(name: Any) -> str:
    """``name`` (a ``str`` or :class:`LossMode`) as the registry's key when it is a built-in or a registered
    loss; else ``ValueError`` listing the valid ones (as :func:`get_policy_loss`). Needs no loss imported."""
    key = name.value if isinstance(name, Enum) else name
    if isinstance(key, str) and (key in POLICY_LOSSES or key in _BUILT_IN):
        return key
    allowed = ", ".join(repr(n) for n in dict.fromkeys([*POLICY_LOSSES, *_BUILT_IN]))
    raise ValueError(f"loss_mode must be one of {allowed}; got {name!r}")


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered loss ``name``; an unknown name raises ``ValueError`` listing the valid ones."""
    # a str enum member (LossMode) is a str equal to its value: looked up as it is (``.value`` is a
    # Python-level descriptor, read on every recompute())
    entry = POLICY_LOSSES.get(name) if isinstance(name, str) else None
    if entry is None:
        key = name.value if isinstance(name, Enum) else name
        entry = POLICY_LOSSES.get(key) if isinstance(key, str) else None
    if entry is None:
        allowed = ", ".join(repr(n) for n in POLICY_LOSSES)
        raise ValueError(f"loss_mode must be one of {allowed}; got {name!r}")
    return entry


# -- aggregation modes (verl's loss_agg_mode) ----------------------------------------------------------
AggFn = Callable[..., Any]
AGG_MODES: dict[str, AggFn] = {}  # keyed by name; the built-ins are AggMode's values


def register_agg_mode(mode: Enum | str) -> Callable[[AggFn], AggFn]:
    """Register ``fn(loss_mat, loss_mask, *, dp_size, batch_num_tokens, global_batch_size,
    loss_scale_factor) -> scalar`` under a loss_agg_mode name, built-in or new (a duplicate raises).
    A registered name is then valid in ``LossConfig(loss_agg_mode=...)`` and every loss mode."""
    key = mode.value if isinstance(mode, Enum) else mode  # AggMode: a str enum
    if not isinstance(key, str) or not key:
        raise ValueError(f"a loss_agg_mode name must be a non-empty string; got {mode!r}")

    def decorate(fn: AggFn) -> AggFn:
        if key in AGG_MODES:
            raise ValueError(f"loss_agg_mode {key!r} is already registered")
        AGG_MODES[key] = fn
        return fn

    return decorate


# -- KL estimators (kl_loss_type) ------------------------------------------------------------------------
KLFn = Callable[..., Any]
KL_ESTIMATORS: dict[str, KLFn] = {}


def register_kl_estimator(name: str) -> Callable[[KLFn], KLFn]:
    """Register a forward estimator ``fn(logprob, ref_logprob) -> (batch, response_len)`` by base name
    (a duplicate raises). ``name`` and ``name + "+"`` (straight-through) are then valid kl_loss_types."""
    if not isinstance(name, str) or not name or name.endswith("+"):
        raise ValueError(f"a KL estimator name must be a non-empty string without '+'; got {name!r}")

    def decorate(fn: KLFn) -> KLFn:
        if name in KL_ESTIMATORS:
            raise ValueError(f"KL estimator {name!r} is already registered")
        KL_ESTIMATORS[name] = fn
        return fn

    return decorate


# -- advantage estimators (verl's algorithm.adv_estimator) -----------------------------------------------
class AdvEstimator(str, Enum):
    """verl's ``algorithm.adv_estimator`` names reproduced here (outcome rewards, no critic)."""

    GRPO = "grpo"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    GRPO_PASSK = "grpo_passk"
    OPO = "opo"
    GPG = "gpg"

    def __str__(self) -> str:
        return self.value


AdvantageFn = Callable[..., tuple[Any, Any]]
ADV_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_adv_estimator(name: str | AdvEstimator) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register ``fn(token_level_rewards, response_mask, index, *, gamma, epsilon,
    norm_adv_by_std_in_grpo) -> (advantages, returns)`` under ``name``; a duplicate name raises. The
    built-ins register through this decorator exactly as a user's estimator does."""
    key = str(name)
    if not key:
        raise ValueError("an advantage estimator needs a non-empty name")

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if key in ADV_ESTIMATORS:
            raise ValueError(f"advantage estimator {key!r} is already registered")
        ADV_ESTIMATORS[key] = fn
        return fn

    return decorator


def get_adv_estimator(name: str | AdvEstimator) -> AdvantageFn:
    fn = ADV_ESTIMATORS.get(str(name))
    if fn is None:
        raise ValueError(f"unknown adv_estimator {str(name)!r}; valid: {', '.join(sorted(ADV_ESTIMATORS))}")
    return fn
