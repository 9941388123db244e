"""Capturing one loss call's tensors for the audit: validate in the caller, copy off the GPU without a stall,
serialize to safetensors in the background thread.

In the caller (``capture``): shapes and types are checked (misuse raises at once); a CUDA tensor is copied
with ``non_blocking=True`` into pinned host memory and one CUDA event per device is recorded on the current
stream — the training stream never waits. CPU tensors and numpy arrays are copied (the trainer may reuse
its buffers). In the background thread (``CapturedBatch.serialize``): wait for the events, then write the
safetensors bytes the HTTP API takes (never pickle). Tensors, all ``(batch, response_len)`` except
``group_index`` ``(batch,)`` int64:

    log_prob, old_log_prob, advantages, response_mask       required
    ref_log_prob, entropy, token_level_rewards              optional
    rollout_is_weights                                      optional (the IS weights the loss applied)
    rollout_log_probs                                       optional (the rollout engine's log-probs,
                                                            verl's name; audits rollout correction)
    teacher_log_probs                                       optional (a distillation teacher's log-probs
                                                            of the sampled tokens; audits distillation/*)
    group_index                                             optional (ints, or verl's uid strings)

The names and which tensor needs which come from the batch contract's rule table
(``rlvitals.analyzers.contract.batch_rules``, pure Python: the server checks the same table), and the config
is parsed by the contract's ``parse_config`` (misuse raises here, in the caller).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Mapping
from typing import Any

from rlvitals.analyzers.contract import batch_rules as rules
from rlvitals.client.values import DeviceScalar, check_metrics, copy_device_scalars, encode_value

REQUIRED, OPTIONAL, ALL_NAMES = rules.REQUIRED, rules.OPTIONAL, rules.ALLOWED


class CapturedBatch:
    """Host copies (possibly still in flight) of one micro-batch, plus its metadata strings."""

    __slots__ = ("events", "metadata", "micro_batch", "nbytes", "rank", "reported", "step", "tensors")

    def __init__(self, step, rank, micro_batch, tensors, events, metadata, reported) -> None:
        self.step = step
        self.rank = rank
        self.micro_batch = micro_batch
        self.tensors = tensors
        self.events = events
        self.metadata = metadata
        self.reported = reported
        self.nbytes = sum(int(t.nbytes) for t in tensors.values())

    def serialize(self) -> list[bytes]:
        """safetensors bytes (in chunks of at most 1 MiB) with string metadata ``step``, ``config``,
        ``reported``, ``rank``, ``micro_batch``, ``record_id``.
        """
        for event in self.events:
            event.synchronize()
        reported = {name: encode_value(value) for name, value in self.reported.items()}
        metadata = {**self.metadata, "reported": json.dumps(reported, allow_nan=False)}
        return encode_safetensors(self.tensors, metadata)


CHUNK_BYTES = 1 << 20
_CODES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def _flat_bytes(value: Any) -> tuple[str, list[int], Any]:
    """(safetensors dtype code, shape, flat uint8 numpy view) of a CPU tensor or array."""
    if _is_tensor(value):
        import torch

        tensor = value.contiguous()
        code = _CODES.get(str(tensor.dtype).removeprefix("torch."))
        flat = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""
    else:
        import numpy as np

        array = np.ascontiguousarray(value)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        code = _CODES.get(array.dtype.name)
        flat = array.reshape(-1).view(np.uint8)
    if code is None:
        raise TypeError(f"dtype {value.dtype} cannot be sent as safetensors")
    return code, list(value.shape), flat


def encode_safetensors(tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> list[bytes]:
    """The safetensors file format (8-byte header length, JSON header, raw little-endian data), as a
    list of chunks. Written here rather than with ``safetensors.torch.save`` because that holds the GIL
    for the whole copy (~7 ms for 6 MB), which would stall the trainer thread; each chunk here is one
    short copy. The official parser reads it back (tests check).
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    flats = []
    offset = 0
    for name in sorted(tensors):
        code, shape, flat = _flat_bytes(tensors[name])
        size = len(flat)
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + size]}
        flats.append(flat)
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    chunks = [struct.pack("<Q", len(head)) + head]
    for flat in flats:
        view = memoryview(flat)
        for start in range(0, len(view), CHUNK_BYTES):
            chunks.append(view[start : start + CHUNK_BYTES].tobytes())
    return chunks


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _is_array(value: Any) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


def _config_json(config: Any) -> str:
    if config is None:
        return "{}"
    if hasattr(config, "to_dict") and callable(config.to_dict):
        data = config.to_dict()
    elif isinstance(config, Mapping):
        data = _parsed_config(dict(config))
    else:
        raise TypeError(f"config must be a LossConfig or a dict, got {type(config).__name__}")
    try:
        return json.dumps(data, allow_nan=False, default=str)
    except ValueError as exc:
        raise ValueError(f"config is not JSON-serialisable: {exc}") from None


