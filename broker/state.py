"""Serialising the syncer's crash-safe state (msgpack + raw fp32 buffers, never pickle)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from broker.errors import DecodeError

_DTYPES = {"<f4", "<f8", "<i4", "<i8"}


def _enc(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        if a.dtype.str not in _DTYPES:
            a = a.astype(np.float32)
        # msgpack packs the buffer itself: one copy into the document, not two
        return {"__nd__": [a.dtype.str, list(a.shape), memoryview(a.reshape(-1)).cast("B")]}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {str(k): _enc(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_enc(v) for v in obj]
    return obj


def _dec(obj: Any) -> Any:
    if isinstance(obj, dict):
        if "__nd__" in obj:
            dtype, shape, buf = obj["__nd__"]
            if dtype not in _DTYPES:
                raise DecodeError(f"state: dtype {dtype!r} not allowed")
            a = np.frombuffer(buf, dtype=dtype)
            if a.size != int(np.prod(shape)):
                raise DecodeError("state: array size does not match its shape")
            return a.reshape(shape).copy()
        return {k: _dec(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_dec(v) for v in obj]
    return obj


def pack_state(state: dict) -> bytes:
    """msgpack document of a syncer `state_dict` (arrays as dtype, shape, raw bytes)."""
    return msgpack.packb(_enc(state), use_bin_type=True)


def unpack_state(blob: bytes) -> dict:
    try:
        obj = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise DecodeError(f"state: not a msgpack document: {e}") from e
    if not isinstance(obj, dict):
        raise DecodeError("state: expected a map")
    return _dec(obj)
