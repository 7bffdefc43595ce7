"""msgpack documents checked against a schema before msgpack builds anything.

msgpack itself bounds only each container's declared length, so a document of n bytes can
still become n Python objects (an empty array is one byte, a list object is ~70): a few MiB
of input would take hundreds of MiB. Every document is therefore first *scanned* against its
schema -- its bytes walked value by value, building nothing, every type, key and length checked
against where the schema allows it, recursion as deep as the schema and no deeper -- and only
then handed to msgpack, which can then build nothing but what the schema allows. The scan skips
binary payloads by their length, so it costs a few Python calls per tensor whatever the
tensor's size.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any

import msgpack

from broker.errors import DecodeError


def short_repr(value: object) -> str:
    """A short repr of an untrusted decoded value, for error messages."""
    if isinstance(value, list | dict | str | bytes) and len(value) > 32:
        return f"<{type(value).__name__} of length {len(value)}>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_blob(blob: object, max_bytes: int, what: str) -> None:
    """Type and size checks of an undecoded blob (before msgpack sees it)."""
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise DecodeError(f"{what} must be bytes, got {type(blob).__name__}")
    if len(blob) > max_bytes:
        raise DecodeError(f"{what} of {len(blob)} bytes exceeds the limit of {max_bytes}")


def as_buffer(frame: object) -> memoryview:
    """A flat byte memoryview of a bytes-like object or a zmq.Frame-like object."""
    obj = frame
    if not isinstance(obj, bytes | bytearray | memoryview):
        buf = getattr(obj, "buffer", None)
        obj = buf if buf is not None else getattr(obj, "bytes", None)
    try:
        mv = memoryview(obj)  # type: ignore[arg-type]
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
    except (TypeError, ValueError) as e:
        raise DecodeError(f"frame of type {type(frame).__name__} is not a buffer") from e
    if not mv.c_contiguous:
        raise DecodeError("frame buffer is not contiguous")
    return mv


# the first byte of a value -> (kind, length if fixed, bytes of the length, bytes of a scalar's
# payload); None: ext types and the reserved byte 0xc1, which no document here holds
_HEAD: list[tuple[str, int, int, int] | None] = [None] * 256
for _b in range(0x80):
    _HEAD[_b] = ("int", 0, 0, 0)
for _b in range(0xE0, 0x100):
    _HEAD[_b] = ("int", 0, 0, 0)
for _b in range(0x10):
    _HEAD[0x80 + _b] = ("map", _b, 0, 0)
    _HEAD[0x90 + _b] = ("array", _b, 0, 0)
for _b in range(0x20):
    _HEAD[0xA0 + _b] = ("str", _b, 0, 0)
_HEAD[0xC0] = ("nil", 0, 0, 0)
_HEAD[0xC2] = _HEAD[0xC3] = ("bool", 0, 0, 0)
for _b, _n in zip(range(0xCC, 0xD4), (1, 2, 4, 8, 1, 2, 4, 8), strict=True):
    _HEAD[_b] = ("int", 0, 0, _n)
for _i, _n in enumerate((1, 2, 4)):
    _HEAD[0xC4 + _i] = ("bin", 0, _n, 0)
    _HEAD[0xD9 + _i] = ("str", 0, _n, 0)
_HEAD[0xCA], _HEAD[0xCB] = ("float", 0, 0, 4), ("float", 0, 0, 8)
_HEAD[0xDC], _HEAD[0xDD] = ("array", 0, 2, 0), ("array", 0, 4, 0)
_HEAD[0xDE], _HEAD[0xDF] = ("map", 0, 2, 0), ("map", 0, 4, 0)
_MAX_KEY = 64  # the longest key of a fixed-key map (MMap)
_SIZE = {1: struct.Struct(">B"), 2: struct.Struct(">H"), 4: struct.Struct(">I")}


class Scan:
    """A read position in a msgpack document being checked against a schema."""

    __slots__ = ("buf", "pos", "end", "what", "spans")

    def __init__(self, buf: memoryview, what: str):
        self.buf, self.pos, self.end, self.what = buf, 0, len(buf), what
        self.spans: dict[str, tuple[int, int]] | None = None

    def fail(self, msg: str) -> DecodeError:
        return DecodeError(f"malformed {self.what}: {msg}")

    def _bad_byte(self) -> DecodeError:
        if self.pos >= self.end:
            return self.fail("truncated")
        return self.fail(f"byte 0x{self.buf[self.pos]:02x} at offset {self.pos} starts no "
                         f"value of this document (ext type or reserved)")

    def peek(self) -> str:
        """The kind of the next value (not consumed)."""
        head = _HEAD[self.buf[self.pos]] if self.pos < self.end else None
        if head is None:
            raise self._bad_byte()
        return head[0]

    def head(self) -> tuple[str, int]:
        """Consume one value's header (and a scalar's payload): (kind, length of a str, bin,
        array or map)."""
        pos = self.pos
        head = _HEAD[self.buf[pos]] if pos < self.end else None
        if head is None:
            raise self._bad_byte()
        kind, n, size_len, payload = head
        pos += 1
        if size_len or payload:
            stop = pos + size_len + payload
            if stop > self.end:
                raise self.fail("truncated")
            if size_len:
                n = _SIZE[size_len].unpack_from(self.buf, pos)[0]
            pos = stop
        self.pos = pos
        return kind, n

    def skip(self, n: int) -> None:
        if n > self.end - self.pos:
            raise self.fail(f"a value of {n} bytes, {self.end - self.pos} left: truncated")
        self.pos += n

    def text(self, n: int) -> str:
        start = self.pos
        self.skip(n)
        try:
            return str(self.buf[start:self.pos], "utf-8")
        except UnicodeDecodeError as e:
            raise self.fail("a str is not utf-8") from e

    def count(self, kind: str, max_len: int, where: str, min_item_bytes: int = 1) -> int:
        """Consume a container's header; its item count, checked against the schema's limit
        and against the bytes left (each item takes at least `min_item_bytes`)."""
        got, n = self.head()
        if got != kind:
            raise self.fail(f"{where} must be a{'n' if kind == 'array' else ''} {kind}, "
                            f"got {got}")
        if n > max_len:
            raise self.fail(f"{where} has {n} items, at most {max_len} allowed")
        if n * min_item_bytes > self.end - self.pos:
            raise self.fail(f"{where} declares {n} items, only {self.end - self.pos} bytes left")
        return n


class MsgSchema:
    """The shape of a msgpack document (or of one value in it): the allowed kinds, key sets
    and lengths. ``limits`` is (longest str, bin, array, map) anywhere in it, for msgpack's own
    limits; None: no bound of its own (the document's size bounds it)."""

    kinds: frozenset[str] = frozenset()
    limits: tuple[int | None, int | None, int, int] = (0, 0, 0, 0)

    def scan(self, s: Scan, where: str) -> None:
        raise NotImplementedError

    def _merge(self, *parts: MsgSchema, own: tuple = (0, 0, 0, 0)) -> None:
        def most(*xs: int | None) -> int | None:
            return None if any(x is None for x in xs) else max(xs)  # type: ignore[type-var]
        self.limits = tuple(most(own[i], *(p.limits[i] for p in parts))  # type: ignore[assignment]
                            for i in range(4))


class MScalar(MsgSchema):
    """A scalar of one of `kinds` ("int", "float", "nil", "bool")."""

    def __init__(self, *kinds: str):
        self.kinds = frozenset(kinds)

    def scan(self, s: Scan, where: str) -> None:
        kind, _ = s.head()
        if kind not in self.kinds:
            raise s.fail(f"{where} must be {' or '.join(sorted(self.kinds))}, got {kind}")


class MStr(MsgSchema):
    """A str (utf-8) of at most `max_len` bytes; one of `choices` when given."""

    kinds = frozenset({"str"})

    def __init__(self, max_len: int, choices: Iterable[str] | None = None):
        self.max_len = max_len
        self.choices = None if choices is None else frozenset(choices)
        self.limits = (max_len, 0, 0, 0)

    def scan(self, s: Scan, where: str) -> None:
        kind, n = s.head()
        if kind != "str":
            raise s.fail(f"{where} must be a str, got {kind}")
        if n > self.max_len:
            raise s.fail(f"{where} is a str of {n} bytes, at most {self.max_len} allowed")
        if self.choices is None:
            s.skip(n)
        elif s.text(n) not in self.choices:
            raise s.fail(f"{where} must be one of {sorted(self.choices)}")


class MBin(MsgSchema):
    """A bin of at most `max_len` bytes (None: as long as the document allows)."""

    kinds = frozenset({"bin"})

    def __init__(self, max_len: int | None = None):
        self.max_len = max_len
        self.limits = (0, max_len, 0, 0)

    def scan(self, s: Scan, where: str) -> None:
        kind, n = s.head()
        if kind != "bin":
            raise s.fail(f"{where} must be a bin, got {kind}")
        if self.max_len is not None and n > self.max_len:
            raise s.fail(f"{where} is a bin of {n} bytes, at most {self.max_len} allowed")
        s.skip(n)


class MOneOf(MsgSchema):
    """One of `alternatives`, told apart by kind (so their kinds must not overlap)."""

    def __init__(self, *alternatives: MsgSchema):
        self.alternatives = alternatives
        self.kinds = frozenset().union(*(a.kinds for a in alternatives))
        self._merge(*alternatives)

    def scan(self, s: Scan, where: str) -> None:
        kind = s.peek()
        for alt in self.alternatives:
            if kind in alt.kinds:
                alt.scan(s, where)
                return
        raise s.fail(f"{where} must be {' or '.join(sorted(self.kinds))}, got {kind}")


class MList(MsgSchema):
    """An array of at most `max_len` items, each `item`."""

    kinds = frozenset({"array"})

    def __init__(self, item: MsgSchema, max_len: int):
        self.item, self.max_len = item, max_len
        self._merge(item, own=(0, 0, max_len, 0))

    def scan(self, s: Scan, where: str) -> None:
        inner = where + "[]"
        for _ in range(s.count("array", self.max_len, where)):
            self.item.scan(s, inner)


class MTuple(MsgSchema):
    """An array of exactly ``len(items)`` values, the i-th one ``items[i]``."""

    kinds = frozenset({"array"})

    def __init__(self, *items: MsgSchema):
        self.items = items
        self._labels = [f"[{i}]" for i in range(len(items))]
        self._merge(*items, own=(0, 0, len(items), 0))

    def scan(self, s: Scan, where: str) -> None:
        if s.count("array", len(self.items), where) != len(self.items):
            raise s.fail(f"{where} must be an array of {len(self.items)} items")
        for item, label in zip(self.items, self._labels, strict=True):
            item.scan(s, where + label)


class MMap(MsgSchema):
    """A map with str keys: each of `required` once, any of `optional` at most once, no
    other key; the arrays under the keys `same_len` all of one length."""

    kinds = frozenset({"map"})

    def __init__(self, required: Mapping[str, MsgSchema],
                 optional: Mapping[str, MsgSchema] | None = None, same_len: Iterable[str] = ()):
        self.required, self.optional = dict(required), dict(optional or {})
        self.same_len = frozenset(same_len)
        assert all(isinstance(self.required.get(k), MList) for k in self.same_len)
        self.fields = {**self.required, **self.optional}
        assert all(len(k.encode()) <= _MAX_KEY for k in self.fields)
        self._merge(*self.fields.values(), own=(_MAX_KEY, 0, 0, len(self.fields)))

    def scan(self, s: Scan, where: str) -> None:
        top = None
        if s.spans is None:  # the document's own map: its values' byte ranges are kept
            top = s.spans = {}
        seen: set[str] = set()
        lengths: set[int] = set()
        for _ in range(s.count("map", len(self.fields), where, 2)):
            kind, n = s.head()
            if kind != "str" or n > _MAX_KEY:
                raise s.fail(f"{where}: a key must be a str of at most {_MAX_KEY} bytes")
            key = s.text(n)
            if key not in self.fields:
                raise s.fail(f"{where}: unexpected key {short_repr(key)}")
            if key in seen:
                raise s.fail(f"{where}: duplicate key {short_repr(key)}")
            seen.add(key)
            start = s.pos
            if key in self.same_len:
                length = s.count("array", len(s.buf), where)
                if lengths and length not in lengths:
                    raise s.fail(f"{where}: {', '.join(sorted(self.same_len))} must be arrays "
                                 f"of one length")
                lengths.add(length)
                s.pos = start
            self.fields[key].scan(s, f"{where}.{key}")
            if top is not None:
                top[key] = (start, s.pos)
        missing = self.required.keys() - seen
        if missing:
            raise s.fail(f"{where} lacks {', '.join(sorted(missing))}")


class MDict(MsgSchema):
    """A map of at most `max_len` distinct str keys (each at most `max_key` bytes) to
    `value`."""

    kinds = frozenset({"map"})

    def __init__(self, max_key: int, value: MsgSchema, max_len: int):
        self.max_key, self.value, self.max_len = max_key, value, max_len
        self._merge(value, own=(max_key, 0, 0, max_len))

    def scan(self, s: Scan, where: str) -> None:
        keys: set[str] = set()
        inner = where + "[]"
        for _ in range(s.count("map", self.max_len, where, 2)):
            kind, n = s.head()
            if kind != "str" or n > self.max_key:
                raise s.fail(f"{where}: a key must be a str of at most {self.max_key} bytes")
            key = s.text(n)
            if key in keys:
                raise s.fail(f"{where}: duplicate key {short_repr(key)}")
            keys.add(key)
            self.value.scan(s, inner)


M_INT = MScalar("int")
M_NUM = MScalar("int", "float")
M_NIL = MScalar("nil")


def scan_checked(blob: object, schema: MsgSchema, what: str) -> Scan:
    """Check `blob` against `schema` without building anything (see :func:`unpack_checked`);
    the returned scan's ``spans`` holds the byte range of each value of a top-level map.

    Raises:
        DecodeError: The blob is not bytes-like, or not a document of this schema.
    """
    s = Scan(as_buffer(blob), what)
    schema.scan(s, what)
    if s.pos != s.end:
        raise s.fail(f"{s.end - s.pos} bytes after the document")
    return s


def build_scanned(s: Scan, schema: MsgSchema) -> Any:
    n = len(s.buf)
    max_str, max_bin, max_array, max_map = schema.limits
    try:
        return msgpack.unpackb(
            s.buf, raw=False, strict_map_key=True, use_list=True, max_ext_len=0,
            max_str_len=n if max_str is None else min(n, max_str),
            max_bin_len=n if max_bin is None else min(n, max_bin),
            max_array_len=min(n, max_array), max_map_len=min(n, max_map),
        )
    except Exception as e:  # msgpack raises ValueError/TypeError/UnicodeDecodeError/...
        raise s.fail(f"{type(e).__name__}: {e}") from e


def unpack_checked(blob: object, schema: MsgSchema, what: str) -> Any:
    """msgpack-decode `blob` after scanning it against `schema`.

    The scan rejects, before msgpack builds anything, every value of a kind, key or length
    the schema does not allow there, trailing bytes, ext types and declared lengths beyond
    the bytes left; msgpack then runs with the schema's own limits. Values (ranges, utf-8
    keys aside) are the caller's to check.

    Raises:
        DecodeError: The blob is not bytes-like, or not a document of this schema.
    """
    return build_scanned(scan_checked(blob, schema, what), schema)
