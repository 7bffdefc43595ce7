"""The wire codec: bytes <-> quantised fragments, for Redis stream entries and ZeroMQ.

This module owns every byte layout that crosses a process boundary:

* the payload of a fragment-stream entry (a learner's outer gradient,
  :mod:`broker.entries`): :func:`pack_tensors`'s msgpack document;
* ZeroMQ multipart messages of merged (global) fragment values (:func:`global_frames`),
  which carry tensor buffers as separate zero-copy frames;
* snapshots, the same content as one bytes blob for storing in Redis.

Everything is msgpack plus raw little-endian buffers; no Python-object serialisation is
ever used, so decoding runs no code chosen by the sender. Pure functions: no sockets, no
Redis. Decoding validates every size, type, dtype and checksum before building arrays and
raises :class:`~broker.errors.DecodeError` for any malformed input; size limits are checked
before msgpack sees the bytes, and every document is scanned against its schema (kinds, keys,
lengths: :func:`unpack_checked`) before msgpack builds anything, so no input makes a decoder
hold more than its input and the output its schema allows.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from broker.errors import DecodeError
from broker.untrusted import (
    M_INT,
    M_NIL,
    MBin,
    MDict,
    MList,
    MMap,
    MOneOf,
    MStr,
    MTuple,
    Scan,
    as_buffer,
    build_scanned,
    check_blob,
    scan_checked,
    unpack_checked,
)
from broker.untrusted import short_repr as _r
from pipeline import limits
from pipeline.limits import MAX_FRAGMENT, MAX_NAME, MAX_NDIM, MAX_TENSORS
from pipeline.quant import CODECS, QTensor, data_nbytes, num_blocks

MAX_PAYLOAD_BYTES = 256 * 2**20
WIRE_VERSION = 1

# dtype allowlist of the payload of each codec (little-endian on the wire).
_WIRE_DTYPE = {"fp32": "<f4", "bf16": "<u2", "int8": "|i1", "int4": "|u1"}
_BLOCKED = ("int8", "int4")
_MAX_ELEMENTS = 2**40
_MAX_BLOCK = 2**31
_MAX_RUN = 64  # broker.keys: a run name is 1-64 characters
_MAX_HEADER_BYTES = 16 * 2**20
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_HEADER_KEYS = {"v", "run", "fragment", "version", "names", "codecs", "shapes", "blocks", "sha256"}
_DELTA_HEADER_KEYS = _HEADER_KEYS | {"base", "value"}


@dataclass(frozen=True)
class GlobalHeader:
    """Header of a merged fragment value (ZeroMQ message or snapshot)."""

    run: str
    fragment: int
    version: int
    names: tuple[str, ...]
    codecs: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    blocks: tuple[int, ...]
    sha256: str
    # the delta down link (`sync.down_delta`): the tensors are a delta against version `base`
    # (-1: they are the whole value), and `value` is the SHA-256 of the value they make
    # (`pipeline.quant.tensors_hash` of it in fp32); "" when not sent
    base: int = -1
    value: str = ""
    # the round's merge records (a published message only, not a re-publish or snapshot):
    # learner → (base version, step) of its push this round merged; None: not carried
    merged: Mapping[str, tuple[int, int]] | None = None


# ---------------------------------------------------------------------------- helpers


def sha256_hex(*buffers: bytes | memoryview) -> str:
    """Return the hex SHA-256 of the concatenation of ``buffers``."""
    h = hashlib.sha256()
    for buf in buffers:
        h.update(buf)
    return h.hexdigest()


def is_int(v: object) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)


_CODEC_NAME = MStr(8, CODECS)
_SHAPE = MList(M_INT, MAX_NDIM)
# pack_tensors: {"v": 1, "t": [[name, codec, shape, block, dtype, data, scales|None], ...]}
_PAYLOAD_SCHEMA = MMap({"v": M_INT, "t": MList(MTuple(
    MStr(MAX_NAME), _CODEC_NAME, _SHAPE, M_INT, MStr(8, _WIRE_DTYPE.values()), MBin(),
    MOneOf(MBin(), M_NIL),
), MAX_TENSORS)})
_HEADER_SCHEMA = MMap({
    "v": M_INT, "run": MStr(4 * _MAX_RUN), "fragment": M_INT, "version": M_INT,
    "names": MList(MStr(MAX_NAME), MAX_TENSORS), "codecs": MList(_CODEC_NAME, MAX_TENSORS),
    "shapes": MList(_SHAPE, MAX_TENSORS), "blocks": MList(M_INT, MAX_TENSORS),
    "sha256": MStr(64),
}, optional={"base": M_INT, "value": MStr(64), "merged": MDict(
    limits.MAX_LEARNER_ID, MTuple(M_INT, M_INT), limits.MAX_LEARNERS)},
    same_len=("names", "codecs", "shapes", "blocks"))
# pack_snapshot: {"h": header, "t": [data_0, scales_0?, data_1, ...]}
_SNAPSHOT_SCHEMA = MMap({"h": _HEADER_SCHEMA, "t": MList(MBin(), 2 * MAX_TENSORS)})


def _shape_of(raw: object) -> tuple[int, ...]:
    if not isinstance(raw, list | tuple) or len(raw) > MAX_NDIM:
        raise DecodeError(f"shape must be a list of at most {MAX_NDIM} ints")
    if not all(is_int(d) and 0 <= d <= _MAX_ELEMENTS for d in raw):
        raise DecodeError(f"bad shape {_r(raw)}")
    shape = tuple(raw)
    if math.prod(shape) > _MAX_ELEMENTS:
        raise DecodeError(f"shape {shape} has too many elements")
    return shape


def _layout(codec: object, shape: tuple[int, ...], block: object) -> tuple[int, int]:
    """Validate codec/block; return (expected data bytes, expected scale bytes)."""
    if not isinstance(codec, str) or codec not in CODECS:
        raise DecodeError(f"unknown codec {_r(codec)}")
    if not is_int(block):
        raise DecodeError(f"block must be an int, got {type(block).__name__}")
    n = math.prod(shape)
    if codec in _BLOCKED:
        if not 1 <= block <= _MAX_BLOCK:
            raise DecodeError(f"{codec} block {block} out of range")
        return data_nbytes(codec, n), 4 * num_blocks(n, block)
    if block != 0:
        raise DecodeError(f"{codec} block must be 0, got {block}")
    return data_nbytes(codec, n), 0


def _build(
    name: str, codec: str, shape: tuple[int, ...], block: int, data: object, scales: object
) -> QTensor:
    """Validate the buffers of one tensor and wrap them (no copy) as a QTensor."""
    want_data, want_scales = _layout(codec, shape, block)
    if not isinstance(data, bytes | memoryview):
        raise DecodeError(f"{_r(name)}: data must be binary")
    if len(data) != want_data:
        raise DecodeError(f"{_r(name)}: data has {len(data)} bytes, expected {want_data}")
    arr = np.frombuffer(data, dtype=_WIRE_DTYPE[codec])
    if codec not in _BLOCKED:
        if scales is not None:
            raise DecodeError(f"{_r(name)}: {codec} carries no scales")
        return QTensor(codec, shape, arr, None, block)
    if not isinstance(scales, bytes | memoryview):
        raise DecodeError(f"{_r(name)}: {codec} needs binary scales")
    if len(scales) != want_scales:
        raise DecodeError(f"{_r(name)}: scales have {len(scales)} bytes, expected {want_scales}")
    sc = np.frombuffer(scales, dtype="<f4")
    if not (np.isfinite(sc).all() and (sc >= 0).all()):
        raise DecodeError(f"{_r(name)}: scales must be finite and non-negative")
    return QTensor(codec, shape, arr, sc, block)


def _wire_arrays(name: str, q: QTensor) -> tuple[np.ndarray, np.ndarray | None]:
    """Validate an outgoing QTensor; return its contiguous little-endian data and scales."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise ValueError(f"tensor names must be str of 1..{MAX_NAME} chars, got {name!r}")
    codec = q.codec
    if codec not in CODECS:
        raise ValueError(f"{name!r}: unknown codec {codec!r}")
    want = np.dtype(_WIRE_DTYPE[codec])
    data = np.asarray(q.data)
    if data.dtype.kind != want.kind or data.dtype.itemsize != want.itemsize:
        raise ValueError(f"{name!r}: {codec} data must be {want}, got {data.dtype}")
    data = np.ascontiguousarray(data.reshape(-1), dtype=want)
    if (q.scales is None) != (codec not in _BLOCKED):
        raise ValueError(
            f"{name!r}: {codec} tensors {'need' if codec in _BLOCKED else 'lack'} scales"
        )
    scales = None
    if q.scales is not None:
        scales = np.ascontiguousarray(np.asarray(q.scales).reshape(-1), dtype="<f4")
    shape = tuple(int(d) for d in q.shape)
    try:
        want_data, want_scales = _layout(codec, _shape_of(shape), int(q.block))
    except DecodeError as e:
        raise ValueError(f"{name!r}: {e}") from None
    if data.nbytes != want_data or (0 if scales is None else scales.nbytes) != want_scales:
        raise ValueError(f"{name!r}: inconsistent {codec} tensor of shape {shape}")
    return data, scales


