"""Scalar values: checking them in the caller (cheap, raises on misuse) and encoding them for the API.

The caller side (``check_metrics``) keeps python numbers as they are, turns numpy and CPU torch scalars
into python numbers, and leaves a GPU scalar as a ``DeviceScalar`` whose copy to pinned host memory is
already queued on the GPU stream (the background thread reads it; the trainer never waits for the GPU).
The background side (``encode_value``) spells non-finite floats the way the HTTP API accepts them:
``"NaN"``, ``"Infinity"``, ``"-Infinity"``.
"""

from __future__ import annotations

import math
import numbers
import operator
import sys
from typing import Any

from rlvitals.analyzers.contract.batch_rules import NAN, NEG_INF, POS_INF  # the one spelling table


class DeviceScalar:
    """A one-element GPU tensor copied (non-blocking) into pinned host memory; ``event`` marks completion."""

    __slots__ = ("event", "host")

    def __init__(self, host: Any, event: Any) -> None:
        self.host = host
        self.event = event

    def resolve(self) -> float:
        if self.event is not None:
            self.event.synchronize()
        return float(self.host.item())


def check_step(step: Any) -> int:
    """``step`` as a non-negative python int (python/numpy/torch integers); misuse raises at once."""
    if isinstance(step, (bool, float)):
        raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}")
    try:
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an int, got {type(step).__name__}") from None
    if value < 0:
        raise ValueError(f"step must be >= 0, got {value}")
    return value


def check_metrics(metrics: Any) -> tuple[dict[str, Any], list[tuple[str, Any]] | None]:
    """Validate ``{name: scalar}``; returns (plain values, GPU tensors still to copy or None).

    Accepted values: python ``int``/``float``/``bool``, ``None`` (stored as null), numpy scalars and
    one-element arrays, one-element torch tensors on any device. Anything else raises ``TypeError``.
    """
    if not isinstance(metrics, dict):
        raise TypeError(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
    out: dict[str, Any] = {}
    deferred: list[tuple[str, Any]] | None = None
    for name, value in metrics.items():
        if type(name) is not str or not name:
            raise TypeError(f"metric names must be non-empty str, got {name!r}")
        kind = type(value)
        if kind is float or kind is int or value is None:
            out[name] = value
        elif kind is bool:
            out[name] = int(value)
        else:
            converted = _convert(name, value)
            if converted is _DEFER:
                if deferred is None:
                    deferred = []
                deferred.append((name, value))
            else:
                out[name] = converted
    return out, deferred


_DEFER = object()


def _convert(name: str, value: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"metric {name!r}: tensor with {value.numel()} elements is not a scalar")
        if value.is_complex():
            raise TypeError(f"metric {name!r}: complex tensors are not scalars")
        if value.device.type == "cpu":
            return value.item()
        return _DEFER
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, (numpy.generic, numpy.ndarray)):
        if value.size != 1 or value.dtype.kind not in "biuf":
            raise TypeError(f"metric {name!r}: numpy {value.dtype} of size {value.size} is not a real scalar")
        return value.item()
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {name!r}: expected a number, got {type(value).__name__}")


def copy_device_scalars(deferred: list[tuple[str, Any]]) -> dict[str, DeviceScalar]:
    """Queue non-blocking copies of GPU scalars into pinned host memory; one CUDA event marks them all.

    Other accelerators (mps, xpu): a device-side clone, read by the background thread.
    """
    import torch

    out: dict[str, DeviceScalar] = {}
    events: dict[Any, Any] = {}
    for name, tensor in deferred:
        source = tensor.detach().reshape(())
        if source.device.type == "cuda":
            host = torch.empty((), dtype=source.dtype, pin_memory=True)
            host.copy_(source, non_blocking=True)
            out[name] = DeviceScalar(host, source.device)
            events.setdefault(source.device, None)
        else:
            out[name] = DeviceScalar(source.clone(), None)
    for device in events:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events[device] = event
    for scalar in out.values():
        if scalar.event is not None:
            scalar.event = events[scalar.event]
    return out


def encode_value(value: Any) -> Any:
    """A JSON-safe API value: finite numbers as-is, non-finite as strings, None as null."""
    if isinstance(value, DeviceScalar):
        value = value.resolve()
    if value is None or type(value) is int:
        return value
    value = float(value)
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return NAN
    return POS_INF if value > 0 else NEG_INF


def decode_value(value: Any) -> float | None:
    """The inverse of ``encode_value`` (for tests and the spool reader)."""
    if value is None:
        return None
    if isinstance(value, str):
        return {NAN: math.nan, POS_INF: math.inf, NEG_INF: -math.inf}[value]
    return float(value)
