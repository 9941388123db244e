"""What every trainer's reader shares: reading a field of a live config object (a ``Mapping``, a
dataclass, an OmegaConf ``DictConfig``) and reading a run's config, flattened to dotted keys."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def _items(section: Any) -> Any:
    if isinstance(section, Mapping):
        return dict(section).items()
    if hasattr(section, "__dataclass_fields__"):
        return ((name, getattr(section, name, None)) for name in section.__dataclass_fields__)
    if hasattr(section, "items"):
        return section.items()
    return ()


def config_get(config: Any, name: str) -> Any:
    if config is None:
        return None
    if isinstance(config, Mapping) or hasattr(config, "get"):
        try:
            return config.get(name)
        except (KeyError, AttributeError, TypeError):
            pass
    return getattr(config, name, None)


def plain_scalar(value: Any) -> Any:
    """A 0-dim tensor (verl puts ``batch_num_tokens`` in as one) as its python number."""
    if hasattr(value, "item") and hasattr(value, "shape"):
        return value.item()
    return value


def flatten_config(config: Mapping[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}} -> {"a.b": 1}``; keeps str/int/float/bool/None leaves, drops everything else."""
    flat: dict[str, Any] = {}
    if config is None:
        return flat
    items = config.items() if hasattr(config, "items") else ()
    for key, value in items:
        name = f"{prefix}{key}"
        if hasattr(value, "items"):  # dict, OmegaConf DictConfig
            flat.update(flatten_config(value, name + "."))
        elif (
            value is None
            or isinstance(value, (str, bool, int))
            or (isinstance(value, float) and math.isfinite(value))
        ):
            flat[name] = value
    return flat


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(number) or number < 1 or number != int(number):
        return None
    return int(number)


def _positive_float(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number > 0 else None


def _first_positive(flat: Mapping[str, Any], keys: tuple[tuple[str, str], ...]) -> tuple[float | None, str]:
    for key, source in keys:
        number = _positive_float(flat.get(key))
        if number is not None:
            return number, source
    return None, "not in the run config"
