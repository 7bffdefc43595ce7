"""Fragment-stream entries: one learner's contribution as Redis stream fields.

The push's header (:class:`pipeline.contribution.PushHeader`) and the up link's codec, plus
the binary ``payload`` field holding :func:`broker.codec.pack_tensors`'s msgpack document, with
its size and SHA-256 checked before the payload is decoded (:func:`parse_entry`). A payload
larger than ``broker.piece_bytes`` is split: ``payload`` holds its first piece, ``payload:1``
… ``payload:<n-1>`` the others and ``pieces`` their number (``nbytes`` and ``sha256`` are the
whole payload's), so no field meets Redis's limit on one value.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from typing import Any

from broker.codec import MAX_PAYLOAD_BYTES, is_int, pack_tensors, sha256_hex, unpack_tensors
from broker.errors import DecodeError
from broker.pieces import PIECE_BYTES
from broker.untrusted import check_blob
from broker.untrusted import short_repr as _r
from pipeline.contribution import PushHeader
from pipeline.quant import CODECS, QTensor

_INT_RE = re.compile(rb"[0-9]{1,19}")
_ENTRY_INT_FIELDS = ("fragment", "base_version", "step", "steps", "tokens")
PIECE_PREFIX = "payload:"  # the fields of a payload's second and later pieces
MAX_PIECES = 4096


def entry_fields(head: PushHeader, tensors: Mapping[str, QTensor], codec: str, *,
                 piece_bytes: int = PIECE_BYTES) -> dict[str, bytes | str | int]:
    """Build the Redis stream entry of one outer gradient.

    Args:
        head: The push's header (:class:`pipeline.contribution.PushHeader`, or the push).
        tensors: The fragment's quantised tensors; all must use `codec`.
        codec: The up link's codec (`pipeline.quant.CODECS`).
        piece_bytes: A larger payload is split into pieces of this size.

    Returns:
        The fields ``learner, fragment, base_version, step, steps, tokens, codec, nbytes,
        sha256``, the binary ``payload`` (with ``pieces`` and ``payload:1`` … when split),
        ``seconds`` and ``final`` (``0``/``1``), ``epoch`` when it is not 0 and ``chain`` when
        it is not None.

    Raises:
        ValueError: If a field is invalid or a tensor's codec differs from `codec`.
    """
    meta = head
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}")
    if not isinstance(meta.learner, str) or not meta.learner:
        raise ValueError("learner must be a non-empty str")
    for name in (*_ENTRY_INT_FIELDS, "epoch"):
        value = getattr(meta, name)
        if not is_int(value) or not 0 <= value < 10**19:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if meta.chain is not None and not (is_int(meta.chain) and 0 <= meta.chain <= meta.step):
        raise ValueError(f"chain must be an int from 0 to the step, got {meta.chain!r}")
    for name, q in tensors.items():
        if q.codec != codec:
            raise ValueError(f"{name!r} uses codec {q.codec!r}, entry says {codec!r}")
    if not (isinstance(meta.seconds, int | float) and not isinstance(meta.seconds, bool)
            and math.isfinite(meta.seconds) and meta.seconds >= 0):
        raise ValueError(f"seconds must be a finite number >= 0, got {meta.seconds!r}")
    payload = pack_tensors(tensors)
    n = math.ceil(len(payload) / piece_bytes)
    if n > MAX_PIECES:
        raise ValueError(f"a payload of {len(payload)} bytes makes more than {MAX_PIECES} "
                         f"pieces of broker.piece_bytes ({piece_bytes})")
    view = memoryview(payload)
    split = {} if n <= 1 else {
        "payload": view[:piece_bytes], "pieces": n,
        **{f"{PIECE_PREFIX}{i}": view[i * piece_bytes:(i + 1) * piece_bytes]
           for i in range(1, n)}}
    return {
        "learner": meta.learner,
        **{field: int(getattr(meta, field)) for field in _ENTRY_INT_FIELDS},
        "codec": codec,
        "nbytes": len(payload),
        "sha256": sha256_hex(payload),
        "payload": payload,
        **split,
        # the learner's bookkeeping (parse_entry reads 0 and no where an older entry lacks it)
        "seconds": f"{float(meta.seconds):.6f}", "final": "1" if meta.final else "0",
        **({"epoch": int(meta.epoch)} if meta.epoch else {}),
        **({} if meta.chain is None else {"chain": int(meta.chain)}),
    }


def _field(fields: Mapping[Any, Any], key: str) -> Any:
    if key in fields:
        return fields[key]
    bkey = key.encode()
    if bkey in fields:
        return fields[bkey]
    raise DecodeError(f"stream entry lacks field {_r(key)}")


def _text_field(fields: Mapping[Any, Any], key: str) -> str:
    value = _field(fields, key)
    if isinstance(value, bytes | bytearray | memoryview):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise DecodeError(f"field {_r(key)} is not utf-8") from e
    if not isinstance(value, str) or not value:
        raise DecodeError(f"field {_r(key)} must be non-empty text")
    return value


def _int_field(fields: Mapping[Any, Any], key: str) -> int:
    value = _field(fields, key)
    if is_int(value):
        if not 0 <= value < 10**19:  # what entry_fields writes: at most 19 digits
            raise DecodeError(f"field {_r(key)} out of range")
        return int(value)
    if isinstance(value, str):
        value = value.encode("utf-8", "replace")
    if not isinstance(value, bytes | bytearray | memoryview):
        raise DecodeError(f"field {_r(key)} must be a decimal integer")
    value = bytes(value)
    if not _INT_RE.fullmatch(value):
        raise DecodeError(
            f"field {_r(key)} is not a non-negative decimal integer: {_r(value[:32])}"
        )
    return int(value)


def payload_pieces(fields: Mapping[Any, Any]) -> list[bytes | bytearray | memoryview]:
    """The payload's pieces, in order (one for a payload written whole).

    Raises:
        DecodeError: ``pieces`` is out of range, or a piece is missing or not bytes.
    """
    n = _int_field(fields, "pieces") if _optional(fields, "pieces") is not None else 1
    if not 1 <= n <= MAX_PIECES:
        raise DecodeError(f"field 'pieces' must be from 1 to {MAX_PIECES}, got {n}")
    parts = [_field(fields, "payload"), *(_field(fields, f"{PIECE_PREFIX}{i}")
                                          for i in range(1, n))]
    for part in parts:
        check_blob(part, 2**62, "payload")
    return parts


def payload_size(fields: Mapping[Any, Any]) -> int:
    """The payload's bytes, all pieces together (0: no well-formed payload)."""
    try:
        return sum(len(part) for part in payload_pieces(fields))
    except DecodeError:
        return 0