def _bytes_view(arr: np.ndarray) -> memoryview:
    return memoryview(arr.view(np.uint8))


# ------------------------------------------------------------------ outer gradients


def pack_tensors(tensors: Mapping[str, QTensor]) -> bytes:
    """Serialise a fragment's quantised tensors as one msgpack document.

    Layout: ``{"v": 1, "t": [[name, codec, shape, block, dtype, data, scales|None], ...]}``
    with ``data``/``scales`` as msgpack bin; order is preserved.

    Args:
        tensors: Name -> quantised tensor.

    Returns:
        The document.

    Raises:
        ValueError: If a tensor is internally inconsistent.
    """
    rows = []
    for name, q in tensors.items():
        data, scales = _wire_arrays(name, q)
        head = [name, q.codec, [int(d) for d in q.shape], int(q.block), _WIRE_DTYPE[q.codec]]
        rows.append([*head, _bytes_view(data), None if scales is None else _bytes_view(scales)])
    return msgpack.packb({"v": WIRE_VERSION, "t": rows}, use_bin_type=True)


def unpack_tensors(blob: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> dict[str, QTensor]:
    """Decode :func:`pack_tensors`'s document.

    Args:
        blob: The document.
        max_bytes: Largest accepted ``len(blob)``, checked before decoding.

    Returns:
        Name -> quantised tensor, in wire order. Arrays are read-only views of decoded
        buffers.

    Raises:
        DecodeError: On any malformed input.
    """
    check_blob(blob, max_bytes, "payload")
    doc = unpack_checked(blob, _PAYLOAD_SCHEMA, "tensor payload")
    if not isinstance(doc, dict) or set(doc) != {"v", "t"}:
        raise DecodeError("tensor payload must be a map with keys 'v' and 't'")
    if not is_int(doc["v"]) or doc["v"] != WIRE_VERSION:
        raise DecodeError(f"unsupported wire version {_r(doc['v'])}")
    if not isinstance(doc["t"], list):
        raise DecodeError("'t' must be a list")
    out: dict[str, QTensor] = {}
    for row in doc["t"]:
        if not isinstance(row, list) or len(row) != 7:
            raise DecodeError("each tensor must be a list of 7 items")
        name, codec, shape, block, dtype, data, scales = row
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise DecodeError("tensor name must be a non-empty str")
        if name in out:
            raise DecodeError(f"duplicate tensor name {_r(name)}")
        if not isinstance(codec, str) or codec not in CODECS:
            raise DecodeError(f"{_r(name)}: unknown codec {_r(codec)}")
        if dtype != _WIRE_DTYPE[codec]:
            raise DecodeError(f"{_r(name)}: dtype {_r(dtype)} not allowed for {codec}")
        out[name] = _build(name, codec, _shape_of(shape), block, data, scales)
    return out


# ---------------------------------------------------------------- global fragments


def topic(fragment: int) -> bytes:
    """ZeroMQ topic of a fragment: ``b"f%04d"``, fixed width so prefixes never collide.

    Raises:
        ValueError: If ``fragment`` is not in ``[0, 9999]``.
    """
    if not is_int(fragment) or not 0 <= fragment <= MAX_FRAGMENT:
        raise ValueError(f"fragment must be an int in [0, {MAX_FRAGMENT}], got {fragment!r}")
    return b"f%04d" % int(fragment)


def _global_parts(
    run: str, fragment: int, version: int, tensors: Mapping[str, QTensor],
    base: int = -1, value: str = "", merged: Mapping[str, tuple[int, int]] | None = None,
    sha256: str | None = None,
) -> tuple[dict[str, Any], list[memoryview]]:
    """The header dict and the tensor buffers (data, then scales if any, per tensor)."""
    topic(fragment)
    fragment = int(fragment)
    if not isinstance(run, str) or not run:
        raise ValueError("run must be a non-empty str")
    if not is_int(version) or version < 0:
        raise ValueError(f"version must be a non-negative int, got {version!r}")
    if not is_int(base) or not -1 <= base < version:
        raise ValueError(f"base must be -1 or a version below {version}, got {base!r}")
    if value and not _SHA_RE.fullmatch(value):
        raise ValueError("value must be a SHA-256 of 64 lowercase hex digits")
    if base >= 0 and not value:
        raise ValueError("a delta (base >= 0) needs the SHA-256 of the value it makes")
    bufs: list[memoryview] = []
    for name, q in tensors.items():
        data, scales = _wire_arrays(name, q)
        bufs.append(_bytes_view(data))
        if scales is not None:
            bufs.append(_bytes_view(scales))
    header = {
        "v": WIRE_VERSION,
        "run": run,
        "fragment": fragment,
        "version": int(version),
        "names": list(tensors),
        "codecs": [q.codec for q in tensors.values()],
        "shapes": [[int(d) for d in q.shape] for q in tensors.values()],
        "blocks": [int(q.block) for q in tensors.values()],
        "sha256": sha256 or sha256_hex(*bufs),
    }
    if value:
        header.update(base=int(base), value=value)
    if merged is not None:
        header["merged"] = {n: [int(b), int(s)] for n, (b, s) in merged.items()}
        _merged_of(header["merged"], version, ValueError)
    return header, bufs


def _merged_of(raw: dict, version: int, error: type[Exception]) -> dict[str, tuple[int, int]]:
    """A header's merge records, checked (learner ids, base versions below the version)."""
    for n, (b, s) in raw.items():
        if not (isinstance(n, str) and 0 < len(n.encode()) <= limits.MAX_LEARNER_ID
                and is_int(b) and is_int(s)):
            raise error(f"bad merge record {_r(n)}")
        if not 0 <= b < version or not 0 <= s < 2**62:
            raise error(f"merge record of {_r(n)}: base {_r(b)}, step {_r(s)} (version {version})")
    return {n: (int(b), int(s)) for n, (b, s) in raw.items()}


def _parse_header(raw: object) -> GlobalHeader:
    if not isinstance(raw, dict) or set(raw) - {"merged"} not in (_HEADER_KEYS,
                                                                   _DELTA_HEADER_KEYS):
        raise DecodeError(f"global header must be a map with keys {sorted(_HEADER_KEYS)} "
                          f"(and base with value, or neither; merged optional)")
    if not is_int(raw["v"]) or raw["v"] != WIRE_VERSION:
        raise DecodeError(f"unsupported wire version {_r(raw['v'])}")
    run, fragment, version, sha = raw["run"], raw["fragment"], raw["version"], raw["sha256"]
    if not isinstance(run, str) or not run:
        raise DecodeError("run must be a non-empty str")
    if not is_int(fragment) or not 0 <= fragment <= MAX_FRAGMENT:
        raise DecodeError(f"bad fragment {_r(fragment)}")
    if not is_int(version) or version < 0:
        raise DecodeError(f"bad version {_r(version)}")
    if not isinstance(sha, str) or not _SHA_RE.fullmatch(sha):
        raise DecodeError("sha256 must be 64 lowercase hex digits")
    lists = [raw[k] for k in ("names", "codecs", "shapes", "blocks")]
    if not all(isinstance(x, list) for x in lists) or len({len(x) for x in lists}) != 1:
        raise DecodeError("names, codecs, shapes and blocks must be lists of equal length")
    names, codecs, shapes, blocks = lists
    if not all(isinstance(n, str) and 0 < len(n) <= MAX_NAME for n in names):
        raise DecodeError("tensor names must be non-empty str")
    if len(set(names)) != len(names):
        raise DecodeError("duplicate tensor names")
    if not all(isinstance(c, str) and c in CODECS for c in codecs):
        raise DecodeError(f"unknown codec in {_r(codecs[:8])}")
    shapes_t = tuple(_shape_of(s) for s in shapes)
    for codec, shape, block in zip(codecs, shapes_t, blocks, strict=True):
        _layout(codec, shape, block)
    base, value = raw.get("base", -1), raw.get("value", "")
    if "base" in raw:
        if not is_int(base) or not -1 <= base < version:
            raise DecodeError(f"bad base {_r(base)} for version {version}")
        if not isinstance(value, str) or not _SHA_RE.fullmatch(value):
            raise DecodeError("value must be 64 lowercase hex digits")
    merged = raw.get("merged")
    return GlobalHeader(
        run, fragment, version, tuple(names), tuple(codecs), shapes_t, tuple(blocks), sha,
        int(base), value, None if merged is None else _merged_of(merged, version, DecodeError)
    )


def _tensors_from(header: GlobalHeader, bufs: Sequence[Any]) -> dict[str, QTensor]:
    """Build the tensors of ``header`` from the tensor buffers, checking count and sha."""
    expected = sum(2 if c in _BLOCKED else 1 for c in header.codecs)
    if len(bufs) != expected:
        raise DecodeError(f"{len(bufs)} tensor buffers, header describes {expected}")
    if sha256_hex(*bufs) != header.sha256:
        raise DecodeError("global fragment sha256 mismatch")
    out: dict[str, QTensor] = {}
    it: Iterable[Any] = iter(bufs)
    for name, codec, shape, block in zip(
        header.names, header.codecs, header.shapes, header.blocks, strict=True
    ):
        data = next(it)
        scales = next(it) if codec in _BLOCKED else None
        out[name] = _build(name, codec, shape, block, data, scales)
    return out


def global_frames(
    run: str, fragment: int, version: int, tensors: Mapping[str, QTensor], *,
    base: int = -1, value: str = "", merged: Mapping[str, tuple[int, int]] | None = None,
    sha256: str | None = None,
) -> list[bytes | memoryview]:
    """Build the ZeroMQ multipart message of a merged fragment value.

    Frames: ``[topic(fragment), msgpack(header), data_0, scales_0?, data_1, ...]``; tensor
    frames are memoryviews of the tensors' own buffers (zero copy when they are already
    contiguous little-endian), and the header's ``sha256`` covers them in order.
    Ready for ``send_multipart(..., copy=False)``.

    Args:
        run: Run name.
        fragment: Fragment index in ``[0, 9999]``.
        version: Global version of the fragment.
        tensors: Name -> quantised tensor.
        base: The delta down link: `tensors` are a delta against this version (-1: whole).
        value: The SHA-256 of the value learners hold afterwards (required with a base).
        merged: The round's merge records (learner → base version and step of its push the
            round merged): a learner then needs no Redis read to learn what the value holds.
        sha256: `quant.tensors_hash(tensors)` if they are in name order (not hashed twice).

    Raises:
        ValueError: On invalid arguments or inconsistent tensors.
    """
    header, bufs = _global_parts(run, fragment, version, tensors, base, value, merged, sha256)
    return [topic(fragment), msgpack.packb(header, use_bin_type=True), *bufs]


def parse_global_frames(
    frames: Sequence[Any], *, max_bytes: int = MAX_PAYLOAD_BYTES
) -> tuple[GlobalHeader, dict[str, QTensor]]:
    """Decode a message built by :func:`global_frames`.

    Args:
        frames: bytes, memoryviews, or zmq.Frame-like objects (with ``.buffer`` or
            ``.bytes``).
        max_bytes: Largest accepted total size of all frames.

    Returns:
        The header and the tensors; arrays are read-only views of the frames (no copy).

    Raises:
        DecodeError: On any malformed message.
    """
    if isinstance(frames, bytes | bytearray | memoryview | str) or not isinstance(frames, Sequence):
        raise DecodeError("frames must be a sequence of frames")
    if len(frames) < 2:
        raise DecodeError(f"a global message has at least 2 frames, got {len(frames)}")
    views = [as_buffer(f) for f in frames]
    total = sum(v.nbytes for v in views)
    if total > max_bytes:
        raise DecodeError(f"message of {total} bytes exceeds the limit of {max_bytes}")
    if views[1].nbytes > _MAX_HEADER_BYTES:
        raise DecodeError("global header too large")
    header = _parse_header(unpack_checked(views[1], _HEADER_SCHEMA, "global header"))
    if views[0] != topic(header.fragment):
        raise DecodeError(f"topic {_r(bytes(views[0][:16]))} does not match the header")
    return header, _tensors_from(header, views[2:])


def pack_snapshot(run: str, fragment: int, version: int, tensors: Mapping[str, QTensor], *,
                  sha256: str | None = None, base: int = -1, value: str = "") -> memoryview:
    """A merged fragment value as one blob, msgpack ``{"h": header, "t": [bufs]}``: a view of
    the packer's buffer (``packb`` would copy it once more). `sha256`: the tensors'
    `quant.tensors_hash` if they are in name order (so not hashed twice); `base`, `value` as
    :func:`global_frames`' (a delta as sent, kept in ``sent:<v>``). ValueError as it raises."""
    header, bufs = _global_parts(run, fragment, version, tensors, base, value, sha256=sha256)
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    packer.pack({"h": header, "t": bufs})
    return packer.getbuffer()


def unpack_snapshot(
    blob: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES, delta_ok: bool = False
) -> tuple[GlobalHeader, dict[str, QTensor]]:
    """Decode :func:`pack_snapshot`'s blob; a delta (``header.base >= 0``) only with
    `delta_ok` (a reader that rebuilds it from the version before).

    Raises:
        DecodeError: On any malformed blob; the size limit is checked before decoding.
    """
    check_blob(blob, max_bytes, "snapshot")
    scan = scan_checked(blob, _SNAPSHOT_SCHEMA, "snapshot")
    assert scan.spans is not None
    (h0, h1), (t0, t1) = scan.spans["h"], scan.spans["t"]
    header = _parse_header(unpack_checked(scan.buf[h0:h1], _HEADER_SCHEMA, "snapshot header"))
    if header.base != -1 and not delta_ok:
        raise DecodeError("a snapshot holds a whole value, not a delta (base must be -1)")
    # as many buffers as the header describes, before msgpack builds them
    expected = sum(2 if c in _BLOCKED else 1 for c in header.codecs)
    got = Scan(scan.buf[t0:t1], "snapshot").count("array", 2 * MAX_TENSORS, "t")
    if got != expected:
        raise DecodeError(f"{got} tensor buffers, header describes {expected}")
    doc = build_scanned(scan, _SNAPSHOT_SCHEMA)
    return header, _tensors_from(header, doc["t"])
