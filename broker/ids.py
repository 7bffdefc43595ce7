"""Small conversions of what Redis returns: bytes to text, and stream ids in order."""

from __future__ import annotations

from typing import Any


def as_text(v: Any) -> Any:
    """`v` decoded as UTF-8 (undecodable bytes replaced) if it is bytes; otherwise `v`."""
    return v.decode("utf-8", errors="replace") if isinstance(v, bytes | bytearray) else v


def id_key(entry_id: str) -> tuple[int, int]:
    """Sort key of a stream id: ids compare numerically ("5-10" comes after "5-9")."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
