"""Serialising the syncer's crash-safe state (msgpack + raw fp32 buffers, never pickle).

The document is a map of a :meth:`pipeline.syncer.FragmentSyncer.state_dict` (``history``
optional: the distributed syncer keeps it as per-version snapshots), arrays as
``{"__nd__": [dtype, shape, raw bytes]}``. :func:`unpack_state` reads exactly that schema back,
checking every value and every array's size before any array is built, and raises
:class:`~broker.errors.DecodeError` for anything else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from broker.errors import DecodeError
from broker.untrusted import (
    M_INT,
    M_NUM,
    MBin,
    MDict,
    MList,
    MMap,
    MScalar,
    MStr,
    MTuple,
    unpack_checked,
)
from pipeline.limits import MAX_FRAGMENT, MAX_LEARNER_ID, MAX_NAME, MAX_NDIM, MAX_TENSORS

_DTYPES = {"<f4", "<f8", "<i4", "<i8"}
_F32 = "<f4"
_MAX_NDIM = MAX_NDIM
_MAX_TENSORS = MAX_TENSORS
_MAX_NAME = MAX_NAME
_MAX_FRAGMENT = MAX_FRAGMENT
_MAX_INT = 2**63 - 1
_MAX_HISTORY = 4096
_MAX_SEEN = 2**20
_MAX_NORMS = 4096
_MAX_LEARNER = MAX_LEARNER_ID

_ND = MMap({"__nd__": MTuple(MStr(8, _DTYPES), MList(M_INT, _MAX_NDIM), MBin())})
_TENSORS = MDict(_MAX_NAME, _ND, _MAX_TENSORS)
_SCHEMA = MMap(
    required={
        "fragment": M_INT,
        "version": M_INT,
        "theta": _TENSORS,
        # optax state leaves: per-tensor buffers (momentum: one per tensor) and scalar counts
        "momentum": MList(_ND, 4 * _MAX_TENSORS + 16),
        "seen": MList(MTuple(MStr(_MAX_LEARNER), M_INT, M_INT), _MAX_SEEN),
        "sync_time_s": M_NUM,
    },
    optional={
        "history": MDict(20, _TENSORS, _MAX_HISTORY),
        "norms": MList(M_NUM, _MAX_NORMS),
        # [learner, epoch, base_version, step, steps, tokens, seconds, chain or nil] of each
        # learner's last merged push, least recently merged first
        "merged_pushes": MList(MTuple(MStr(_MAX_LEARNER), M_INT, M_INT, M_INT, M_INT, M_INT,
                                      M_NUM, MScalar("int", "nil")), _MAX_SEEN),
        # the learners whose last push (`final`) a round merged, first merged first
        "finished": MList(MStr(_MAX_LEARNER), _MAX_SEEN),
        # the same rows without the chain: a state written before chains
        "merged_last": MList(MTuple(MStr(_MAX_LEARNER), M_INT, M_INT, M_INT, M_INT, M_INT,
                                    M_NUM), _MAX_SEEN),
    },
)


def _enc(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)  # a 0-d array comes back 1-d: the shape is obj's
        if a.dtype.str not in _DTYPES:
            a = a.astype(np.float32)
        # msgpack packs the buffer itself: one copy into the document, not two
        return {"__nd__": [a.dtype.str, list(obj.shape), memoryview(a.reshape(-1)).cast("B")]}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {str(k): _enc(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_enc(v) for v in obj]
    return obj


def pack_state(state: dict) -> memoryview:
    """msgpack document of a syncer `state_dict` (arrays as dtype, shape, raw bytes), as a
    view of the packer's own buffer: a state is most of a fragment's bytes twice over, and
    ``packb`` would copy that buffer once more into its result."""
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    packer.pack(_enc(state))
    return packer.getbuffer()


def _int(v: Any, what: str, hi: int = _MAX_INT) -> int:
    # the scan made every one an int; bool is a msgpack kind of its own
    if not 0 <= v <= hi:
        raise DecodeError(f"state: {what} must be an int in [0, {hi}], got {v}")
    return int(v)


def _float(v: Any, what: str) -> float:
    """A float >= 0 (an int only if its float is exact: the value is not changed)."""
    try:
        x = float(v)
    except OverflowError:
        x = math.inf
    if not (math.isfinite(x) and x >= 0 and x == v):
        raise DecodeError(f"state: {what} must be a finite number >= 0, got {v!r:.40}")
    return x


def _shape(nd: dict, what: str) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype, shape, buffer) of an array, its size checked with Python ints (no array yet)."""
    dtype, shape, buf = nd["__nd__"]
    if dtype not in _DTYPES:
        raise DecodeError(f"state: {what}: dtype {dtype[:8]!r} not allowed")
    if not all(0 <= d <= _MAX_INT for d in shape):
        raise DecodeError(f"state: {what}: bad shape {shape}")
    shape = tuple(shape)
    if math.prod(shape) * np.dtype(dtype).itemsize != len(buf):
        raise DecodeError(f"state: {what}: {len(buf)} bytes do not hold a {dtype} array of "
                          f"shape {shape}")
    return dtype, shape, buf


def _array(dtype: str, shape: tuple[int, ...], buf: bytes) -> np.ndarray:
    """A read-only array over the document's buffer (no copy: a fragment's Θ and momentum
    are most of a state's bytes; the syncer replaces them at its next round)."""
    a = np.frombuffer(buf, dtype=dtype).reshape(shape)
    a.flags.writeable = False
    return a


