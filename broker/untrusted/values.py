"""Values read from Redis records, checked before use: bounded text, finite numbers, integers
in range, JSON bounded before the parser runs, and a record dataclass from its JSON checked
field by field against its annotations.

Everything here takes a value as Redis returns it (bytes or str) and either returns a checked
Python value or raises :class:`~broker.errors.DecodeError`; none of it trusts a length, a depth
or a number it was given."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import types
import typing
from typing import Any

from broker.errors import DecodeError

MAX_ITEMS = 100_000  # items of one list or map of a record
MAX_TEXT = 4096  # characters of one str of a record
_MAX_JSON = 16 * 2**20  # bytes (characters) of one JSON value
# bytes beyond ASCII widen to up to 4 bytes a character when decoded: such JSON is held to this
_MAX_WIDE_JSON = 2**20
INT64 = 2**63
_MAX_DIGITS = 20
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_JSON_STRING_B = re.compile(_JSON_STRING.pattern.encode(), re.DOTALL)
# an innermost container (no container inside it), in JSON with its strings blanked out
_JSON_INNER = re.compile(r"\[[^\[\]{}]*\]|\{[^\[\]{}]*\}")
_JSON_INNER_B = re.compile(_JSON_INNER.pattern.encode())
_INT_TEXT = re.compile(r"-?[0-9]{1,19}")


def short(v: Any) -> str:
    """A short repr of an untrusted value, for messages."""
    if isinstance(v, list | dict | tuple | set):
        return f"<{type(v).__name__} of {len(v)} items>"
    text = repr(v[:48] if isinstance(v, str | bytes | bytearray) else v)
    return text if len(text) <= 60 else text[:57] + "..."


def bounded_text(v: Any, what: str, max_len: int = MAX_TEXT) -> str:
    """A str (or utf-8 bytes) of at most `max_len` characters."""
    if isinstance(v, bytes | bytearray | memoryview):
        if len(v) > 4 * max_len:
            raise DecodeError(f"{what}: longer than {max_len} characters")
        try:
            v = bytes(v).decode("utf-8")
        except UnicodeDecodeError as e:
            raise DecodeError(f"{what}: not utf-8") from e
    if not isinstance(v, str):
        raise DecodeError(f"{what}: expected text, got {type(v).__name__}")
    if len(v) > max_len:
        raise DecodeError(f"{what}: longer than {max_len} characters")
    return v


def finite_number(v: Any, what: str) -> float:
    """A finite number: an int or float, or its text (as Redis returns it)."""
    if isinstance(v, bool):
        raise DecodeError(f"{what}: a bool is not a number")
    if isinstance(v, int):  # only one that is a float exactly: the value is not changed
        try:
            x = float(v)
        except OverflowError:
            x = math.inf
        if x != v:
            raise DecodeError(f"{what}: {str(v)[:24]} is not a float exactly")
        return x
    if isinstance(v, float):
        x = v
    else:
        try:
            x = float(bounded_text(v, what, 64))
        except ValueError as e:
            raise DecodeError(f"{what}: not a number: {short(v)}") from e
    if not math.isfinite(x):
        raise DecodeError(f"{what}: not finite")
    return x


def int64(v: Any, what: str) -> int:
    """An int in [-2**63, 2**63): an int, an integral float, or the text of either."""
    if isinstance(v, int) and not isinstance(v, bool):
        x = v
    elif isinstance(v, str | bytes | bytearray | memoryview):
        text = bounded_text(v, what, 64)
        if _INT_TEXT.fullmatch(text):
            x = int(text)
        else:
            f = finite_number(text, what)
            if f != int(f):
                raise DecodeError(f"{what}: not an integer")
            x = int(f)
    else:
        f = finite_number(v, what)
        if f != int(f):
            raise DecodeError(f"{what}: not an integer")
        x = int(f)
    if not -INT64 <= x < INT64:
        raise DecodeError(f"{what}: out of range")
    return x


def nonneg_int(v: Any, what: str) -> int:
    x = int64(v, what)
    if x < 0:
        raise DecodeError(f"{what}: negative")
    return x


def _json_int(text: str) -> int:
    if len(text) > _MAX_DIGITS:
        raise ValueError(f"an int of {len(text)} digits")
    return int(text)


def _json_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"{text[:24]} is not finite")
    return x


def _json_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a JSON number")


def bounded_json(v: Any, what: str, *, max_depth: int = 8, max_containers: int = 64,
          max_items: int = MAX_ITEMS) -> Any:
    """JSON text (str or utf-8 bytes) decoded; anything else is returned as it is.

    Bounded before the parser runs: at most `max_containers` arrays and objects nested at
    most `max_depth` deep and `max_items` items (commas and colons) in all, numbers finite
    (NaN and Infinity refused) and of at most 20 digits.
    """
    if isinstance(v, bytearray | memoryview):
        v = bytes(v)
    if isinstance(v, bytes):
        if len(v) > (_MAX_JSON if v.isascii() else _MAX_WIDE_JSON):
            raise DecodeError(f"{what}: {len(v)} bytes of JSON exceed the limit")
        outside = _JSON_STRING_B.sub(b'""', v)
        inner, brackets = _JSON_INNER_B, (b"[", b"{", b",", b":", b"0")
    elif isinstance(v, str):
        if len(v) > _MAX_JSON:
            raise DecodeError(f"{what}: {len(v)} characters of JSON exceed the limit")
        outside = _JSON_STRING.sub('""', v)
        inner, brackets = _JSON_INNER, ("[", "{", ",", ":", "0")
    else:
        return v
    containers = outside.count(brackets[0]) + outside.count(brackets[1])
    if containers > max_containers:
        raise DecodeError(f"{what}: more than {max_containers} arrays and objects")
    if outside.count(brackets[2]) + outside.count(brackets[3]) > max_items:
        raise DecodeError(f"{what}: more than {max_items} items")
    for _ in range(max_depth):
        if not containers:
            break
        outside, n = inner.subn(brackets[4], outside)  # innermost containers -> a scalar
        containers -= n
        if not n:
            break
    if containers:
        raise DecodeError(f"{what}: nested deeper than {max_depth} or unbalanced")
    del outside
    try:
        text = v.decode("utf-8") if isinstance(v, bytes) else v
        return json.loads(text, parse_int=_json_int, parse_float=_json_float,
                          parse_constant=_json_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise DecodeError(f"{what}: not JSON: {str(e)[:80]}") from e


def typed(v: Any, tp: Any, what: str) -> Any:
    """`v` checked against the annotation `tp` (int, float, str, bool, None, unions of them,
    ``list[X]``, ``dict[str, X]``); an int reads as a float where a float is annotated."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return typed(v, arg, what)
            except DecodeError:
                pass
        raise DecodeError(f"{what}: {short(v)} is not {tp}")
    if tp is type(None):
        if v is not None:
            raise DecodeError(f"{what}: expected null, got {short(v)}")
        return None
    if tp is bool:
        if not isinstance(v, bool):
            raise DecodeError(f"{what}: expected a bool, got {short(v)}")
        return v
    if tp is int:
        if not isinstance(v, int) or isinstance(v, bool) or not -INT64 <= v < INT64:
            raise DecodeError(f"{what}: expected an int, got {short(v)}")
        return v
    if tp is float:
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise DecodeError(f"{what}: expected a number, got {short(v)}")
        return finite_number(v, what)
    if tp is str:
        if not isinstance(v, str) or len(v) > MAX_TEXT:
            raise DecodeError(f"{what}: expected text of at most {MAX_TEXT} characters, got "
                              f"{short(v)}")
        return v
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(v, list) or len(v) > MAX_ITEMS:
            raise DecodeError(f"{what}: expected a list of at most {MAX_ITEMS} items, got "
                              f"{short(v)}")
        return [typed(x, item, what + "[]") for x in v]
    if origin is dict:
        key, value = typing.get_args(tp)
        if not isinstance(v, dict) or len(v) > MAX_ITEMS:
            raise DecodeError(f"{what}: expected an object of at most {MAX_ITEMS} items, got "
                              f"{short(v)}")
        return {typed(k, key, what + " key"): typed(x, value, what + "[]")
                for k, x in v.items()}
    raise TypeError(f"no decoding of {tp}")  # a record annotated with something new


@functools.cache
def fields_of(cls) -> dict[str, Any]:
    """A record's field name -> its (resolved) annotation."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def record_from_json(cls, raw: Any, what: str):
    """A record dataclass from its JSON text: known fields only, each checked against its
    annotation (unknown keys, written by a newer process, are ignored)."""
    fields = fields_of(cls)
    lists = sum(typing.get_origin(tp) in (list, dict) for tp in fields.values())
    data = bounded_json(raw, what, max_items=lists * MAX_ITEMS + 1024)  # + the scalar fields
    if not isinstance(data, dict):
        raise DecodeError(f"{what}: expected a JSON object")
    kwargs = {k: typed(v, fields[k], f"{what}: {k}") for k, v in data.items() if k in fields}
    return cls(**kwargs)
