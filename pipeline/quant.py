"""Quantisation of outer gradients: the fp32 / bf16 / int8 / int4 tensor codecs.

This module owns the numeric side of compression: turning a float32 tensor into a
:class:`QTensor` (a codec name, the original shape, a flat payload array and, for the
integer codecs, per-block float32 scales) and back, plus the worst-case error bound of
each codec. It is pure numpy: no jax, no I/O, no clocks, no randomness. Serialising a
:class:`QTensor` to bytes is the job of :mod:`broker.codec`.

Codecs:

* ``fp32``: lossless; ``data`` is the flattened float32 tensor.
* ``bf16``: ``data`` is uint16, the upper half of the float32 bit pattern after
  round-to-nearest-even on the lower half. Values whose rounding would overflow to
  infinity saturate to the largest finite bf16 (``±3.3895e38``).
* ``int8``: symmetric absmax quantisation per block of ``block`` consecutive elements of
  the flattened tensor: ``scale = absmax / 127``, ``q = rint(x * 127 / absmax)`` in
  ``[-127, 127]``, decoded as ``q * scale``.
* ``int4``: as ``int8`` with ``qmax = 7``; the values ``-7..7`` are stored as 4-bit
  two's complement nibbles, two per byte, element ``2i`` in the low nibble and element
  ``2i + 1`` in the high nibble of byte ``i``; an odd element count leaves the last high
  nibble zero.

For the integer codecs a block whose absmax is 0 gets scale 0 and decodes to zeros. A
block whose absmax is below ``2**-118`` (about ``3.3e-36``) is flushed the same way: it
gets scale 0 and decodes to zeros, so its error is its own absmax. Above that threshold
both ``qmax / absmax`` and ``absmax / qmax`` are normal float32 numbers, which keeps the
arithmetic free of overflow and subnormal precision loss.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

CODECS = ("fp32", "bf16", "int8", "int4")
DEFAULT_BLOCK = 64

_QMAX = {"int8": 127, "int4": 7}
_DATA_DTYPE = {
    "fp32": np.dtype("<f4"),
    "bf16": np.dtype("<u2"),
    "int8": np.dtype("|i1"),
    "int4": np.dtype("|u1"),
}
_FLT_MAX = float(np.finfo(np.float32).max)
# Integer-codec blocks with absmax below this are flushed to zero (see module docstring).
_FLUSH_BELOW = 2.0**-118
# Relative slack of the integer-codec bound: covers float32 rounding of the scale, of
# x * (qmax / absmax) and of q * scale (a few 2**-24 relative each).
_REL_SLACK = 1e-6
# Absolute slack of the bf16 bound: half the spacing of bf16 subnormals (2**-133).
_BF16_ABS_SLACK = 2.0**-134
_BF16_MAX_BITS = 0x7F7F


class QTensor(NamedTuple):
    """A quantised tensor.

    Attributes:
        codec: One of :data:`CODECS`.
        shape: The original tensor shape.
        data: 1-D payload: float32 (fp32), uint16 (bf16), int8 (int8) or uint8 holding
            two 4-bit two's complement values per byte (int4).
        scales: float32, one per block (int8/int4); ``None`` for fp32/bf16.
        block: The block size used (0 for fp32/bf16).
    """

    codec: str
    shape: tuple[int, ...]
    data: np.ndarray
    scales: np.ndarray | None
    block: int


def data_nbytes(codec: str, n: int) -> int:
    """Return the payload byte length of an ``n``-element tensor under ``codec``."""
    _check_codec(codec)
    if codec == "int4":
        return (n + 1) // 2
    return n * _DATA_DTYPE[codec].itemsize


def num_blocks(n: int, block: int) -> int:
    """Return ``ceil(n / block)``, the number of scales of an ``n``-element tensor."""
    return -(-n // block)


def _check_codec(codec: object) -> None:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")


def _check_block(block: object) -> int:
    if isinstance(block, bool) or not isinstance(block, int | np.integer) or block < 1:
        raise ValueError(f"block must be a positive integer, got {block!r}")
    return int(block)


def _as_float32(x: np.ndarray) -> np.ndarray:
    """Return ``x`` as a C-contiguous float32 array (no copy when it already is one)."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"cannot quantise an array of dtype {arr.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(arr, dtype=np.float32, order="C")


def _block_absmax(flat: np.ndarray, block: int) -> np.ndarray:
    """Per-block max of ``|flat|`` as float32; the last block may be partial."""
    n = flat.size
    full = n // block
    out = np.empty(num_blocks(n, block), dtype=np.float32)
    head = flat[: full * block].reshape(full, block)
    if full:
        np.max(np.abs(head), axis=1, out=out[:full])
    if n > full * block:
        out[full] = np.max(np.abs(flat[full * block :]))
    return out


def _per_block(values: np.ndarray, n: int, block: int, dtype: np.dtype, fn) -> np.ndarray:
    """Apply ``fn(chunk_2d, row_slice)`` to the full blocks and the tail of ``values``.

    Returns a flat array of ``n`` elements of ``dtype``; avoids padding copies.
    """
    out = np.empty(n, dtype=dtype)
    full = n // block
    if full:
        out[: full * block].reshape(full, block)[...] = fn(
            values[: full * block].reshape(full, block), slice(0, full)
        )
    if n > full * block:
        out[full * block :].reshape(1, -1)[...] = fn(
            values[full * block :].reshape(1, -1), slice(full, full + 1)
        )
    return out


def _quantize_int(flat: np.ndarray, codec: str, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(q as int8 of flat.size elements, float32 scales)``."""
    qmax = _QMAX[codec]
    absmax = _block_absmax(flat, block)
    if not np.isfinite(absmax).all():
        raise ValueError(f"cannot quantise non-finite values with codec {codec!r}")
    live = absmax >= np.float32(_FLUSH_BELOW)
    safe = np.where(live, absmax, np.float32(1.0))
    inv = np.where(live, np.float32(qmax) / safe, np.float32(0.0)).astype(np.float32)
    scales = np.where(live, safe / np.float32(qmax), np.float32(0.0)).astype(np.float32)
    # q * scale must never overflow float32 on decode.
    too_big = scales.astype(np.float64) * qmax > _FLT_MAX
    if too_big.any():
        scales[too_big] = np.nextafter(scales[too_big], np.float32(0.0))

    def quant(chunk: np.ndarray, rows: slice) -> np.ndarray:
        t = chunk * inv[rows, None]
        np.rint(t, out=t)
        np.clip(t, -qmax, qmax, out=t)
        return t

    return _per_block(flat, flat.size, block, np.dtype(np.int8), quant), scales


def _pack_int4(q: np.ndarray) -> np.ndarray:
    """Pack int8 values in ``[-8, 7]`` into uint8 nibbles, low nibble first."""
    u = q.view(np.uint8)
    n = u.size
    packed = np.empty((n + 1) // 2, dtype=np.uint8)
    np.bitwise_and(u[0::2], 0x0F, out=packed)
    if n > 1:
        packed[: n // 2] |= u[1::2] << 4
    return packed


def _unpack_int4(data: np.ndarray, n: int) -> np.ndarray:
    """Unpack ``n`` signed 4-bit values (two's complement) from ``data`` into int8."""
    out = np.empty(2 * data.size, dtype=np.uint8)
    np.bitwise_and(data, 0x0F, out=out[0::2])
    np.right_shift(data, 4, out=out[1::2])
    # Sign-extend the nibble: (v ^ 8) - 8.
    out ^= 0x08
    signed = out.view(np.int8)
    signed -= 8
    return signed[:n]


def _bf16_bits(flat: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 (nearest, ties to even) and return the uint16 bit patterns."""
    u = flat.view(np.uint32)
    r = u + (((u >> 16) & np.uint32(1)) + np.uint32(0x7FFF))
    r >>= 16
    bits = r.astype(np.uint16)
    overflow = (bits & np.uint16(0x7F80)) == np.uint16(0x7F80)
    if overflow.any():
        bits[overflow] = (bits[overflow] & np.uint16(0x8000)) | np.uint16(_BF16_MAX_BITS)
    return bits


def quantize(x: np.ndarray, codec: str, block: int = DEFAULT_BLOCK) -> QTensor:
    """Quantise a tensor.

    Args:
        x: The tensor, any shape (0-d and empty included). float32 is expected; other
            real dtypes are converted to float32 first.
        codec: One of :data:`CODECS`.
        block: Block size of the integer codecs (ignored for fp32/bf16).

    Returns:
        The quantised tensor; its arrays never share memory with ``x``.

    Raises:
        ValueError: If the codec is unknown, ``block`` is not a positive integer (integer
            codecs), or ``x`` holds NaN or infinity.
    """
    _check_codec(codec)
    arr = _as_float32(x)
    shape = tuple(int(d) for d in arr.shape)
    flat = arr.reshape(-1)
    if codec in _QMAX:
        block = _check_block(block)
        q, scales = _quantize_int(flat, codec, block)
        data = _pack_int4(q) if codec == "int4" else q
        return QTensor(codec, shape, data, scales, block)
    if not np.isfinite(flat).all():
        raise ValueError(f"cannot quantise non-finite values with codec {codec!r}")
    if codec == "fp32":
        return QTensor(codec, shape, flat.copy(), None, 0)
    return QTensor(codec, shape, _bf16_bits(flat), None, 0)


def check_layout(q: QTensor) -> int:
    """Validate the internal consistency of ``q``; return its element count.

    Raises:
        ValueError: unknown codec, wrong payload dtype or size, wrong number of scales.
    """
    _check_codec(q.codec)
    n = int(np.prod(q.shape, dtype=np.int64)) if q.shape else 1
    if q.data.ndim != 1 or q.data.dtype != _DATA_DTYPE[q.codec]:
        raise ValueError(f"{q.codec} data must be 1-D {_DATA_DTYPE[q.codec]}")
    if q.data.nbytes != data_nbytes(q.codec, n):
        raise ValueError(f"{q.codec} data holds {q.data.nbytes} bytes for {n} elements")
    if q.codec in _QMAX:
        block = _check_block(q.block)
        if q.scales is None or q.scales.shape != (num_blocks(n, block),):
            raise ValueError(f"{q.codec} needs {num_blocks(n, block)} scales")
        if q.scales.dtype != np.float32:
            raise ValueError("scales must be float32")
    elif q.scales is not None:
        raise ValueError(f"{q.codec} carries no scales")
    return n


def dequantize(q: QTensor) -> np.ndarray:
    """Decode a :class:`QTensor`.

    Args:
        q: The quantised tensor.

    Returns:
        A new float32 array of shape ``q.shape``.

    Raises:
        ValueError: If ``q`` is internally inconsistent (unknown codec, wrong payload
            dtype or size, wrong number of scales).
    """
    n = check_layout(q)
    if q.codec == "fp32":
        return q.data.astype(np.float32, copy=True).reshape(q.shape)
    if q.codec == "bf16":
        bits = q.data.astype(np.uint32)
        bits <<= 16
        return bits.view(np.float32).reshape(q.shape)
    if q.codec == "int4" and q.block % 2 == 0:
        return _dequantize_int4_lut(q, n)
    values = _unpack_int4(q.data, n) if q.codec == "int4" else q.data
    scales = q.scales

    def scale(chunk: np.ndarray, rows: slice) -> np.ndarray:
        return chunk * scales[rows, None]

    # Crafted payloads (-128 / -8 with a huge scale) may overflow to inf; never warn.
    with np.errstate(over="ignore"):
        out = _per_block(values, n, q.block, np.dtype(np.float32), scale)
    return out.reshape(q.shape)


def _nibble_lut() -> np.ndarray:
    """byte → the two signed nibbles it holds, as float32 pairs viewed as one uint64."""
    b = np.arange(256, dtype=np.int16)
    pairs = np.stack([((b & 0x0F) ^ 8) - 8, ((b >> 4) ^ 8) - 8], axis=1).astype(np.float32)
    return np.ascontiguousarray(pairs).view(np.uint64).ravel()


_NIBBLE_LUT = _nibble_lut()


def _dequantize_int4_lut(q: QTensor, n: int) -> np.ndarray:
    """int4 decode in two passes: a table gather (two values per byte), then block scales."""
    flat = _NIBBLE_LUT[q.data].view(np.float32)
    full = n // q.block
    with np.errstate(over="ignore"):
        if full:
            head = flat[: full * q.block].reshape(full, q.block)
            head *= q.scales[:full, None]
        if n > full * q.block:
            flat[full * q.block : n] *= q.scales[full]
    return flat[:n].reshape(q.shape)


def roundtrip(x: np.ndarray, codec: str, block: int = DEFAULT_BLOCK) -> np.ndarray:
    """Return ``dequantize(quantize(x, codec, block))``."""
    return dequantize(quantize(x, codec, block))


def payload_nbytes(q: QTensor) -> int:
    """Return the bytes a :class:`QTensor` puts on the wire (payload plus scales)."""
    return int(q.data.nbytes) + (int(q.scales.nbytes) if q.scales is not None else 0)


def error_bound(x: np.ndarray, codec: str, block: int = DEFAULT_BLOCK) -> np.ndarray:
    """Per-element worst-case bound on ``|roundtrip(x) - x|``.

    * fp32: 0.
    * bf16: ``|x| * 2**-8 + 2**-134``. Round-to-nearest-even is within ``2**-9`` relative
      for normal values; the factor 2 covers saturation near the float32 maximum and the
      absolute term covers subnormals (half a bf16 subnormal step).
    * int8 / int4: ``absmax_block / (2 * qmax) + 1e-6 * absmax_block``, where the second
      term covers float32 rounding of the scale and of the products; for blocks flushed to
      zero (absmax below ``2**-118``) the bound is ``absmax_block`` itself.

    Args:
        x: The tensor (as passed to :func:`quantize`).
        codec: One of :data:`CODECS`.
        block: Block size of the integer codecs.

    Returns:
        A float32 array of ``x``'s shape.

    Raises:
        ValueError: As :func:`quantize`.
    """
    _check_codec(codec)
    arr = _as_float32(x)
    flat = arr.reshape(-1)
    if codec in _QMAX:
        block = _check_block(block)
        absmax = _block_absmax(flat, block).astype(np.float64)
        if not np.isfinite(absmax).all():
            raise ValueError(f"cannot quantise non-finite values with codec {codec!r}")
        per_block = np.where(
            absmax >= _FLUSH_BELOW, absmax * (1.0 / (2 * _QMAX[codec]) + _REL_SLACK), absmax
        ).astype(np.float32)

        def spread(chunk: np.ndarray, rows: slice) -> np.ndarray:
            return per_block[rows, None]

        return _per_block(flat, flat.size, block, np.dtype(np.float32), spread).reshape(arr.shape)
    if not np.isfinite(flat).all():
        raise ValueError(f"cannot quantise non-finite values with codec {codec!r}")
    if codec == "fp32":
        return np.zeros(arr.shape, dtype=np.float32)
    bound = np.abs(flat).astype(np.float64) * 2.0**-8 + _BF16_ABS_SLACK
    return bound.astype(np.float32).reshape(arr.shape)


def tensors_hash(tensors: Mapping[str, QTensor | np.ndarray]) -> str:
    """The SHA-256 of a fragment value: over its tensors in name order, each one's raw buffers
    (a quantised tensor's data, then its scales; a plain array as contiguous fp32).

    It identifies a published value in round records (replay verifies it) and a learner's
    final values (learners that end identical report identical hashes).
    """
    h = hashlib.sha256()
    for name in sorted(tensors):  # each buffer hashed where it is (no copy of the value)
        t = tensors[name]
        if isinstance(t, QTensor):
            h.update(_raw(t.data))
            if t.scales is not None:
                h.update(_raw(t.scales))
        else:
            h.update(_raw(np.asarray(t, np.float32)))
    return h.hexdigest()


def _raw(a: np.ndarray) -> memoryview:
    """The array's bytes as one contiguous buffer (a view when it is C-contiguous)."""
    return memoryview(np.ascontiguousarray(a)).cast("B")
