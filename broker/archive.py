"""Archiving fragment-stream entries to disk before the syncer trims them (msgpack files).

`diloco replay` rebuilds every round from the entries it merged. Redis keeps a fragment's
entries for ``broker.keep_rounds`` rounds after they are merged; a syncer configured with an
archive folder first writes the entries it is about to trim to that folder, so a run can be
replayed from its first round however long it ran.

Layout: ``<directory>/<run>/fNNNN/<first_id>_<last_id>.msgpack``, one file per call, written
atomically (a temporary file in the same folder, fsync, rename). A file is the msgpack map::

    {"v": 1, "run": str, "fragment": int,
     "entries": [[entry_id, [[field, value], ...]], ...]}    # field, value: msgpack bin

holding each entry's raw Redis fields (bytes) exactly as XRANGE returned them, so the
payload's sha256 still verifies after loading. Archiving the same entries twice (a syncer that
crashed between archiving and trimming archives them again) is harmless: loading merges files
by entry id and refuses only two *different* copies of one entry.

Reading never runs code chosen by the writer (msgpack, no pickle); a malformed file raises
:class:`ArchiveError`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgpack
import redis

from broker.errors import DecodeError
from broker.ids import as_text, id_key
from broker.keys import RunKeys
from broker.untrusted import M_INT, MBin, MList, MMap, MStr, MTuple, unpack_checked

ARCHIVE_VERSION = 1
SUFFIX = ".msgpack"
_RUN_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_ID_RE = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
_MAX_FILE_BYTES = 2**34
_MAX_ENTRIES = 2**20  # a file is one page of archive_below (1000 by default)
_MAX_FIELDS = 256  # an entry holds a dozen
# {"v": 1, "run": str, "fragment": int, "entries": [[entry_id, [[field, value], ...]], ...]}
_SCHEMA = MMap({"v": M_INT, "run": MStr(200), "fragment": M_INT, "entries": MList(
    MTuple(MStr(41), MList(MTuple(MBin(1024), MBin()), _MAX_FIELDS)), _MAX_ENTRIES)})

Fields = dict[bytes, bytes]


class ArchiveError(DecodeError):
    """An archive file is malformed, or two archived copies of one entry differ."""


def fragment_dir(directory: str | Path, run: str, fragment: int) -> Path:
    """The folder holding fragment `fragment`'s archive files of `run`.

    Raises:
        ValueError: If the run name is not a plain file name (letters, digits, '-', '_', '.')
            or the fragment is out of range.
    """
    if not _RUN_RE.fullmatch(run) or run in (".", ".."):
        raise ValueError(f"run name {run!r} cannot be archived: use letters, digits, '-', '_' "
                         f"or '.'")
    if not 0 <= int(fragment) <= 9999:
        raise ValueError(f"fragment must be in [0, 9999], got {fragment!r}")
    return Path(directory) / run / f"f{int(fragment):04d}"


def archive_entries(directory: str | Path, run: str, fragment: int,
                    entries: Iterable[tuple[bytes | str, Mapping[bytes, bytes]]]) -> Path | None:
    """Write `entries` (id, raw fields) of one fragment to a new archive file, atomically.

    The syncer calls this with the entries it is about to trim, just before ``XTRIM MINID``::

        rows = r.xrange(keys.fragment(p).frags, "-", f"({floor}")   # ids below the floor
        archive_entries(archive_dir, run, p, rows)
        streams.trim(p, floor)

    (:func:`archive_below` does exactly this, paging through the range.)

    Args:
        directory: The archive root folder (created if missing).
        run: Run name.
        fragment: Fragment index.
        entries: ``(entry_id, fields)`` pairs as redis-py's XRANGE returns them (bytes or
            str ids, ``dict[bytes, bytes]`` fields); str field names/values are encoded UTF-8.

    Returns:
        The written file, or None if `entries` is empty (nothing is written).

    Raises:
        ValueError: On an invalid run name, fragment or entry id.
        OSError: If the file cannot be written (no partial file is left behind).
    """
    rows = []
    for entry_id, fields in entries:
        eid = as_text(entry_id)
        if not _ID_RE.fullmatch(eid):
            raise ValueError(f"not a stream entry id: {eid!r}")
        rows.append([eid, [[_b(k), _b(v)] for k, v in fields.items()]])
    if not rows:
        return None
    rows.sort(key=lambda row: id_key(row[0]))
    folder = fragment_dir(directory, run, fragment)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{rows[0][0]}_{rows[-1][0]}{SUFFIX}"
    blob = msgpack.packb({"v": ARCHIVE_VERSION, "run": run, "fragment": int(fragment),
                          "entries": rows}, use_bin_type=True)
    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(folder)
    return path


def archive_below(r: redis.Redis, keys: RunKeys, fragment: int, min_id: str,
                  directory: str | Path, *, page: int = 1000,
                  file_bytes: int = 256 * 2**20) -> int:
    """Archive every entry of fragment `fragment`'s stream with an id below `min_id`.

    This is what ``XTRIM MINID min_id`` is about to delete; call it right before the trim.
    Entries are read a few at a time and written in files of at most `page` entries and
    about `file_bytes` bytes (one entry more at most): the memory this takes does not grow
    with the model or the backlog.

    Returns:
        The number of entries archived.

    Raises:
        ValueError, OSError: As :func:`archive_entries`; the caller should then skip the trim
            (keeping entries is always safe) and log the error.
    """
    key = keys.fragment(fragment).frags
    start, total, rows, held = "-", 0, [], 0
    while True:
        got = r.xrange(key, start, f"({min_id}", count=min(page, 16))
        for row in got:
            rows.append(row)
            held += sum(len(k) + len(v) for k, v in row[1].items())
            if len(rows) >= page or held >= file_bytes:
                archive_entries(directory, keys.run, fragment, rows)
                total, rows, held = total + len(rows), [], 0
        if len(got) < min(page, 16):
            if rows:
                archive_entries(directory, keys.run, fragment, rows)
                total += len(rows)
            return total
        start = f"({as_text(got[-1][0])}"


def load_archive(directory: str | Path, run: str, fragment: int) -> dict[str, Fields]:
    """Every archived entry of one fragment: entry id → raw fields (``dict[bytes, bytes]``).

    Returns an empty dict if nothing was archived for this fragment.

    Raises:
        ArchiveError: If a file is malformed, belongs to another run or fragment, or two
            files hold different copies of one entry.
        ValueError: On an invalid run name or fragment.
    """
    folder = fragment_dir(directory, run, fragment)
    out: dict[str, Fields] = {}
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob(f"*{SUFFIX}")):
        if path.name.startswith("."):
            continue
        for eid, fields in _read_file(path, run, int(fragment)):
            known = out.get(eid)
            if known is not None and known != fields:
                raise ArchiveError(f"{path}: entry {eid} differs from another archived copy")
            out[eid] = fields
    return out


def _read_file(path: Path, run: str, fragment: int) -> list[tuple[str, Fields]]:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > _MAX_FILE_BYTES:
                raise ArchiveError(f"{path}: {size} bytes exceeds the limit of {_MAX_FILE_BYTES}")
            blob = f.read(size + 1)  # read(n) allocates n bytes first: the size, not the limit
    except IsADirectoryError as e:
        raise ArchiveError(f"{path}: not a file") from e
    if len(blob) != size:
        raise ArchiveError(f"{path}: changed while it was read")
    try:
        doc = unpack_checked(blob, _SCHEMA, "archive file")
    except DecodeError as e:
        raise ArchiveError(f"{path}: {e}") from e
    del blob
    if doc["v"] != ARCHIVE_VERSION:
        raise ArchiveError(f"{path}: unsupported archive version {doc['v']!r}")
    if doc["run"] != run or doc["fragment"] != fragment:
        raise ArchiveError(f"{path}: holds run {doc['run'][:80]!r} fragment {doc['fragment']!r}, "
                           f"expected {run!r} fragment {fragment}")
    out = []
    for eid, pairs in doc["entries"]:
        if not _ID_RE.fullmatch(eid):
            raise ArchiveError(f"{path}: {eid!r} is not a stream entry id")
        fields: Fields = dict(pairs)  # type: ignore[arg-type]
        if len(fields) != len(pairs):
            raise ArchiveError(f"{path}: entry {eid} holds a field twice")
        out.append((eid, fields))
    return out


def _b(v: bytes | str | int | float) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, bytearray | memoryview):
        return bytes(v)
    return str(v).encode()


def fsync_dir(folder: Path) -> None:
    """Make the rename durable (best effort: not every platform can fsync a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
