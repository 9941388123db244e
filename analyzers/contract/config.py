"""Loss configuration: verl 0.9.1's actor loss settings as one frozen, validated value.

The field names are verl's, so a user can hand over their verl actor config as-is
(``LossConfig.from_verl(cfg.actor_rollout_ref.actor)``). Defaults live here and only here; verl keeps
some of them in ``config.get("clip_ratio_c", 3.0)`` calls, we don't.

Two fields are per-mini-batch in verl rather than static config (``batch_num_tokens``,
``global_batch_size``, ``dp_size``: verl's ``ActorConfig.global_batch_info``, filled by ``ppo_loss`` from
the data). They live here too, because a loss value is only reproducible together with them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any

from . import registries


class AggMode(str, Enum):
    """verl's ``loss_agg_mode``: how a ``(batch, response_len)`` loss matrix becomes one scalar."""

    TOKEN_MEAN = "token-mean"
    TOKEN_SUM = "token-sum"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"

    def __str__(self) -> str:
        return self.value


class KLType(str, Enum):
    """verl's ``kl_loss_type``: the per-token KL estimator (http://joschu.net/blog/kl-approx.html).

    A ``+`` suffix is the straight-through variant: the forward value of the named estimator with the
    gradient of k2 (unbiased). ``kl``/``k1``, ``mse``/``k2`` and ``low_var_kl``/``k3`` are aliases.
    """

    KL = "kl"
    K1 = "k1"
    ABS = "abs"
    MSE = "mse"
    K2 = "k2"
    LOW_VAR_KL = "low_var_kl"
    K3 = "k3"
    KL_ST = "kl+"
    K1_ST = "k1+"
    ABS_ST = "abs+"
    MSE_ST = "mse+"
    K2_ST = "k2+"
    LOW_VAR_KL_ST = "low_var_kl+"
    K3_ST = "k3+"

    def __str__(self) -> str:
        return self.value

    # a member is a str equal to its value: both read it as one (``.value`` is a Python-level
    # descriptor, ~0.2 us a read, and the fast path asks these several times per call)
    @property
    def base(self) -> str:
        """Canonical forward estimator: ``"k1"``, ``"abs"``, ``"k2"`` or ``"k3"``."""
        return _KL_BASE[self]

    @property
    def straight_through(self) -> bool:
        return self.endswith("+")


# KLType.base per value, computed once (the fast path asks it several times per call)
_KL_BASE = {
    k.value: {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}.get(k.value.rstrip("+"), k.value.rstrip("+"))
    for k in KLType
}


def _allowed(enum: type[Enum]) -> str:
    return ", ".join(repr(m.value) for m in enum)


def _parse_enum(enum: type[Enum], field: str, value: Any) -> Any:
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"{field} must be one of {_allowed(enum)}; got {value!r}") from None


def _parse_registered(enum: type[Enum], field: str, value: Any) -> Any:
    """A built-in name as its enum member; a name registered by a user (``register_agg_mode`` /
    ``register_kl_estimator``) as a plain ``str``; anything else raises listing both."""
    try:
        return enum(value)
    except ValueError:
        pass
    registered = registries.AGG_MODES if enum is AggMode else registries.KL_ESTIMATORS
    name = value.value if isinstance(value, Enum) else value
    if isinstance(name, str) and (name in registered or (enum is KLType and name.rstrip("+") in registered)):
        return name
    allowed = ", ".join(dict.fromkeys([*(repr(m.value) for m in enum), *(repr(k) for k in registered)]))
    raise ValueError(f"{field} must be one of {allowed}; got {value!r}")


def _number(field: str, value: Any, *, allowed: str, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} must be {allowed}; got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{field} must be {allowed}; got {value!r}")
    return float(value)


def _count(field: str, value: Any, *, minimum: int, optional: bool) -> int | None:
    allowed = f"an integer >= {minimum}" + (" or None" if optional else "")
    if value is None and optional:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{field} must be {allowed}; got {value!r}")
    if value > _MAX_COUNT:  # verl multiplies and divides torch tensors by it: an int64 at most
        raise ValueError(
            f"{field} must be {allowed} and at most 2**63 - 1 (an int64, as verl's torch holds it)"
        )
    return value


_MAX_COUNT = 2**63 - 1