def _check_tensors(raw: dict, shapes: Mapping[str, tuple[int, ...]], what: str) -> None:
    """`raw` must hold fp32 arrays of exactly `shapes`."""
    if raw.keys() != shapes.keys():
        extra, missing = sorted(raw.keys() - shapes.keys()), sorted(shapes.keys() - raw.keys())
        raise DecodeError(f"state: {what} must hold the tensors of theta: unexpected "
                          f"{[k[:64] for k in extra[:4]]}, missing {missing[:4]}")
    for name, nd in raw.items():
        dtype, shape, _ = _shape(nd, f"{what}[{name[:64]!r}]")
        if shape == (1,) and shapes[name] == ():
            shape = ()  # written before pack_state kept 0-d shapes
        if dtype != _F32 or shape != shapes[name]:
            raise DecodeError(f"state: {what}[{name[:64]!r}] is {dtype} {shape}, expected "
                              f"{_F32} {shapes[name]}")


def _build_tensors(raw: dict, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The (checked) arrays of `raw`, in its order; each buffer is released from `raw` as its
    array is built, so a document's buffers and its arrays are not all held at once."""
    return {name: _array(_F32, shapes[name], _shape(raw.pop(name), name)[2])
            for name in list(raw)}


def unpack_state(blob: bytes, *, max_bytes: int | None = None,
                 shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict:
    """Decode :func:`pack_state`'s document of a syncer state.

    Returns exactly what :meth:`pipeline.syncer.FragmentSyncer.from_state_dict` reads:
    ``fragment`` and ``version`` (ints), ``theta`` (name → fp32 array), ``momentum`` (a list
    of arrays: each of a theta tensor's shape, fp32, or a scalar), ``seen`` (a list of
    ``[learner, base_version, step]``), ``sync_time_s`` (a float), and when the document
    holds them ``history`` (version text → name → fp32 array, the tensors of theta) and
    ``norms`` (a list of floats) and ``merged_pushes`` (a list of ``[learner, epoch,
    base_version, step, steps, tokens, seconds, chain]``, chain an int or None; a state
    written before chains holds ``merged_last``, the same rows without the chain, which come
    back as ``merged_pushes`` with chain None), and ``finished`` (a list of learner names).
    Arrays are read-only views of the decoded document's buffers (no copies).

    Args:
        blob: The document.
        max_bytes: Largest accepted ``len(blob)``, checked before decoding (None: no limit).
        shapes: When given, theta must hold exactly these tensors with these shapes.

    Raises:
        DecodeError: On any other document (checked before any array is built).
    """
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise DecodeError(f"state must be bytes, got {type(blob).__name__}")
    if max_bytes is not None and len(blob) > max_bytes:
        raise DecodeError(f"state of {len(blob)} bytes exceeds the limit of {max_bytes}")
    doc = unpack_checked(blob, _SCHEMA, "state")
    out: dict[str, Any] = {
        "fragment": _int(doc["fragment"], "fragment", _MAX_FRAGMENT),
        "version": _int(doc["version"], "version"),
    }
    theta = doc["theta"]
    if shapes is None:
        want = {name: _shape(nd, f"theta[{name[:64]!r}]")[1] for name, nd in theta.items()}
    else:
        want = {str(k): tuple(int(d) for d in v) for k, v in shapes.items()}
    _check_tensors(theta, want, "theta")
    momentum = doc["momentum"]
    allowed = set(want.values()) | {(), (1,)}  # (1,): a scalar before 0-d shapes were kept
    if len(momentum) > 4 * len(want) + 16:
        raise DecodeError(f"state: {len(momentum)} momentum arrays for {len(want)} tensors")
    for i, nd in enumerate(momentum):
        dtype, shape, _ = _shape(nd, f"momentum[{i}]")
        if shape not in allowed or (shape not in ((), (1,)) and dtype != _F32):
            raise DecodeError(f"state: momentum[{i}] is {dtype} {shape}: neither a theta "
                              f"tensor's (fp32) nor a scalar")
    history = doc.get("history")
    for v, h in (history or {}).items():
        if not (v.isascii() and v.isdigit()) or int(v) > _MAX_INT:
            raise DecodeError(f"state: history version {v[:24]!r} is not a decimal int")
        _check_tensors(h, want, f"history[{v}]")
    seen = [[learner, _int(base, "seen base_version"), _int(step, "seen step")]
            for learner, base, step in doc["seen"]]
    if not all(learner for learner, _, _ in seen):
        raise DecodeError("state: seen holds an empty learner name")
    sync_time_s = _float(doc["sync_time_s"], "sync_time_s")
    norms = None if "norms" not in doc else [_float(x, "norms") for x in doc["norms"]]
    merged = None
    if "merged_pushes" in doc or "merged_last" in doc:
        rows = doc.get("merged_pushes", [[*row, None] for row in doc.get("merged_last", ())])
        merged = [
            [learner, *(_int(v, f"merged_pushes {what}") for v, what in zip(
                row, ("epoch", "base_version", "step", "steps", "tokens"), strict=True)),
             _float(secs, "merged_pushes seconds"),
             None if chain is None else _int(chain, "merged_pushes chain")]
            for learner, *row, secs, chain in rows]
        if not all(row[0] for row in merged):
            raise DecodeError("state: merged_pushes holds an empty learner name")
    finished = doc.get("finished")
    if finished is not None and not all(finished):
        raise DecodeError("state: finished holds an empty learner name")
    # every check passed: build the arrays
    out["theta"] = _build_tensors(theta, want)
    out["momentum"] = []
    for i, nd in enumerate(momentum):
        momentum[i] = None
        out["momentum"].append(_array(*_shape(nd, "momentum")))
    if history is not None:
        out["history"] = {v: _build_tensors(history.pop(v), want) for v in list(history)}
    out["seen"] = seen
    out["sync_time_s"] = sync_time_s
    if norms is not None:
        out["norms"] = norms
    if merged is not None:
        out["merged_pushes"] = merged
    if finished is not None:
        out["finished"] = list(finished)
    return out