def _parsed_config(data: dict[str, Any]) -> dict[str, Any]:
    """A config mapping through the batch contract's one parse (``parse_config``: verl's actor
    section, or a TRL batch's settings, plus verl's ``algorithm`` and ``distillation`` sections), as the
    server will read it; misuse (bad values) raises here, in the caller. Without torch the server
    validates instead."""
    try:
        from rlvitals.analyzers.contract.batch import ConfigError, parse_config, parse_distillation

        loss, algorithm = parse_config(data)
        distillation = parse_distillation(data)
    except (
        ImportError
    ):  # no torch here: the loss fields still checked (pure Python), the server does the rest
        from rlvitals.analyzers.contract.config import LossConfig

        out = LossConfig.from_verl(data).to_dict()
        for name in ("algorithm", "distillation"):
            section = data.get(name)
            if isinstance(section, Mapping):
                out[name] = dict(section)
        return out
    except ConfigError as exc:  # the parser's own exception (TypeError / ValueError), as before
        raise exc.__cause__ from None
    out = loss.to_dict()
    if algorithm.present:
        out["algorithm"] = algorithm.to_dict()
    if distillation is not None:
        out["distillation"] = distillation.to_dict()
    return out


def _group_ids(value: Any, batch: int, pending_cuda: dict):
    import numpy as np

    if _is_tensor(value):
        import torch

        if value.dim() != 1 or value.shape[0] != batch:
            raise ValueError(f"group_index must have shape ({batch},), got {tuple(value.shape)}")
        if value.is_floating_point() or value.is_complex():
            raise TypeError(f"group_index must hold integers, got {value.dtype}")
        return _copy_to_host(value.detach().to(torch.int64), pending_cuda)
    array = np.asarray(value)
    if array.ndim != 1 or array.shape[0] != batch:
        raise ValueError(f"group_index must have shape ({batch},), got {array.shape}")
    if array.dtype.kind in "iub":
        return array.astype(np.int64, copy=True)
    if array.dtype.kind in "OUS":  # verl's uid strings: one int64 id per distinct uid
        _, inverse = np.unique(array.astype(str), return_inverse=True)
        return inverse.astype(np.int64).reshape(batch)
    raise TypeError(f"group_index must hold integers or uid strings, got {array.dtype}")


def capture(
    *,
    step: int,
    rank: int,
    micro_batch: int,
    tensors: Mapping[str, Any],
    config: Any,
    reported: Any,
) -> CapturedBatch:
    """Validate and copy one micro-batch; never blocks on the GPU. Raises TypeError/ValueError on misuse."""
    reported_values, deferred = check_metrics({} if reported is None else reported)
    config_json = _config_json(config)
    host: dict[str, Any] = {}
    pending_cuda: dict[Any, None] = {}
    try:  # the batch contract's rules (metadata only), before anything is copied
        batch_size, _ = rules.token_shape(
            tensors, accepted=lambda v: _is_tensor(v) or _is_array(v), kinds="torch.Tensor or numpy.ndarray"
        )
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"log_batch: {exc}") from None
    for name in rules.TOKEN_TENSORS:
        value = tensors.get(name)
        if value is not None:
            host[name] = _copy_to_host(value, pending_cuda)
    if tensors.get(rules.GROUP_INDEX) is not None:
        partner = rules.missing_partner([*host, rules.GROUP_INDEX])
        if partner:
            raise TypeError(f"log_batch: {partner}")
        host["group_index"] = _group_ids(tensors["group_index"], batch_size, pending_cuda)
    events = []
    if pending_cuda:
        import torch

        for device in pending_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
    reported_all: dict[str, Any] = dict(reported_values)
    if deferred:
        scalars: dict[str, DeviceScalar] = copy_device_scalars(deferred)
        reported_all.update(scalars)
    metadata = {
        "step": str(step),
        "config": config_json,
        "rank": str(rank),
        "micro_batch": str(micro_batch),
        "record_id": f"{os.getpid():x}-{os.urandom(6).hex()}",
    }
    return CapturedBatch(step, rank, micro_batch, host, events, metadata, reported_all)


def _cpu_copy(tensor: Any) -> Any:
    """A contiguous copy on the calling thread. ``Tensor.clone`` splits the copy across torch's intra-op
    threads, and on a busy machine waiting for the second one costs milliseconds; numpy's copy does not.
    """
    import torch

    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: copy the bits
        return torch.from_numpy(tensor.view(torch.int16).numpy().copy()).view(torch.bfloat16)
    return torch.from_numpy(tensor.numpy().copy())


def _copy_to_host(value: Any, pending_cuda: dict) -> Any:
    if _is_array(value):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"log_batch: numpy dtype {value.dtype} is not numeric")
        import numpy as np

        return np.array(value, copy=True, order="C")
    import torch

    source = value.detach()
    if source.is_complex():
        raise TypeError("log_batch: complex tensors are not supported")
    if source.device.type == "cpu":
        return _cpu_copy(source)
    if source.device.type == "cuda":
        host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        host.copy_(source, non_blocking=True)
        pending_cuda[source.device] = None
        return host
    return source.to("cpu")  # other accelerators: a synchronous copy (no pinned-memory path)