@dataclass(frozen=True)
class LossConfig:
    """verl 0.9.1 actor loss settings (``ppo_loss`` + ``compute_policy_loss_vanilla`` + ``agg_loss``).

    - ``clip_ratio_low`` / ``clip_ratio_high`` fall back to ``clip_ratio`` when None; the ratio is
      clipped to ``[1 - low, 1 + high]`` (asymmetric = DAPO's Clip-Higher).
    - ``clip_ratio_c`` caps the loss of negative-advantage tokens at ``-A * c`` (dual clip, > 1).
    - ``loss_scale_factor`` divides ``seq-mean-token-sum-norm`` (None: the padded ``response_len``).
    - ``dp_size`` / ``batch_num_tokens`` / ``global_batch_size``: global normalisation. With ``dp_size``
      > 1, verl requires ``batch_num_tokens`` for token-mean and ``global_batch_size`` for seq modes.
    - ``policy_loss = pg_loss - entropy_coeff * entropy_loss (+ kl_loss_coef * kl_loss if use_kl_loss)``.
    - ``loss_mode`` names a registered policy loss (:mod:`.policy_losses`, verl's twelve built in); the
      fields after it are verl's ``policy_loss`` settings and SAPO's ``tau_pos`` / ``tau_neg``, with
      verl's defaults. ``dro_beta`` is required for ``dro``; ``rollout_correction`` (a mapping, see
      :data:`ROLLOUT_CORRECTION_DEFAULTS`) is read by ``bypass_mode``.
    """

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: AggMode = AggMode.TOKEN_MEAN
    loss_scale_factor: float | None = None
    dp_size: int = 1
    batch_num_tokens: int | None = None
    global_batch_size: int | None = None
    use_kl_loss: bool = False
    kl_loss_type: KLType = KLType.LOW_VAR_KL
    kl_loss_coef: float = 0.001
    entropy_coeff: float = 0.0
    # verl's policy_loss section (PolicyLossConfig) and the SAPO temperatures (ActorConfig)
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    rollout_correction: Any = None  # policy_loss.rollout_correction (bypass_mode); stored as sorted items

    def __post_init__(self) -> None:
        set_ = object.__setattr__.__get__(self)  # frozen: normalise in place once
        set_("clip_ratio", _number("clip_ratio", self.clip_ratio, allowed="a number in [0, 1]"))
        if not 0.0 <= self.clip_ratio <= 1.0:
            raise ValueError(f"clip_ratio must be a number in [0, 1]; got {self.clip_ratio!r}")
        low = _number(
            "clip_ratio_low", self.clip_ratio_low, allowed="None or a number in [0, 1]", optional=True
        )
        if low is not None and not 0.0 <= low <= 1.0:
            raise ValueError(f"clip_ratio_low must be None or a number in [0, 1]; got {low!r}")
        set_("clip_ratio_low", low)
        high = _number(
            "clip_ratio_high", self.clip_ratio_high, allowed="None or a number >= 0", optional=True
        )
        if high is not None and high < 0.0:
            raise ValueError(f"clip_ratio_high must be None or a number >= 0; got {high!r}")
        set_("clip_ratio_high", high)
        c = _number("clip_ratio_c", self.clip_ratio_c, allowed="a number > 1 (dual-clip bound)")
        if c <= 1.0:
            raise ValueError(
                f"clip_ratio_c must be a number > 1 (dual-clip bound); got {self.clip_ratio_c!r}"
            )
        set_("clip_ratio_c", c)
        set_("loss_agg_mode", _parse_registered(AggMode, "loss_agg_mode", self.loss_agg_mode))
        lsf = _number(
            "loss_scale_factor", self.loss_scale_factor, allowed="None or a number > 0", optional=True
        )
        if lsf is not None and lsf <= 0.0:
            raise ValueError(f"loss_scale_factor must be None or a number > 0; got {lsf!r}")
        set_("loss_scale_factor", lsf)
        set_("dp_size", _count("dp_size", self.dp_size, minimum=1, optional=False))
        set_("batch_num_tokens", _count("batch_num_tokens", self.batch_num_tokens, minimum=0, optional=True))
        set_(
            "global_batch_size", _count("global_batch_size", self.global_batch_size, minimum=0, optional=True)
        )
        if not isinstance(self.use_kl_loss, bool):
            raise ValueError(f"use_kl_loss must be one of True, False; got {self.use_kl_loss!r}")
        set_("kl_loss_type", _parse_registered(KLType, "kl_loss_type", self.kl_loss_type))
        set_("kl_loss_coef", _number("kl_loss_coef", self.kl_loss_coef, allowed="a finite number"))
        set_("entropy_coeff", _number("entropy_coeff", self.entropy_coeff, allowed="a finite number"))
        self._check_policy_loss(set_)
        if self.dp_size > 1:
            if self.loss_agg_mode is AggMode.TOKEN_MEAN and self.batch_num_tokens is None:
                raise ValueError(
                    "batch_num_tokens must be the global token count (an integer >= 0) when dp_size > 1 "
                    "with loss_agg_mode 'token-mean'; got None"
                )
            if str(self.loss_agg_mode).startswith("seq-") and self.global_batch_size is None:
                raise ValueError(
                    "global_batch_size must be the global sequence count (an integer >= 0) when dp_size > 1 "
                    f"with loss_agg_mode {self.loss_agg_mode.value!r}; got None"
                )

    def _check_policy_loss(self, set_) -> None:
        name = registries.loss_mode_name(self.loss_mode)  # unknown: ValueError listing the valid names
        set_("loss_mode", name)
        for field_, allowed in (
            ("clip_cov_ratio", "a number in (0, 1]"),
            ("clip_cov_lb", "a finite number"),
            ("clip_cov_ub", "a finite number"),
            ("kl_cov_ratio", "a number in (0, 1]"),
            ("ppo_kl_coef", "a finite number"),
            ("tau_pos", "a number > 0"),
            ("tau_neg", "a number > 0"),
        ):
            value = _number(field_, getattr(self, field_), allowed=allowed)
            if allowed.endswith("> 0") and value <= 0:
                raise ValueError(f"{field_} must be {allowed}; got {value!r}")
            # a share of the valid tokens (verl: int(ratio * count)); above 1 the product can overflow
            if allowed.endswith("(0, 1]") and not 0 < value <= 1:
                raise ValueError(f"{field_} must be {allowed} (a share of the valid tokens); got {value!r}")
            set_(field_, value)
        beta = _number("dro_beta", self.dro_beta, allowed="None or a number > 0", optional=True)
        if beta is not None and beta <= 0:
            raise ValueError(f"dro_beta must be None or a number > 0; got {beta!r}")
        if name == registries.LossMode.DRO.value and beta is None:
            raise ValueError(
                "dro_beta must be a number > 0 when loss_mode is 'dro' (verl requires it); got None"
            )
        set_("dro_beta", beta)
        rc = self.rollout_correction
        if rc is not None:
            items = rc.items() if isinstance(rc, Mapping) else rc
            try:
                items = dict(items)
            except (TypeError, ValueError):
                raise ValueError(f"rollout_correction must be a mapping or None; got {rc!r}") from None
            unknown = set(items) - set(ROLLOUT_CORRECTION_DEFAULTS)
            if unknown:
                raise ValueError(
                    f"rollout_correction has unknown key(s) {sorted(unknown)}; "
                    f"allowed: {sorted(ROLLOUT_CORRECTION_DEFAULTS)}"
                )
            if items.get("loss_type", "ppo_clip") not in ("ppo_clip", "reinforce"):
                raise ValueError(
                    f"rollout_correction.loss_type must be one of 'ppo_clip', 'reinforce'; got {items['loss_type']!r}"
                )
            set_("rollout_correction", tuple(sorted((k, _plain(v)) for k, v in items.items())))

    # -- derived -------------------------------------------------------------------------------
    @property
    def clip_low(self) -> float:
        """Effective lower clip epsilon: the ratio is clipped below at ``1 - clip_low``."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        """Effective upper clip epsilon: the ratio is clipped above at ``1 + clip_high``."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    @property
    def global_batch_info(self) -> dict[str, Any]:
        """The keyword arguments verl's ``ppo_loss`` passes to every ``agg_loss`` call."""
        return {
            "dp_size": self.dp_size,
            "batch_num_tokens": self.batch_num_tokens,
            "global_batch_size": self.global_batch_size,
            "loss_scale_factor": self.loss_scale_factor,
        }

    @property
    def rollout_correction_settings(self) -> dict[str, Any]:
        """``policy_loss.rollout_correction`` with verl's defaults filled in (used by ``bypass_mode``)."""
        return {**ROLLOUT_CORRECTION_DEFAULTS, **dict(self.rollout_correction or ())}

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe dict (enums as their string values); ``LossConfig(**d)`` round-trips."""
        out = asdict(self)
        out["loss_agg_mode"] = str(self.loss_agg_mode)
        out["kl_loss_type"] = str(self.kl_loss_type)
        out["rollout_correction"] = None if self.rollout_correction is None else dict(self.rollout_correction)
        return out

    # -- construction from trainer configs --------------------------------------------------------
    @classmethod
    def from_verl(cls, mapping: Mapping[str, Any] | Any, **overrides: Any) -> LossConfig:
        """Build from a verl actor config (dict, OmegaConf ``DictConfig`` or verl ``ActorConfig``).

        Accepts the actor section itself, or a whole trainer config (descends into
        ``actor_rollout_ref.actor``). Reads ``global_batch_info`` (dp_size, batch_num_tokens,
        global_batch_size, loss_scale_factor) when present; keys verl has but the loss does not use are
        ignored. ``loss_mode``, ``clip_cov_*``, ``kl_cov_ratio``, ``ppo_kl_coef``, ``dro_beta`` and
        ``rollout_correction`` come from the nested ``policy_loss`` mapping, where verl keeps them;
        ``tau_pos`` / ``tau_neg`` from the actor section itself.
        ``overrides`` replace fields after reading (e.g. this mini-batch's ``batch_num_tokens``).
        """
        section = _as_mapping(mapping)
        for key in ("actor_rollout_ref", "actor"):
            inner = _get(section, key)
            if inner is not None:
                section = _as_mapping(inner)
        names = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for name in names:  # a flat LossConfig.to_dict() too; verl's nested policy_loss wins below
            value = _get(section, name, _MISSING)
            if value is not _MISSING:
                values[name] = value
        policy_loss = _get(section, "policy_loss")
        if policy_loss is not None:  # verl keeps these in actor.policy_loss (PolicyLossConfig)
            policy_loss = _as_mapping(policy_loss)
            for name in POLICY_LOSS_FIELDS:
                value = _get(policy_loss, name, _MISSING)
                if value is not _MISSING and value is not None:  # None: verl falls back to the default
                    values[name] = value
            rc = values.get("rollout_correction")
            if rc is not None:
                rc = _as_mapping(rc)
                values["rollout_correction"] = {
                    k: _get(rc, k)
                    for k in ROLLOUT_CORRECTION_DEFAULTS
                    if _get(rc, k, _MISSING) is not _MISSING
                }
        info = _get(section, "global_batch_info")
        if info is not None:
            for key in GLOBAL_BATCH_FIELDS:
                value = _get(_as_mapping(info), key, None)
                if value is not None:
                    values[key] = _plain(value)
        values.update(overrides)
        unknown = set(values) - names
        if unknown:
            raise ValueError(f"unknown LossConfig field(s) {sorted(unknown)}; allowed: {sorted(names)}")
        return cls(**values)


_MISSING = object()
NO_DUAL_CLIP = (
    1e30  # a dual-clip bound no ratio reaches (the ratio is capped at e^20): TRL/OpenRLHF have none
)
# verl's ActorConfig.global_batch_info: the per-mini-batch normalisers ``ppo_loss`` fills from the data
GLOBAL_BATCH_FIELDS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")
# LossConfig fields verl keeps in actor.policy_loss (PolicyLossConfig); the others sit in the actor section
POLICY_LOSS_FIELDS = (
    "loss_mode",
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_ratio",
    "ppo_kl_coef",
    "dro_beta",
    "rollout_correction",
)
# verl's RolloutCorrectionConfig defaults (the keys bypass_mode reads from policy_loss.rollout_correction)
ROLLOUT_CORRECTION_DEFAULTS: dict[str, Any] = {
    "loss_type": "ppo_clip",
    "rollout_is": "sequence",
    "rollout_is_threshold": 2.0,
    "rollout_is_batch_normalize": False,
    "rollout_rs": None,
    "rollout_rs_threshold": None,
    "bypass_mode": False,
}


def _plain(value: Any) -> Any:
    """A 0-dim tensor / numpy scalar (verl puts ``batch_num_tokens`` in as one) -> python number."""
    item = getattr(value, "item", None)
    return item() if callable(item) else value


def _as_mapping(obj: Any) -> Any:
    if isinstance(obj, Mapping) or hasattr(obj, "get"):
        return obj
    if hasattr(obj, "__dict__"):  # a plain dataclass / namespace
        return vars(obj)
    raise ValueError(f"config must be a mapping (dict, OmegaConf DictConfig or dataclass); got {type(obj)!r}")


def _get(section: Any, key: str, default: Any = None) -> Any:
    try:
        return section.get(key, default)
    except (KeyError, AttributeError):  # OmegaConf structured configs raise on unknown keys
        return default