def pieces_sha256(parts: list[bytes | bytearray | memoryview]) -> str:
    """The hex SHA-256 of the pieces joined (without joining them)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def peek_key(fields: Mapping[Any, Any]) -> tuple[str, int, int] | None:
    """An entry's identity (learner, base_version, step) from its plain fields alone, without
    checking or decoding the payload; None when a field is missing or malformed."""
    try:
        return (_text_field(fields, "learner"), _int_field(fields, "base_version"),
                _int_field(fields, "step"))
    except DecodeError:
        return None


def _optional(fields: Mapping[Any, Any], key: str) -> Any:
    try:
        return _field(fields, key)
    except DecodeError:
        return None


def _seconds_field(fields: Mapping[Any, Any]) -> float | None:
    value = _optional(fields, "seconds")
    if value is None:
        return None
    if isinstance(value, bytes | bytearray | memoryview):
        if len(value) > 64:  # entry_fields writes "%.6f"
            raise DecodeError("field 'seconds' is too long")
        value = bytes(value).decode("ascii", "replace")
    if isinstance(value, str) and len(value) > 64:
        raise DecodeError("field 'seconds' is too long")
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        raise DecodeError(f"field 'seconds' is not a number: {_r(value)}")
    try:
        seconds = float(value)
    except (TypeError, ValueError) as e:
        raise DecodeError(f"field 'seconds' is not a number: {_r(value)}") from e
    if not math.isfinite(seconds) or seconds < 0:
        raise DecodeError(f"field 'seconds' must be finite and >= 0, got {_r(value)}")
    return seconds


def _flag_field(fields: Mapping[Any, Any], key: str) -> bool:
    value = _optional(fields, key)
    if value is None:
        return False
    if type(value) in (bytes, str, int) and value in (b"1", "1", 1, b"0", "0", 0):
        return value in (b"1", "1", 1)
    raise DecodeError(f"field {_r(key)} must be 0 or 1, got {_r(value)}")


def parse_entry(
    fields: Mapping[bytes | str, bytes | str], *, max_bytes: int = MAX_PAYLOAD_BYTES,
    payload_sha256: str | None = None,
) -> tuple[PushHeader, dict[str, QTensor]]:
    """Decode a Redis stream entry built by :func:`entry_fields`.

    Accepts redis-py's ``dict[bytes, bytes]`` as well as str keys/values (and int values).
    Fields beyond the known ones are ignored; ``seconds``, ``final``, ``epoch`` and
    ``chain`` may be absent (0, no, 0, None).

    Args:
        fields: The entry's fields.
        max_bytes: Largest accepted payload.
        payload_sha256: the payload's hex SHA-256 when the caller already computed it (a
            syncer hashes a batch of entries on worker threads); None: computed here.

    Returns:
        The push's header (:class:`pipeline.contribution.PushHeader`) and its tensors.

    Raises:
        DecodeError: On a missing or malformed field, a size or checksum mismatch (checked
            before decoding the payload), a malformed payload, or tensors whose codec
            differs from the ``codec`` field.
    """
    if not isinstance(fields, Mapping):
        raise DecodeError(f"stream entry must be a mapping, got {type(fields).__name__}")
    ints = {key: _int_field(fields, key) for key in _ENTRY_INT_FIELDS}
    codec = _text_field(fields, "codec")
    meta = PushHeader(
        learner=_text_field(fields, "learner"), **ints,
        seconds=_seconds_field(fields) or 0.0, final=_flag_field(fields, "final"),
        epoch=_int_field(fields, "epoch") if _optional(fields, "epoch") is not None else 0,
        chain=_int_field(fields, "chain") if _optional(fields, "chain") is not None else None,
    )
    if meta.chain is not None and meta.chain > meta.step:
        raise DecodeError(f"field 'chain' ({meta.chain}) is after the entry's step "
                          f"({meta.step})")
    if codec not in CODECS:
        raise DecodeError(f"unknown codec {_r(codec)}")
    nbytes = _int_field(fields, "nbytes")
    sha = _text_field(fields, "sha256")
    parts = payload_pieces(fields)
    size = sum(len(part) for part in parts)
    if size > max_bytes:
        raise DecodeError(f"payload of {size} bytes exceeds the limit of {max_bytes}")
    if size != nbytes:
        raise DecodeError(f"payload has {size} bytes, nbytes field says {nbytes}")
    if (payload_sha256 or pieces_sha256(parts)) != sha.lower():
        raise DecodeError("payload sha256 mismatch")
    payload = parts[0] if len(parts) == 1 else b"".join(parts)
    del parts
    tensors = unpack_tensors(payload, max_bytes=max_bytes)
    for name, q in tensors.items():
        if q.codec != codec:
            raise DecodeError(f"{_r(name)} uses codec {_r(q.codec)}, entry says {_r(codec)}")
    return meta, tensors
