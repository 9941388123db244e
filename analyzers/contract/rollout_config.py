"""verl 0.9.1's rollout-correction settings (``algorithm.rollout_correction``) and its threshold
spellings, parsed and validated once; the computation is in :mod:`rlvitals.analyzers.reference.rollout`.

``rollout_is_threshold``: a number (TIS upper bound) or ``"lower_upper"`` (IcePop band).
``rollout_rs_threshold``: one value shared by every comma-separated ``rollout_rs`` option or one per
option; k1 options take ``"lower_upper"`` ratio bounds (``"U"`` alone means ``1/U .. U``), the others
one upper bound. Malformed values raise ``ValueError`` naming the option and the valid spellings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction`` (``RolloutCorrectionConfig``), the fields the math uses.

    ``rollout_is``: None (no weights), ``"token"`` or ``"sequence"``. ``rollout_is_threshold``: a number
    (TIS) or ``"lower_upper"`` (IcePop). ``rollout_rs``: None or comma-separated options of
    :data:`RS_OPTIONS`; ``rollout_rs_threshold``: required with it. ``bypass_mode``: verl uses the rollout
    log-probs as ``old_log_prob`` and corrects inside the loss instead, with ``loss_type`` ``"ppo_clip"`` or
    ``"reinforce"`` (recorded, not computed here).
    """

    rollout_is: str | None = None
    rollout_is_threshold: float | str = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    def __post_init__(self) -> None:
        if self.rollout_is is not None:
            if self.rollout_is not in IS_LEVELS:
                raise ValueError(f"rollout_is must be None, 'token' or 'sequence'; got {self.rollout_is!r}")
            parse_is_threshold(self.rollout_is_threshold)
        if not isinstance(self.rollout_is_batch_normalize, bool):
            raise ValueError(
                f"rollout_is_batch_normalize must be True or False; got {self.rollout_is_batch_normalize!r}"
            )
        if self.rollout_rs is not None:
            parse_rs_thresholds(rs_options(self.rollout_rs), self.rollout_rs_threshold)

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`rollout_correction`."""
        out = asdict(self)
        out.pop("bypass_mode")
        out.pop("loss_type")
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_verl(cls, mapping: Mapping[str, Any] | None) -> RolloutCorrectionConfig | None:
        """From a whole verl config (``algorithm.rollout_correction``), its ``algorithm`` section, or
        the ``rollout_correction`` section itself; None when there is none (verl applies no
        correction). Defaults are verl's yaml defaults (``rollout_is: null``)."""
        if not hasattr(mapping, "get"):
            return None
        section = None
        algorithm = mapping.get("algorithm")
        if hasattr(algorithm, "get"):
            section = algorithm.get("rollout_correction")
        if section is None:
            section = mapping.get("rollout_correction")
        if section is None and any(key in mapping for key in ("rollout_is", "rollout_rs")):
            section = mapping
        if not hasattr(section, "get"):
            return None
        return cls(**{k: section[k] for k in cls.__dataclass_fields__ if k in section})


def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """``2.0`` / ``"2.0"`` -> ``(2.0, None)`` (TIS); ``"0.5_2.0"`` -> ``(2.0, 0.5)`` (IcePop)."""
    if isinstance(spec, bool):
        raise ValueError("rollout_is_threshold must be a number or a 'lower_upper' string, not a boolean")
    if isinstance(spec, (int, float)):
        upper, lower = float(spec), None
    elif isinstance(spec, str) and spec.strip():
        text = spec.strip()
        try:
            if "_" in text:
                low, high = text.split("_", 1)
                lower, upper = float(low), float(high)
            else:
                upper, lower = float(text), None
        except ValueError:
            raise ValueError(f"invalid rollout_is_threshold {spec!r}") from None
    else:
        raise ValueError(f"rollout_is_threshold must be a number or a 'lower_upper' string; got {spec!r}")
    if upper <= 0:
        raise ValueError(f"rollout_is_threshold upper bound must be positive, got {upper}")
    if lower is not None and (lower <= 0 or lower > upper):
        raise ValueError(f"rollout_is_threshold needs 0 < lower <= upper; got {spec!r}")
    return upper, lower


def rs_options(rollout_rs: str) -> list[str]:
    if not isinstance(rollout_rs, str):
        raise ValueError(f"rollout_rs must be a comma-separated string of options; got {rollout_rs!r}")
    options: list[str] = []
    for part in rollout_rs.split(","):
        name = part.strip()
        if not name:
            continue
        if name not in RS_OPTIONS:
            raise ValueError(f"invalid rollout_rs option {name!r}; valid: {', '.join(RS_OPTIONS)}")
        if name not in options:
            options.append(name)
    if not options:
        raise ValueError("rollout_rs must name at least one option")
    return options


def parse_rs_thresholds(
    options: list[str], spec: float | str | None
) -> dict[str, tuple[float | None, float]]:
    """One ``(lower, upper)`` per option; lower only for k1 options (default ``1 / upper``)."""
    if spec is None:
        raise ValueError("rollout_rs_threshold must be provided with rollout_rs")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"rollout_rs_threshold must be a number or a string; got {spec!r}")
    raw = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(raw) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold needs one threshold for all options or one per option ({len(options)})"
        )
    raw = raw * len(options) if len(raw) == 1 else raw
    out: dict[str, tuple[float | None, float]] = {}
    for option, text in zip(options, raw, strict=True):
        try:
            if option.endswith("k1"):
                low, high = text.split("_", 1) if "_" in text else (None, text)
                upper = float(high)
                lower = float(low) if low is not None else 1.0 / upper
                if lower <= 0 or upper <= 0 or lower > upper:
                    raise ValueError(f"thresholds for {option!r} need 0 < lower <= upper; got {text!r}")
                out[option] = (lower, upper)
            else:
                if "_" in text:
                    raise ValueError(
                        f"rollout_rs_threshold for {option!r} takes one upper bound; got {text!r}"
                    )
                upper = float(text)
                if upper <= 0:
                    raise ValueError(f"threshold for {option!r} must be positive; got {text!r}")
                out[option] = (None, upper)
        except ValueError as exc:
            if "could not convert" in str(exc):
                raise ValueError(f"invalid threshold {text!r} for rollout_rs option {option!r}") from None
            raise
    return out
