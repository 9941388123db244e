"""The one value every importer returns: a run's scalar history, its known config, and what it left out.

``History.points`` is ``[(step, {raw metric name: number})]`` in step order, with points logged at the same
step merged (train and validation lines, TRL's train and eval logs). ``History.config`` is the trainer
config the source revealed (verl's printed config and Hydra overrides), as dotted keys, or ``{}``.
:func:`unmapped_names` lists the metric names that no health signal reads, so ``rlvitals import``
can say what it ignored instead of ignoring it silently.
"""

from __future__ import annotations

import gzip
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlvitals.analyzers.health.runconfig import flatten_config
from rlvitals.analyzers.health.signals import signal_of

Point = tuple[int, dict[str, float | int]]


class ImportFormatError(ValueError):
    """A source file that is not what its importer reads; the message names the file and what is wrong."""


class MissingExtraError(ImportError):
    """An importer whose optional dependency is not installed; the message names the pip extra."""


@dataclass
class History:
    """A run's scalar history as read from one source (see the module docstring)."""

    kind: str
    points: list[Point] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.points = [(step, unscaled(metrics)) for step, metrics in self.points]

    @property
    def metric_names(self) -> set[str]:
        return {name for _, metrics in self.points for name in metrics}

    def unmapped(self) -> list[str]:
        return unmapped_names(self.metric_names)


# older verl consoles print some values in a unit named after them: ``actor/lr(1e-4):0.010`` is a learning
# rate of 0.010 x 1e-4 = 1e-06
_SCALED = re.compile(r"^(?P<name>.*\S)\s*\((?P<unit>1e[+-]?\d+)\)$")


def unscaled(metrics: dict[str, float | int]) -> dict[str, float | int]:
    """``metrics`` with every ``name(1e-4)`` entry as ``name`` in plain units (value x 1e-4)."""
    if not any(name.endswith(")") for name in metrics):
        return metrics
    out: dict[str, float | int] = {}
    for name, value in metrics.items():
        match = _SCALED.match(name)
        if match:
            name, value = match.group("name"), value * float(match.group("unit"))
        out[name] = value
    return out


def merge_points(points: Iterable[Point]) -> list[Point]:
    """Merge points that share a step (later values win), sorted by step."""
    merged: dict[int, dict[str, float | int]] = {}
    for step, metrics in points:
        if metrics:
            merged.setdefault(step, {}).update(metrics)
    return sorted(merged.items())


def number(text: str) -> float | int | None:
    """A logged value as a number: ``0.5``, ``-3``, ``nan``, ``inf``, ``np.float64(0.1)``, ``tensor(2.)``."""
    text = text.strip()
    for wrapper in ("np.float64(", "np.float32(", "np.int64(", "tensor(", "float(", "np.True_", "np.False_"):
        if text.startswith(wrapper):
            if wrapper in ("np.True_", "np.False_"):
                return int(wrapper == "np.True_")
            text = text[len(wrapper) :].rstrip(")").split(",")[0].strip()
            break
    lowered = text.lower()
    if lowered in ("nan", "+nan", "-nan"):
        return math.nan
    if lowered in ("inf", "+inf", "infinity"):
        return math.inf
    if lowered in ("-inf", "-infinity"):
        return -math.inf
    if lowered in ("true", "false"):
        return int(lowered == "true")
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return None


def config_value(text: str) -> Any:
    """A Hydra override value: numbers and booleans parsed, ``null`` as None, everything else a string."""
    text = text.strip().strip("'\"")
    if text.lower() in ("null", "none", "~"):
        return None
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    parsed = number(text)
    if parsed is None or (isinstance(parsed, float) and not math.isfinite(parsed)):
        return text
    return parsed


def flat(config: Mapping[str, Any]) -> dict[str, Any]:
    return flatten_config(config)


def unmapped_names(names: Iterable[str]) -> list[str]:
    """The metric names no health signal reads, sorted."""
    return sorted(name for name in set(names) if signal_of(name) is None)


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """The file's bytes; a ``*.gz`` file is decompressed."""
    raw = Path(path).read_bytes()
    if str(path).endswith(".gz"):
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise ImportFormatError(f"{path}: not a gzip file ({exc})") from exc
    return raw


def read_text(path: str | os.PathLike[str]) -> str:
    return read_bytes(path).decode("utf-8", errors="replace")
