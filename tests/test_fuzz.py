"""Fuzzing every decoder of bytes that come from Redis, ZeroMQ or a file (untrusted input).

Decoders: stream entries (:func:`broker.entries.parse_entry`), tensor payloads
(:func:`codec.unpack_tensors`), ZeroMQ messages (:func:`codec.parse_global_frames`), snapshots
(:func:`codec.unpack_snapshot`), the syncer state (:func:`state.unpack_state`), archive files
(:func:`archive.load_archive`), the JSON records (:class:`records.Heartbeat` …) and round
records (:meth:`records.RoundRecord.from_fields`, strict and lenient).

For each one:

* arbitrary input (bytes, msgpack documents, JSON values, field maps): only DecodeError escapes;
* mutations of a valid encoding (a value of another type, a number as text, a changed shape, a
  key dropped or added, a truncated buffer, huge declared lengths, flipped bytes), re-hashed so
  they pass the integrity checks (an entry's ``sha256``, a header's ``sha256`` of its buffers)
  and reach the schema checks: a decoder accepts a mutated input exactly when a reference check
  of the schema written here (independently, from the formats' documentation) does, and what it
  accepts it decodes to exactly what was encoded — encoding the result gives the same document;
* hostile inputs (amplification attempts): the peak memory tracemalloc sees while decoding
  (numpy allocations included) stays within 3 × (input size + allowed output) + 1 MiB.

The default budget is small and fixed (derandomized); the ``slow`` variants run 10× the examples.
"""

from __future__ import annotations

import gc
import json
import math
import re
import tracemalloc
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import archive
from broker.codec import (
    global_frames,
    pack_snapshot,
    pack_tensors,
    parse_global_frames,
    sha256_hex,
    topic,
    unpack_snapshot,
    unpack_tensors,
)
from broker.entries import entry_fields, parse_entry
from broker.errors import DecodeError
from broker.records import (
    Drop,
    FinalPushes,
    Heartbeat,
    Included,
    LearnerFinal,
    Reason,
    RoundRecord,
    SyncerFinal,
    SyncerInfo,
)
from broker.state import pack_state, unpack_state
from pipeline.contribution import PushHeader
from pipeline.quant import CODECS, data_nbytes, num_blocks, quantize

N = 50  # examples of each property by default; the slow variants run 10x as many
MiB = 2**20
INT64 = 2**63
WIRE = {"fp32": "<f4", "bf16": "<u2", "int8": "|i1", "int4": "|u1"}
BLOCKED = ("int8", "int4")


def _settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def fuzz(n: int = N, **strategies):
    """A property as two tests: `n` examples, and 10 n under the slow marker."""
    def deco(fn):
        fast = _settings(n)(given(**strategies)(fn))
        slow = pytest.mark.slow(_settings(10 * n)(given(**strategies)(fn)))
        return fast, slow
    return deco


def decoded(fn: Callable, *args, **kwargs) -> Any:
    """`fn`'s result, or None when it raised DecodeError (anything else fails the test)."""
    try:
        return fn(*args, **kwargs)
    except DecodeError:
        return None


def tree(blob: bytes) -> Any:
    return msgpack.unpackb(blob, raw=False, strict_map_key=False)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def same(a: Any, b: Any) -> bool:
    """Equal documents: bools are not numbers, an int equals the float of its value, maps are
    compared as maps."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    buffers = bytes | bytearray | memoryview
    if isinstance(a, buffers) and isinstance(b, buffers):
        return bytes(a) == bytes(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _int(x: Any, lo: int = 0, hi: int = INT64 - 1) -> bool:
    return type(x) is int and lo <= x <= hi


def _num(x: Any) -> bool:
    """A finite float, or an int that is a float exactly (read as that float)."""
    if type(x) is int:
        return x == float(x) if abs(x) < 2**1000 else False
    return type(x) is float and math.isfinite(x)


def _str(x: Any, max_bytes: int, min_len: int = 0) -> bool:
    return type(x) is str and len(x) >= min_len and len(x.encode("utf-8", "surrogatepass")) \
        <= max_bytes


# ------------------------------------------------------------------------- valid encodings


def _q(shape, codec_name: str, block: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    return quantize(np.asarray(rng.standard_normal(shape), np.float32), codec_name, block)


TENSORS = {"w": _q((2, 3), "fp32"), "b": _q((), "bf16"), "e": _q((5,), "int8", 2),
           "f": _q((3,), "int4", 2), "z": _q((0,), "fp32")}
INT8 = {"a": _q((4,), "int8", 3, 1), "m/b": _q((2, 2), "int8", 4, 2)}
META = PushHeader("L0", 7, 3, 120, 10, 2560)
PAYLOAD = pack_tensors(INT8)
MIXED = pack_tensors(TENSORS)
RUN, FRAG, VERSION = "run-1", 7, 3
FRAMES = [bytes(f) for f in global_frames(RUN, FRAG, VERSION, TENSORS)]
# the delta down link's message: the tensors are a delta against `base`, `value` the hash of
# the value they make
DELTA_FRAMES = [bytes(f) for f in global_frames(RUN, FRAG, VERSION, TENSORS, base=VERSION - 1,
                                                value="ab" * 32)]
SNAPSHOT = pack_snapshot(RUN, FRAG, VERSION, TENSORS)
THETA_SHAPES = {"a": (2, 3), "b": (), "c": (4,)}


def _state() -> dict:
    rng = np.random.default_rng(3)
    theta = {k: np.array(rng.standard_normal(s), np.float32) for k, s in THETA_SHAPES.items()}
    return {"fragment": 2, "version": 7, "theta": theta,
            "momentum": [np.array(v * 0.5, np.float32) for v in theta.values()]
            + [np.array(3, np.int32)],
            "history": {"6": {k: np.array(v + 1, np.float32) for k, v in theta.items()},
                        "7": dict(theta)},
            "seen": [["L0", 6, 10], ["L1", 7, 3]], "sync_time_s": 0.25, "norms": [1.0, 2.5],
            "merged_pushes": [["L0", 2, 6, 10, 10, 1280, 1.5, 4], ["L1", 1, 7, 3, 3, 384, 0.5,
                                                                  None]],
            "finished": ["L1"]}


STATE = bytes(pack_state(_state()))
ARCHIVE_ROWS = [("5-0", {b"learner": b"L0", b"payload": b"\x00\x01\x02"}),
                ("5-1", {b"a": b"1", b"b": b""})]


def entry_of(payload: bytes, **extra: bytes) -> dict[bytes, bytes]:
    """An entry of META around `payload`, re-hashed so it passes the integrity checks."""
    fields = {k.encode(): (v if isinstance(v, bytes) else str(v).encode())
              for k, v in entry_fields(META, INT8, "int8").items()}
    fields.update({b"payload": payload, b"nbytes": b"%d" % len(payload),
                   b"sha256": sha256_hex(payload).encode(), **extra})
    return fields


@pytest.fixture(scope="module")
def archive_file(tmp_path_factory) -> tuple[Path, bytes]:
    """The folder of a written archive file, and the file's bytes."""
    root = tmp_path_factory.mktemp("archive")
    path = archive.archive_entries(root, RUN, FRAG, ARCHIVE_ROWS)
    return root, path.read_bytes()


def load_archive_bytes(root: Path, blob: bytes) -> Any:
    """Decode `blob` as the only archive file of RUN fragment FRAG (under `root`)."""
    folder = archive.fragment_dir(root, RUN, FRAG)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        old.unlink()
    (folder / "5-0_5-1.msgpack").write_bytes(blob)
    return decoded(archive.load_archive, root, RUN, FRAG)


# -------------------------------------------------------------- reference schema checks


def ref_tensor(c: Any, shape: Any, block: Any, data: Any, scales: Any) -> bool:
    if not (type(shape) is list and len(shape) <= 32 and all(_int(d, 0, 2**40) for d in shape)):
        return False
    n = math.prod(shape)
    if n > 2**40 or not _int(block, -INT64, 2**64):
        return False
    if c in BLOCKED:
        if not 1 <= block <= 2**31 or type(scales) is not bytes \
                or len(scales) != 4 * num_blocks(n, block):
            return False
        sc = np.frombuffer(scales, "<f4")
        if not (np.isfinite(sc).all() and (sc >= 0).all()):
            return False
    elif block != 0 or scales is not None:
        return False
    return type(data) is bytes and len(data) == data_nbytes(c, n)


def ref_payload(doc: Any, codec_name: str | None = None) -> bool:
    """pack_tensors' document: {"v": 1, "t": [[name, codec, shape, block, dtype, data,
    scales|None], ...]}, names unique, buffers of the sizes shape and codec give."""
    if not (type(doc) is dict and doc.keys() == {"v", "t"} and type(doc["v"]) is int
            and doc["v"] == 1 and type(doc["t"]) is list):
        return False
    names = set()
    for row in doc["t"]:
        if type(row) is not list or len(row) != 7:
            return False
        name, c, shape, block, dtype, data, scales = row
        if not _str(name, 1024, 1) or name in names:
            return False
        names.add(name)
        if type(c) is not str or c not in CODECS or (codec_name and c != codec_name) \
                or type(dtype) is not str or dtype != WIRE[c]:
            return False
        if not ref_tensor(c, shape, block, data, scales):
            return False
    return True


def ref_global(h: Any, bufs: Any, snapshot: bool = False) -> bool:
    """A global header and its tensor buffers (the sha256 of the buffers in the header); a
    ZeroMQ message's may carry `base` (-1 ≤ base < version) with `value` (a sha256), a
    snapshot's only with base -1 (a snapshot holds a whole value)."""
    keys = {"v", "run", "fragment", "version", "names", "codecs", "shapes", "blocks", "sha256"}
    if type(h) is dict and h.keys() == keys | {"base", "value"}:
        if not (_int(h["base"], -1, 2**64) and _int(h["version"], 0, 2**64)
                and h["base"] < h["version"] and type(h["value"]) is str
                and re.fullmatch("[0-9a-f]{64}", h["value"])) or (snapshot and h["base"] != -1):
            return False
        h = {k: v for k, v in h.items() if k in keys}
    if not (type(h) is dict and h.keys() == keys and type(h["v"]) is int and h["v"] == 1
            and _str(h["run"], 256, 1) and _int(h["fragment"], 0, 9999)
            and _int(h["version"], 0, 2**64) and type(h["sha256"]) is str
            and re.fullmatch("[0-9a-f]{64}", h["sha256"])):
        return False
    lists = [h[k] for k in ("names", "codecs", "shapes", "blocks")]
    if not all(type(x) is list for x in lists) or len({len(x) for x in lists}) != 1:
        return False
    names, codecs, shapes, blocks = lists
    if not all(_str(n, 1024, 1) for n in names) or len(set(names)) != len(names):
        return False
    if not all(type(c) is str and c in CODECS for c in codecs):
        return False
    if not (type(bufs) is list and all(type(b) is bytes for b in bufs)):
        return False
    if len(bufs) != sum(2 if c in BLOCKED else 1 for c in codecs) \
            or sha256_hex(*bufs) != h["sha256"]:
        return False
    it = iter(bufs)
    for c, shape, block in zip(codecs, shapes, blocks, strict=True):
        data = next(it)
        scales = next(it) if c in BLOCKED else None
        if not ref_tensor(c, shape, block, data, scales):
            return False
    return True


def ref_snapshot(doc: Any) -> bool:
    return type(doc) is dict and doc.keys() == {"h", "t"} and ref_global(doc["h"], doc["t"],
                                                                         snapshot=True)


_DTYPES = {"<f4": 4, "<f8": 8, "<i4": 4, "<i8": 8}


def ref_nd(x: Any) -> tuple[str, tuple[int, ...]] | None:
    if not (type(x) is dict and x.keys() == {"__nd__"} and type(x["__nd__"]) is list
            and len(x["__nd__"]) == 3):
        return None
    dtype, shape, buf = x["__nd__"]
    if not (type(dtype) is str and dtype in _DTYPES and type(shape) is list and len(shape) <= 8
            and all(_int(d) for d in shape) and type(buf) is bytes
            and math.prod(shape) * _DTYPES[dtype] == len(buf)):
        return None
    return dtype, tuple(shape)


def ref_tensors(x: Any, want: dict | None) -> dict | None:
    """name -> shape of a map of fp32 arrays (of exactly `want`'s names and shapes if given;
    a stored (1,) stands for () there)."""
    if type(x) is not dict or not all(_str(k, 1024) for k in x):
        return None
    got = {}
    for k, v in x.items():
        nd = ref_nd(v)
        if nd is None or nd[0] != "<f4":
            return None
        got[k] = nd[1]
    if want is not None:
        if got.keys() != want.keys():
            return None
        for k, shape in got.items():
            if shape != want[k] and not (shape == (1,) and want[k] == ()):
                return None
        return want
    return got


def ref_state(doc: Any, shapes: dict | None = None) -> bool:
    """A syncer state: fragment, version, theta, momentum, seen, sync_time_s; history, norms,
    merged_pushes, merged_last (the older form of merged_pushes) and finished optional."""
    required = {"fragment", "version", "theta", "momentum", "seen", "sync_time_s"}
    optional = {"history", "norms", "merged_pushes", "merged_last", "finished"}
    if not (type(doc) is dict and required <= doc.keys() <= required | optional):
        return False
    if not (_int(doc["fragment"], 0, 9999) and _int(doc["version"])):
        return False
    want = ref_tensors(doc["theta"], shapes)
    if want is None:
        return False
    momentum = doc["momentum"]
    if type(momentum) is not list or len(momentum) > 4 * len(want) + 16:
        return False
    for m in momentum:
        nd = ref_nd(m)
        if nd is None:
            return False
        scalar = nd[1] in ((), (1,))
        if not scalar and (nd[1] not in want.values() or nd[0] != "<f4"):
            return False
    seen = doc["seen"]
    if not (type(seen) is list and all(
            type(s) is list and len(s) == 3 and _str(s[0], 1024, 1) and _int(s[1])
            and _int(s[2]) for s in seen)):
        return False
    if not (_num(doc["sync_time_s"]) and doc["sync_time_s"] >= 0):
        return False
    if "norms" in doc and not (type(doc["norms"]) is list and len(doc["norms"]) <= 4096 and all(
            _num(x) and x >= 0 for x in doc["norms"])):
        return False
    if "merged_last" in doc and not (type(doc["merged_last"]) is list and all(
            type(m) is list and len(m) == 7 and _str(m[0], 1024, 1)
            and all(_int(x) for x in m[1:6]) and _num(m[6]) and m[6] >= 0
            for m in doc["merged_last"])):
        return False
    if "merged_pushes" in doc and not (type(doc["merged_pushes"]) is list and all(
            type(m) is list and len(m) == 8 and _str(m[0], 1024, 1)
            and all(_int(x) for x in m[1:6]) and _num(m[6]) and m[6] >= 0
            and (m[7] is None or _int(m[7]))
            for m in doc["merged_pushes"])):
        return False
    if "finished" in doc and not (type(doc["finished"]) is list and all(
            _str(n, 1024, 1) for n in doc["finished"])):
        return False
    if "history" in doc:
        h = doc["history"]
        if type(h) is not dict or len(h) > 4096:
            return False
        for v, tensors in h.items():
            if not (_str(v, 20) and re.fullmatch("[0-9]+", v) and int(v) < INT64):
                return False
            if ref_tensors(tensors, want) is None:
                return False
    return True


def ref_archive(doc: Any) -> bool:
    """An archive file of RUN fragment FRAG: rows [entry_id, [[field, value], ...]], one copy
    of each entry (or identical copies), each field once."""
    if not (type(doc) is dict and doc.keys() == {"v", "run", "fragment", "entries"}
            and type(doc["v"]) is int and doc["v"] == 1 and doc["run"] == RUN
            and type(doc["fragment"]) is int and doc["fragment"] == FRAG
            and type(doc["entries"]) is list):
        return False
    copies: dict[str, dict] = {}
    for row in doc["entries"]:
        if not (type(row) is list and len(row) == 2 and type(row[0]) is str
                and re.fullmatch("[0-9]{1,20}-[0-9]{1,20}", row[0]) and type(row[1]) is list
                and len(row[1]) <= 256):
            return False
        if not all(type(p) is list and len(p) == 2 and all(type(x) is bytes for x in p)
                   and len(p[0]) <= 1024 for p in row[1]):
            return False
        fields = dict(map(tuple, row[1]))
        if len(fields) != len(row[1]) or copies.get(row[0], fields) != fields:
            return False
        copies[row[0]] = fields
    return True


def archive_tree(got: dict) -> list:
    return [[eid, [[k, v] for k, v in fields.items()]] for eid, fields in got.items()]


def archive_expected(doc: dict) -> list:
    out: dict[str, list] = {}
    for eid, pairs in doc["entries"]:
        out[eid] = pairs
    return [[eid, pairs] for eid, pairs in out.items()]


# ------------------------------------------------------------------------------- mutation

POOL = [None, True, False, 0, 1, -1, 7, 255, 2**31, 2**40, 2**62, 2**63, 2**64 - 1, -(2**63),
        0.0, 0.5, -1.5, 1e300, float("nan"), float("inf"), "", "x", "fp32", "int8", "<f4", "|i1",
        "<i4", "12", "L0", "5-0", "ab" * 200, b"", b"\x00" * 4, b"\xff" * 7, b"\x00\x00\x80\x7f",
        [], [0], [1, 2], [-1], [2**62] * 8, [2**40] * 33, [2**28, "a", None], {}, {"x": 1},
        {"__nd__": ["<f4", [1], b"\x00" * 4]}, {"__nd__": ["<f4", [2**62] * 8, b""]},
        [[[[[]]]]], [b""] * 40]


def nodes(obj: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += nodes(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += nodes(v, (*path, i))
    return out


def at(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def put(obj: Any, path: tuple, value: Any) -> Any:
    """`obj` with the node at `path` replaced (copied along the path)."""
    if not path:
        return value
    new = dict(obj) if isinstance(obj, dict) else list(obj)
    new[path[0]] = put(obj[path[0]], path[1:], value)
    return new


@st.composite
def mutated(draw, doc: Any, rounds: int = 2) -> tuple[Any, set]:
    """`doc` with 1..`rounds` mutations; also the paths touched."""
    touched = set()
    for _ in range(draw(st.integers(1, rounds))):
        path = draw(st.sampled_from(nodes(doc)))
        node = at(doc, path)
        ops = ["pool", "pool", "wrap"]
        if isinstance(node, int | float) and not isinstance(node, bool):
            ops += ["text", "float", "int", "big", "neg"]
        if isinstance(node, str):
            ops += ["bytes", "longer", "empty"]
        if isinstance(node, bytes):
            ops += ["text", "shorter", "longer"]
        if isinstance(node, list):
            ops += ["drop", "dup", "append", "shape"]
        if isinstance(node, dict):
            ops += ["del", "add"]
        op = draw(st.sampled_from(ops))
        if op == "pool":
            new = draw(st.sampled_from(POOL))
        elif op == "wrap":
            new = [node]
        elif op == "text":
            new = node.decode("latin-1") if isinstance(node, bytes) else str(node)
        elif op == "float":
            new = float(node)
        elif op == "int":
            # msgpack holds ints in [-2**63, 2**64): a float beyond them (1e300) has no int
            new = int(node) if math.isfinite(node) and -(2**63) <= node < 2**64 else 0
        elif op == "big":
            new = draw(st.sampled_from([2**32, 2**53 + 1, 2**63 - 1, 2**64 - 1]))
        elif op == "neg":
            new = max(-(2**63), -node - 1) if isinstance(node, int) else -node
        elif op == "bytes":
            new = node.encode()
        elif op == "longer":
            new = node + (b"\x00" if isinstance(node, bytes) else "\u00e9")
        elif op == "empty":
            new = ""
        elif op == "shorter":
            new = node[:-1]
        elif op == "drop" and node:
            new = [x for i, x in enumerate(node) if i != draw(st.integers(0, len(node) - 1))]
        elif op == "dup" and node:
            new = [*node, node[draw(st.integers(0, len(node) - 1))]]
        elif op == "append":
            new = [*node, draw(st.sampled_from(POOL))]
        elif op == "shape":
            new = draw(st.sampled_from([[*node, 1], node[:-1], [d + 1 if type(d) is int else d
                                                                for d in node], [2**62] * 3,
                                        [str(d) for d in node], [-1, *node]]))
        elif op == "del" and node:
            key = draw(st.sampled_from(list(node)))
            new = {k: v for k, v in node.items() if k != key}
        elif op == "add":
            new = {**node, draw(st.sampled_from(["x", "v", "__nd__", "sha256", "zz" * 40])):
                   draw(st.sampled_from(POOL))}
        else:
            new = draw(st.sampled_from(POOL))
        doc = put(doc, path, new)
        touched.add(path)
    return doc, touched


HUGE = [b"\xdd\xff\xff\xff\xff", b"\xdc\xff\xff", b"\xc6\x7f\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
        b"\xdf\x00\x10\x00\x00", b"\xc5\xff\xff", b"\xc1", b"\xd4\x01\x00", b"\x91" * 64]


@st.composite
def byte_mutated(draw, blob: bytes) -> bytes:
    """`blob` with flipped bits, a truncation, an insertion of a huge declared length (or an
    ext type, deep nesting), an overwrite, or a spliced chunk."""
    b = bytearray(blob)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "truncate", "huge", "overwrite", "splice"]))
        i = draw(st.integers(0, max(0, len(b) - 1)))
        if op == "flip" and b:
            b[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del b[i:]
        elif op == "huge":
            chunk = draw(st.sampled_from(HUGE))
            if draw(st.booleans()):
                b[i:i + len(chunk)] = chunk
            else:
                b[i:i] = chunk
        elif op == "overwrite" and b:
            b[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0x90, 0xC0, 0xC1, 0xC2, 0xC4, 0xCA,
                                         0xCB, 0xCF, 0xD3, 0xD9, 0xDC, 0xDE, 0xFF]))
        else:
            j = draw(st.integers(i, len(b)))
            b[draw(st.integers(0, len(b))):0] = b[i:j]
    return bytes(b)


# ------------------------------------------------------------ the binary formats, uniformly


def _rehash_snapshot(doc: Any) -> Any:
    if type(doc) is dict and type(doc.get("h")) is dict and type(doc.get("t")) is list \
            and all(type(b) is bytes for b in doc["t"]):
        return {**doc, "h": {**doc["h"], "sha256": sha256_hex(*doc["t"])}}
    return doc


class Format:
    """One binary format: its valid encoding, its decoder (None: refused), the reference
    check of a decoded msgpack tree, and the tree an accepted result encodes to."""

    def __init__(self, name: str, blob: bytes, decode, ref, encode):
        self.name, self.blob, self.decode, self.ref, self.encode = name, blob, decode, ref, encode

    def check(self, blob: bytes, doc: Any, exact: bool) -> None:
        """Decode `blob` (`doc`: its msgpack tree, or None when msgpack refuses it). `exact`:
        the decoder must accept it exactly when the reference check does (else: whatever it
        accepts must pass the check -- a byte-level change may also make msgpack itself read
        something other than the decoder does, e.g. a key twice)."""
        got = self.decode(blob)
        valid = doc is not None and self.ref(doc)
        if exact:
            assert (got is not None) == valid, (self.name, "accepted" if got is not None
                                                else "refused", doc)
        elif got is not None:
            assert valid, (self.name, "accepted", doc)
        if got is not None:
            assert same(self.encode(got), self.expected(doc)), (self.name, doc)

    def expected(self, doc: Any) -> Any:
        return archive_expected(doc) if self.name == "archive" else doc


def _frames_of(header: bytes) -> list[bytes]:
    return [FRAMES[0], header, *FRAMES[2:]]


def _formats(root: Path, archive_blob: bytes) -> dict[str, Format]:
    def frames_encode(got):
        h, tensors = got
        f = global_frames(h.run, h.fragment, h.version, tensors, base=h.base, value=h.value)
        return {"h": tree(f[1]), "t": [bytes(b) for b in f[2:]]}

    def frames_decode(header_blob):
        return decoded(parse_global_frames, _frames_of(header_blob))

    def frames_ref(h):  # the topic frame is fragment FRAG's
        return ref_global(h, FRAMES[2:]) and h["fragment"] == FRAG

    return {f.name: f for f in [
        Format("entry", PAYLOAD, lambda b: decoded(parse_entry, entry_of(b)),
               lambda d: ref_payload(d, "int8"), lambda got: tree(pack_tensors(got[1]))),
        Format("tensors", MIXED, lambda b: decoded(unpack_tensors, b), ref_payload,
               lambda got: tree(pack_tensors(got))),
        Format("frames", FRAMES[1], frames_decode, frames_ref,
               lambda got: frames_encode(got)["h"]),
        Format("delta frames", DELTA_FRAMES[1], frames_decode, frames_ref,
               lambda got: frames_encode(got)["h"]),
        Format("snapshot", SNAPSHOT, lambda b: decoded(unpack_snapshot, b), ref_snapshot,
               lambda got: tree(pack_snapshot(got[0].run, got[0].fragment, got[0].version,
                                              got[1]))),
        Format("state", STATE, lambda b: decoded(unpack_state, b), ref_state,
               lambda got: tree(pack_state(got))),
        Format("archive", archive_blob, lambda b: load_archive_bytes(root, b), ref_archive,
               archive_tree),
    ]}


FORMATS = ["entry", "tensors", "frames", "delta frames", "snapshot", "state", "archive"]


def _msgpack_or_none(blob: bytes) -> Any:
    try:
        return tree(blob)
    except Exception:
        return None


def test_valid_encodings_decode_and_round_trip(archive_file):
    """The starting points of the mutations are valid, and round trip exactly."""
    for f in _formats(*archive_file).values():
        f.check(f.blob, tree(f.blob), exact=True)
        assert f.decode(f.blob) is not None, f.name


@fuzz(data=st.data(), name=st.sampled_from(FORMATS))
def _structural_mutations(archive_file, data, name):
    f = _formats(*archive_file)[name]
    doc, touched = data.draw(mutated(tree(f.blob)))
    if name == "snapshot" and ("h", "sha256") not in touched:
        doc = _rehash_snapshot(doc)  # the entry re-hashes its payload in entry_of
    f.check(pack(doc), doc, exact=True)


test_structural_mutations, test_structural_mutations_slow = _structural_mutations


@fuzz(data=st.data(), name=st.sampled_from(FORMATS))
def _byte_mutations(archive_file, data, name):
    f = _formats(*archive_file)[name]
    blob = data.draw(byte_mutated(f.blob))
    doc = _msgpack_or_none(blob)
    if name == "snapshot" and doc is not None and data.draw(st.booleans()):
        doc = _rehash_snapshot(doc)
        blob = pack(doc)
    f.check(blob, doc, exact=False)


test_byte_mutations, test_byte_mutations_slow = _byte_mutations


_MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=16) | st.sampled_from(["v", "t", "h", "__nd__"]),
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.sampled_from(["v", "t", "h", "run", "theta", "entries", "__nd__", "x"])
                      | st.text(max_size=4), children, max_size=6),
    max_leaves=30)


@fuzz(data=st.data(), name=st.sampled_from(FORMATS),
      raw=st.one_of(st.binary(max_size=300), _MSGPACK_VALUES.map(pack)))
def _arbitrary_input(archive_file, data, name, raw):
    """Random bytes and random msgpack documents: only DecodeError, and nothing accepted
    that the reference check refuses."""
    f = _formats(*archive_file)[name]
    f.check(raw, _msgpack_or_none(raw), exact=False)


test_arbitrary_input, test_arbitrary_input_slow = _arbitrary_input


@fuzz(fields=st.dictionaries(
    st.sampled_from([b"learner", b"fragment", b"base_version", b"step", b"steps", b"tokens",
                     b"codec", b"nbytes", b"sha256", b"payload", b"seconds", b"final", "step",
                     "learner", b"x"]),
    st.one_of(st.binary(max_size=40), st.text(max_size=20), st.integers(-5, 10**20),
              st.none(), st.floats(), st.sampled_from([b"1", b"0", b"int8", PAYLOAD])),
    max_size=14), base=st.booleans())
def _entry_fields(fields, base):
    """Arbitrary plain fields (over a valid entry, or alone): only DecodeError."""
    entry = {**entry_of(PAYLOAD), **fields} if base else fields
    got = decoded(parse_entry, entry)
    if got is not None:  # what is accepted is a valid entry: it encodes again
        meta, tensors = got
        assert meta.learner and math.isfinite(meta.seconds) and meta.seconds >= 0
        assert all(q.codec == tensors[next(iter(tensors))].codec for q in tensors.values())
        entry_fields(meta, tensors, next(iter(tensors.values())).codec if tensors else "int8")


test_entry_fields, test_entry_fields_slow = _entry_fields


@fuzz(data=st.data())
def _frame_lists(data):
    """Messages with frames dropped, added, reordered or replaced by non-buffers."""
    frames: list[Any] = list(FRAMES)
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(["drop", "add", "swap", "junk"]))
        i = data.draw(st.integers(0, len(frames)))
        if op == "drop" and frames:
            del frames[min(i, len(frames) - 1)]
        elif op == "add":
            frames.insert(i, data.draw(st.binary(max_size=8)))
        elif op == "swap" and len(frames) > 1:
            j = data.draw(st.integers(0, len(frames) - 1))
            i = min(i, len(frames) - 1)
            frames[i], frames[j] = frames[j], frames[i]
        else:
            frames.insert(i, data.draw(st.sampled_from([None, 5, "text", 1.5, [b"x"]])))
    got = decoded(parse_global_frames, frames)
    if got is not None:
        assert frames == FRAMES


test_frame_lists, test_frame_lists_slow = _frame_lists


# ------------------------------------------------------------------------------- the state


@fuzz(data=st.data())
def _state_with_shapes(data):
    """unpack_state(shapes=...): accepts exactly the states whose theta (and history) holds
    these tensors, with these shapes, and then the same values as without shapes."""
    doc, _ = data.draw(mutated(tree(STATE)))
    blob = pack(doc)
    got = decoded(unpack_state, blob, shapes=THETA_SHAPES, max_bytes=len(blob))
    assert (got is not None) == ref_state(doc, THETA_SHAPES), doc
    if got is not None:
        assert {k: v.shape for k, v in got["theta"].items()} == THETA_SHAPES
        # without shapes, theta's stored shapes rule: a (1,) theta next to a () history
        # tensor (states of before and after 0-d shapes were kept, mixed) reads only with them
        plain = decoded(unpack_state, blob)
        for k, v in got["theta"].items():
            assert v.dtype == np.float32 and not v.flags.writeable  # views, no copies
            if plain is not None:
                np.testing.assert_array_equal(v.reshape(-1), plain["theta"][k].reshape(-1))
    assert decoded(unpack_state, blob, max_bytes=len(blob) - 1) is None


test_state_with_shapes, test_state_with_shapes_slow = _state_with_shapes


def test_state_schema_examples():
    """Named violations of the state schema, each refused with DecodeError."""
    base = tree(STATE)
    nd = {"__nd__": ["<f4", [2], b"\x00" * 8]}
    bad = [
        {**base, "theta": {**base["theta"], "a": {"__nd__": ["<f4", [2**28, "a", None], b""]}}},
        {**base, "theta": {**base["theta"], "a": {"__nd__": ["<f4", [2**62] * 8, b"\0" * 4]}}},
        {**base, "theta": {**base["theta"], "a": {"__nd__": ["<f4", [-1, -4], b"\0" * 16]}}},
        {**base, "theta": {**base["theta"], "a": {"__nd__": ["<f4", [2**64 - 1], b""]}}},
        {**base, "theta": {**base["theta"], "a": {"__nd__": ["<f4", [1] * 9, b"\0" * 4]}}},
        {**base, "theta": {**base["theta"], "a": {"__nd__": ["<U4", [1], b"\0" * 16]}}},
        {**base, "theta": {**base["theta"], "a": {"__nd__": ["<f8", [2, 3], b"\0" * 48]}}},
        {**base, "theta": {**base["theta"], "a": {"__nd__": 5}}},
        {**base, "theta": [nd]},
        {**base, "momentum": [*base["momentum"], {"__nd__": ["<f4", [7], b"\0" * 28]}]},
        {**base, "momentum": [*base["momentum"], {"__nd__": ["<i4", [4], b"\0" * 16]}]},
        {**base, "momentum": {"0": nd}},
        {**base, "version": "7"}, {**base, "version": -1}, {**base, "version": 7.0},
        {**base, "version": True}, {**base, "fragment": 10000}, {**base, "version": 2**63},
        {**base, "seen": [["L0", 1]]}, {**base, "seen": [["L0", -1, 2]]},
        {**base, "seen": [["", 1, 2]]}, {**base, "seen": [[b"L0", 1, 2]]},
        {**base, "sync_time_s": float("nan")}, {**base, "sync_time_s": -0.5},
        {**base, "sync_time_s": "0.5"}, {**base, "norms": [1.0, float("inf")]},
        {**base, "norms": [-1.0]}, {**base, "norms": [0.0] * 4097}, {**base, "norms": ["1"]},
        {**base, "history": {"x": base["history"]["6"]}},
        {**base, "history": {"6": {"a": base["history"]["6"]["a"]}}},
        {**base, "history": {"6": {**base["history"]["6"], "zz": nd}}},
        {**base, "finished": [""]}, {**base, "finished": [b"L1"]}, {**base, "finished": [1]},
        {**base, "finished": "L1"}, {**base, "finished": ["L" * 1025]},
        {**base, "extra": 1}, {k: v for k, v in base.items() if k != "seen"}, [base], 5,
    ]
    for doc in bad:
        assert not ref_state(doc), doc
        with pytest.raises(DecodeError):
            unpack_state(pack(doc))
    for blob in (b"", b"\xc1", STATE[:-1], STATE + b"\x00", b"\x91" * 10**5, None, "text"):
        with pytest.raises(DecodeError):
            unpack_state(blob)  # type: ignore[arg-type]
    with pytest.raises(DecodeError, match="limit"):
        unpack_state(STATE, max_bytes=len(STATE) - 1)
    with pytest.raises(DecodeError):
        unpack_state(STATE, shapes={**THETA_SHAPES, "c": (5,)})
    with pytest.raises(DecodeError):
        unpack_state(STATE, shapes={"a": (2, 3), "b": ()})


def test_state_round_trip_and_legacy_scalars():
    """pack_state keeps 0-d shapes now; a state written before (a 0-d array as (1,)) still
    reads, and with shapes= it reads as the 0-d tensor it was."""
    s = _state()
    got = unpack_state(pack_state(s), shapes=THETA_SHAPES)
    assert got["theta"]["b"].shape == () and got["momentum"][1].shape == ()
    assert got["momentum"][3].dtype == np.int32 and got["norms"] == [1.0, 2.5]
    for k in THETA_SHAPES:
        np.testing.assert_array_equal(got["theta"][k], s["theta"][k])
        np.testing.assert_array_equal(got["history"]["6"][k], s["history"]["6"][k])
    assert got["seen"] == s["seen"] and got["sync_time_s"] == 0.25
    legacy = tree(STATE)
    one = {"__nd__": ["<f4", [1], legacy["theta"]["b"]["__nd__"][2]]}
    legacy["theta"]["b"] = one
    legacy["momentum"][1] = one
    for h in legacy["history"].values():
        h["b"] = one
    got = unpack_state(pack(legacy), shapes=THETA_SHAPES)
    assert got["theta"]["b"].shape == () and got["momentum"][1].shape == (1,)
    assert unpack_state(pack(legacy))["theta"]["b"].shape == (1,)
    del s["history"], s["norms"]
    assert set(unpack_state(pack_state(s))) == set(s)


# ------------------------------------------------------------------------ the JSON records

RECORDS = [
    Heartbeat(t=1.5, step=5, tokens=40, tokens_per_s=9.5, versions=[1, 2], loss=3.2, pid=12,
              host="h", shard=0, max_tokens_per_step=64),
    SyncerInfo(t=2.0, endpoint="tcp://h:1", fragments=[0, 1], pid=3, rounds=4,
               versions={"0": 3, "1": 4}, last_reason="quorum", sync_time_s=0.1),
    FinalPushes(final=[0, 2], steps=9, tokens=90),
    LearnerFinal(hashes={"0": "a" * 64, "1": "b" * 64}, versions=[3, 4], steps=9, tokens=90,
                 step_s=0.5),
    SyncerFinal(versions={"0": 3}, rounds=2),
]


def _numbers_ok(v: Any) -> bool:
    """JSON numbers the reader takes: finite, ints of at most 20 characters."""
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return len(str(v)) <= 20
    if isinstance(v, list):
        return all(_numbers_ok(x) for x in v)
    if isinstance(v, dict):
        return all(_numbers_ok(x) for x in v.values())
    return True


def _depth(v: Any) -> int:
    if isinstance(v, list):
        return 1 + max((_depth(x) for x in v), default=0)
    if isinstance(v, dict):
        return 1 + max((_depth(x) for x in v.values()), default=0)
    return 0


def _containers(v: Any) -> int:
    if isinstance(v, list):
        return 1 + sum(_containers(x) for x in v)
    if isinstance(v, dict):
        return 1 + sum(_containers(x) for x in v.values())
    return 0


def _json_ok(v: Any, max_depth: int = 8, max_containers: int = 64) -> bool:
    """What the JSON reader takes at all (from text): finite numbers of at most 20
    characters, at most `max_containers` arrays and objects nested at most `max_depth`."""
    return _numbers_ok(v) and _depth(v) <= max_depth and _containers(v) <= max_containers


def ref_value(v: Any, tp: Any) -> tuple[bool, Any]:
    """(does `v` fit the annotation `tp`, its decoded value)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, x = ref_value(v, arg)
            if ok:
                return ok, x
        return False, None
    if tp is type(None):
        return v is None, None
    if tp is bool:
        return type(v) is bool, v
    if tp is int:
        return _int(v, -INT64), v
    if tp is float:
        return _num(v), float(v) if _num(v) else None
    if tp is str:
        return type(v) is str and len(v) <= 4096, v
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        if type(v) is not list or len(v) > 100_000:
            return False, None
        got = [ref_value(x, item) for x in v]
        return all(ok for ok, _ in got), [x for _, x in got]
    if typing.get_origin(tp) is dict:
        _, value = typing.get_args(tp)
        if type(v) is not dict or len(v) > 100_000 \
                or not all(type(k) is str and len(k) <= 4096 for k in v):
            return False, None
        got = {k: ref_value(x, value) for k, x in v.items()}
        return all(ok for ok, _ in got.values()), {k: x for k, (_, x) in got.items()}
    raise AssertionError(tp)


def ref_record(cls, data: Any, from_text: bool = True) -> dict | None:
    """The to_dict() of the record `data` (parsed from JSON text, or given as parsed)
    decodes to, or None if it must be refused."""
    if type(data) is not dict or (from_text and not _json_ok(data)):
        return None
    hints = typing.get_type_hints(cls)
    out = cls().to_dict()
    for k, v in data.items():
        if k in out:
            ok, x = ref_value(v, hints[k])
            if not ok:
                return None
            out[k] = x
    return out


@fuzz(data=st.data(), index=st.integers(0, len(RECORDS) - 1), as_bytes=st.booleans())
def _record_mutations(data, index, as_bytes):
    rec = RECORDS[index]
    doc, _ = data.draw(mutated(rec.to_dict()))
    text = json.dumps(doc, default=repr)  # bytes from the pool: as text
    got = decoded(type(rec).from_json, text.encode() if as_bytes else text)
    want = ref_record(type(rec), json.loads(text))
    assert (got is not None) == (want is not None), (doc, got)
    if got is not None:
        assert same(got.to_dict(), want), (doc, got)


test_record_mutations, test_record_mutations_slow = _record_mutations

_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.sampled_from(["step", "t", "versions", "hashes", "final", "host", "x"])
                      | st.text(max_size=5), children, max_size=6),
    max_leaves=25)


@fuzz(index=st.integers(0, len(RECORDS) - 1), raw=st.one_of(
    _JSON_VALUES.map(json.dumps), st.binary(max_size=60), st.text(max_size=60),
    _JSON_VALUES.map(lambda v: json.dumps(v).encode("utf-16")), _JSON_VALUES))
def _arbitrary_records(index, raw):
    """Random JSON, text, bytes or already-parsed values: only DecodeError, and an accepted
    one is exactly what the reference check makes of it."""
    cls = type(RECORDS[index])
    got = decoded(cls.from_json, raw)
    if got is not None:
        text = isinstance(raw, str | bytes)
        want = ref_record(cls, json.loads(raw) if text else raw, text)
        assert want is not None and same(got.to_dict(), want), (raw, got)


test_arbitrary_records, test_arbitrary_records_slow = _arbitrary_records


def test_record_examples():
    bad = ['{"versions": "abc"}', '{"versions": [1.5, null]}', '{"step": 1.5}', '{"t": 1e400}',
           '{"t": NaN}', '{"loss": Infinity}', '{"loss": "x"}', '{"host": 5}', '{"pid": true}',
           '{"versions": [' + "9" * 30 + "]}", '{"x": ' + "[" * 100 + "]" * 100 + "}",
           '{"x": [' + "[]," * 100 + "[]]}", '{"host": "' + "h" * 4097 + '"}',
           b'{"host": "\xff"}', "\ufeff{}", "[" * 10**5, '{"step": 1} x', "null"]
    for raw in bad:
        with pytest.raises(DecodeError):
            Heartbeat.from_json(raw)
    for cls, raw in [(SyncerInfo, '{"versions": [1]}'), (SyncerInfo, '{"versions": {"a": "x"}}'),
                     (LearnerFinal, '{"hashes": 5}'), (FinalPushes, '{"final": [[1]]}'),
                     (SyncerFinal, '{"versions": {"0": 2.5}}'), (FinalPushes, [1])]:
        with pytest.raises(DecodeError):
            cls.from_json(raw)
    # a newer writer's extra fields (any JSON) are ignored; ints read as floats where annotated
    hb = Heartbeat.from_json('{"step": 3, "t": 2, "new": {"a": [1, "x", null]}}')
    assert hb.step == 3 and hb.t == 2.0 and isinstance(hb.t, float)


# -------------------------------------------------------------------------- round records

REC = RoundRecord(version=7, fragment=1, reason="grace window over",
                  included=(Included("5-0", "L0", 2.5, 0), Included("6-1", "L1", 1.25, 2)),
                  dropped=(("4-0", Reason(Drop.STALE, "stale: base version 1, global 7")),),
                  hash="ab" * 32, tokens=4096, steps=20, scale=0.5, seconds=(1.5, 2.0),
                  quorum_wait_s=0.01, grace_wait_s=0.2, merge_s=0.003, syncer="s0", t=12.5)
_INT_TEXT = re.compile(r"-?[0-9]{1,19}")
_NO = object()


def _text_of(v: Any) -> Any:
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            return _NO
    return v


def ref_int(v: Any) -> Any:
    """An int, an integral float, or the text of either (at most 64 characters)."""
    v = _text_of(v)
    if isinstance(v, bool) or v is _NO:
        return _NO
    if isinstance(v, str):
        if len(v) > 64:
            return _NO
        if _INT_TEXT.fullmatch(v):
            x = int(v)
        else:
            f = ref_num(v)
            if f is _NO or f != int(f):
                return _NO
            x = int(f)
    elif isinstance(v, int):
        x = v
    else:
        f = ref_num(v)
        if f is _NO or f != int(f):
            return _NO
        x = int(f)
    return x if -INT64 <= x < INT64 else _NO


def ref_num(v: Any) -> Any:
    """A finite number or its text."""
    v = _text_of(v)
    if isinstance(v, bool) or v is _NO:
        return _NO
    if isinstance(v, int | float):
        return float(v) if _num(v) else _NO
    if isinstance(v, str) and len(v) <= 64:
        try:
            x = float(v)
        except ValueError:
            return _NO
        return x if math.isfinite(x) else _NO
    return _NO


def ref_text(v: Any) -> Any:
    v = _text_of(v)
    return v if isinstance(v, str) and len(v) <= 4096 else _NO


def ref_rows(v: Any) -> Any:
    """A list field: a list, or its JSON text (finite numbers, nested at most 2 deep)."""
    v = _text_of(v)
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            return _NO
        if not _json_ok(v, 2, 100_001):
            return _NO
    return v if isinstance(v, list) else _NO


def ref_included(row: Any) -> Any:
    if not (isinstance(row, list) and len(row) == 4 and type(row[0]) is str
            and len(row[0]) <= 4096 and type(row[1]) is str and len(row[1]) <= 4096
            and _num(row[2]) and row[2] >= 0 and _int(row[3])):
        return _NO
    return [row[0], row[1], float(row[2]), row[3]]


def ref_dropped(row: Any) -> Any:
    if not (isinstance(row, list) and len(row) == 2 and row[1] != ""
            and all(type(x) is str and len(x) <= 4096 for x in row)):
        return _NO
    return list(row)


def ref_second(x: Any) -> Any:
    return float(x) if _num(x) and x >= 0 else _NO


def ref_round(fields: dict, lenient: bool) -> dict | None:
    """The to_dict() of the round record `fields` decodes to; None: refused."""
    f = {_text_of(k): v for k, v in fields.items() if isinstance(k, str | bytes)}
    version = ref_int(f["version"]) if "version" in f else _NO
    if version is _NO or version < 0:
        return None
    out: dict[str, Any] = {"version": version}

    def field(key, conv, default, required=False):
        if key not in f:
            return default if lenient or not required else _NO
        x = conv(f[key])
        return default if x is _NO and lenient else x

    def rows(key, conv, required=False):
        value = field(key, ref_rows, [], required)
        if value is _NO:
            return _NO
        got = [conv(r) for r in value]
        if _NO in got and not lenient:
            return _NO
        return [r for r in got if r is not _NO]

    def fragment(v):
        x = ref_int(v)
        return x if x is not _NO and 0 <= x <= 9999 else _NO

    def nat(v):
        x = ref_int(v)
        return x if x is not _NO and x >= 0 else _NO

    def nonneg(v):
        x = ref_num(v)
        return x if x is not _NO and x >= 0 else _NO

    out["fragment"] = field("fragment", fragment, -1, True)
    out["reason"] = field("reason", ref_text, "")
    out["included"] = rows("included", ref_included, True)
    out["dropped"] = rows("dropped", ref_dropped)
    out["hash"] = field("hash", ref_text, "", True)
    out["tokens"] = field("tokens", nat, None)
    out["steps"] = field("steps", nat, None)
    out["scale"] = field("scale", nonneg, 1.0)
    out["seconds"] = rows("seconds", ref_second)
    for key in ("quorum_wait_s", "grace_wait_s"):
        x = field(key, ref_num, 0.0)
        out[key] = x if x is _NO else max(0.0, x)
    out["merge_s"] = field("merge_s", ref_num, 0.0)
    out["syncer"] = field("syncer", ref_text, "")
    out["t"] = field("t", ref_num, None)
    if _NO in out.values():
        return None
    if not lenient and len({r[0] for r in out["included"]}) != len(out["included"]):
        return None
    return {k: v for k, v in out.items() if v is not None}


def _redis_form(fields: dict) -> dict:
    """What XRANGE returns: bytes keys and values, lists as JSON text."""
    return {k.encode(): json.dumps(v, default=repr).encode() if isinstance(v, list | dict)
            else v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}


@fuzz(data=st.data(), form=st.sampled_from(["dict", "fields", "redis"]),
      lenient=st.booleans())
def _round_mutations(data, form, lenient):
    base = REC.to_dict() if form == "dict" else REC.to_fields()
    doc, _ = data.draw(mutated(base, 3))
    fields = _redis_form(doc) if form == "redis" and isinstance(doc, dict) else doc
    want = ref_round(fields, lenient) if isinstance(fields, dict) else None
    got = decoded(RoundRecord.from_fields, fields, lenient=lenient)
    assert (got is not None) == (want is not None), (fields, got)
    if got is not None:
        assert same(got.to_dict(), want), (fields, got)


test_round_mutations, test_round_mutations_slow = _round_mutations


@fuzz(fields=st.one_of(
    st.dictionaries(st.one_of(st.sampled_from(list(REC.to_fields())), st.text(max_size=6),
                              st.binary(max_size=6), st.integers()),
                    st.one_of(_JSON_VALUES, _JSON_VALUES.map(json.dumps), st.binary(max_size=30)),
                    max_size=12),
    st.sampled_from([None, [], "fields", 5])))
def _arbitrary_round_fields(fields):
    """Arbitrary field maps: strict and lenient raise nothing but DecodeError, and lenient
    raises nothing at all when the version is readable."""
    for lenient in (False, True):
        got = decoded(RoundRecord.from_fields, fields, lenient=lenient)
        want = ref_round(fields, lenient) if isinstance(fields, dict) else None
        assert (got is not None) == (want is not None), (fields, lenient)


test_arbitrary_round_fields, test_arbitrary_round_fields_slow = _arbitrary_round_fields


def test_round_record_examples():
    good = REC.to_fields()
    for change in [{"included": '[["e", "L", NaN, 1]]'}, {"included": '[["e", "L", 1, 1.7]]'},
                   {"included": '[[[1], {}, 1, 1]]'}, {"dropped": '[["e", 5]]'},
                   {"seconds": "[Infinity]"}, {"hash": b"\xff"}, {"hash": 5}, {"reason": [1]},
                   {"version": "1e300"}, {"version": "-1"}, {"fragment": 10000},
                   {"included": "[" * 10**5}, {"included": '[["e", "L", 1, ' + "9" * 30 + "]]"}]:
        with pytest.raises(DecodeError):
            RoundRecord.from_fields({**good, **change})
        if "version" not in change:  # lenient: read what can be, but the version is needed
            RoundRecord.from_fields({**good, **change}, lenient=True)
    for bad in ([1], None, "x"):
        with pytest.raises(DecodeError):
            RoundRecord.from_fields(bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- memory bounds


def measure(fn: Callable[[], Any]) -> tuple[int, int, Any]:
    """(peak extra bytes while `fn` ran, bytes its result holds, the result or None if it
    raised DecodeError)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        result = decoded(fn)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - base, held - base, result


def _array32(n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big")


def _map(**items: bytes) -> bytes:
    """A msgpack map of raw (already encoded) values."""
    return bytes([0x80 | len(items)]) + b"".join(pack(k) + v for k, v in items.items())


def _scalar_rows(n: int, bad_last: bool) -> bytes:
    rows = [[f"t{i}", "fp32", [], 0, "<f4", b"\x00" * 4, None] for i in range(n)]
    if bad_last:
        rows[-1][5] = b"\x00" * 3
    return pack({"v": 1, "t": rows})


def _header_of(n: int, block: int) -> bytes:
    return pack({"v": 1, "run": RUN, "fragment": FRAG, "version": 1,
                 "names": [f"t{i}" for i in range(n)], "codecs": ["fp32"] * n,
                 "shapes": [[]] * n, "blocks": [block] * n, "sha256": "0" * 64})


def _state_doc(**change: Any) -> bytes:
    return pack({**tree(STATE), **change})


def _seen_state(n: int, bad_last: bool) -> bytes:
    seen = [[f"L{i % 7}", i, i] for i in range(n)]
    if bad_last:
        seen[-1][1] = -1
    return _state_doc(seen=seen)


def _archive_blob(n: int, bad_last: bool) -> bytes:
    rows = [[f"{i}-0", [[b"k", b"vv"]]] for i in range(n)]
    if bad_last:
        rows[-1][0] = "x"
    return pack({"v": 1, "run": RUN, "fragment": FRAG, "entries": rows})


def _heartbeat_max() -> str:
    return json.dumps({**RECORDS[0].to_dict(), "versions": list(range(10**6, 10**6 + 100_000))})


# (name, a callable building the input, the decoder, the valid counterpart whose decoded size
# is the output allowed, or None: nothing may be built from it)
HOSTILE: list[tuple[str, Callable[[], Any], Callable[[Any], Any], Callable[[], Any] | None]] = [
    ("entry: t declares 2**32-1 rows",
     lambda: entry_of(b"\x82\xa1v\x01\xa1t" + _array32(2**32 - 1) + b"\x90" * MiB),
     parse_entry, None),
    ("entry: 100k empty arrays",
     lambda: entry_of(b"\x82\xa1v\x01\xa1t" + _array32(100_000) + b"\x90" * 100_000),
     parse_entry, None),
    ("tensors: nested a million deep", lambda: b"\x82\xa1v\x01\xa1t" + b"\x91" * MiB,
     unpack_tensors, None),
    ("tensors: a bin declaring 2 GiB",
     lambda: b"\x82\xa1v\x01\xa1t\x91\x97" + b"".join(map(pack, ["w", "fp32", [4], 0, "<f4"]))
     + b"\xc6\x80\x00\x00\x00" + b"\x00" * MiB, unpack_tensors, None),
    ("tensors: a shape product beyond 2**40",
     lambda: pack({"v": 1, "t": [["w", "fp32", [2**40] * 32, 0, "<f4", b"\x00" * MiB, None]]}),
     unpack_tensors, None),
    ("tensors: 10k valid rows, the last one short", lambda: _scalar_rows(10_000, True),
     unpack_tensors, lambda: unpack_tensors(_scalar_rows(10_000, False))),
    ("frames: 100k names, the other lists empty",
     lambda: [topic(FRAG), pack({**tree(_header_of(0, 0)), "names": ["ab"] * 100_000})],
     parse_global_frames, None),
    ("frames: 10k tensors with a bad block",
     lambda: [topic(FRAG), _header_of(10_000, 5), *[b"\x00" * 4] * 10_000],
     parse_global_frames, lambda: parse_global_frames(
         global_frames(RUN, FRAG, 1, {f"t{i}": _q((), "fp32") for i in range(10_000)}))),
    ("snapshot: 200k small bins for a 1-tensor header",
     lambda: _map(h=_header_of(1, 0), t=_array32(200_000) + b"\xc4\x02ab" * 200_000),
     unpack_snapshot, None),
    ("state: shape [2**28, 'a', None] (1 GiB before)",
     lambda: _state_doc(theta={"a": {"__nd__": ["<f4", [2**28, "a", None], b""]}}),
     unpack_state, None),
    ("state: shape product 2**496",
     lambda: _state_doc(theta={"a": {"__nd__": ["<f4", [2**62] * 8, b"\x00" * 4]}}),
     unpack_state, None),
    ("state: momentum nested a million deep",
     lambda: _map(fragment=b"\x00", version=b"\x00", momentum=b"\x91" * MiB), unpack_state, None),
    ("state: 20k seen, the last one bad", lambda: _seen_state(20_000, True), unpack_state,
     lambda: unpack_state(_seen_state(20_000, False))),
    ("archive: 500k empty rows",
     lambda: _map(v=b"\x01", run=pack(RUN), fragment=pack(FRAG),
                  entries=_array32(500_000) + b"\x90" * 500_000), "archive", None),
    ("archive: a bin declaring 4 GiB",
     lambda: _map(v=b"\x01", run=pack(RUN), fragment=pack(FRAG),
                  entries=b"\x91\x92\xa35-0\x91\x92\xc4\x01k\xc6\xff\xff\xff\xff"
                  + b"\x00" * MiB), "archive", None),
    ("archive: 20k entries, the last one bad", lambda: _archive_blob(20_000, True), "archive",
     lambda: _archive_blob(20_000, False)),
    ("json: nested a million deep", lambda: '{"x": ' + "[" * MiB + "]" * MiB + "}",
     Heartbeat.from_json, None),
    ("json: 300k empty arrays", lambda: '{"x": [' + "[]," * 300_000 + "[]]}",
     Heartbeat.from_json, None),
    ("json: 1 MiB of spaces and an emoji", lambda: ('{"host": "\U0001f600"' + " " * MiB
                                                    + "}").encode(), Heartbeat.from_json, None),
    ("json: spaces and an emoji just within the limit (text widens 4x)",
     lambda: ('{"host": "\U0001f600", "x": 1.5e400' + " " * (MiB - 64) + "}").encode(),
     Heartbeat.from_json, lambda: Heartbeat.from_json(_heartbeat_max())),
    ("json: 100k two-letter strings under an unknown key, then a bad step",
     lambda: '{"x": [' + '"ab",' * 99_999 + '"ab"], "step": "1"}', Heartbeat.from_json,
     lambda: Heartbeat.from_json(_heartbeat_max())),
    ("round record: included nested a million deep",
     lambda: {**REC.to_fields(), "included": "[" * MiB}, RoundRecord.from_fields, None),
    ("round record: 20k empty rows",
     lambda: {**REC.to_fields(), "included": "[" + "[]," * 20_000 + "[]]"},
     RoundRecord.from_fields, lambda: RoundRecord.from_fields(
         {**REC.to_fields(), "included": json.dumps([[f"{i}-0", "L0", 1.5, 0]
                                                    for i in range(20_000)])})),
]


def _size(obj: Any) -> int:
    """The input's size: its bytes (text as utf-8), fields and frames summed."""
    if isinstance(obj, bytes):
        return len(obj)
    if isinstance(obj, str):
        return len(obj.encode())
    if isinstance(obj, dict):
        return sum(_size(k) + _size(v) for k, v in obj.items())
    if isinstance(obj, list):
        return sum(_size(x) for x in obj)
    return 8


@pytest.mark.parametrize("name, make, decoder, valid", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_memory_is_bounded(tmp_path, name, make, decoder, valid):
    """Peak extra memory <= 3 x (input + allowed output) + 1 MiB, the input refused."""
    obj = make()
    if decoder == "archive":
        decoder = lambda b: load_archive_bytes(tmp_path, b)  # noqa: E731
        if valid is not None:
            valid_blob = valid()
            valid = lambda: load_archive_bytes(tmp_path, valid_blob)  # noqa: E731
    allowed = 0
    if valid is not None:
        _, allowed, result = measure(valid)
        assert result is not None, name
        del result
    peak, _, result = measure(lambda: decoder(obj))
    assert result is None, name
    size = _size(obj)
    bound = 3 * (size + allowed) + MiB
    assert peak <= bound, f"{name}: peak {peak / MiB:.1f} MiB > {bound / MiB:.1f} MiB " \
                          f"(input {size / MiB:.2f} MiB, allowed output {allowed / MiB:.2f} MiB)"


def test_memory_of_valid_decoding_is_bounded():
    """Decoding valid inputs too: peak <= 3 x (input + output) + 1 MiB."""
    big = {f"t{i}": _q((256, 64), c, 64, i) for i, c in enumerate(CODECS * 4)}
    blob = pack_tensors(big)
    int8 = pack_tensors({f"t{i}": _q((256, 64), "int8", 64, i) for i in range(16)})
    frames = global_frames(RUN, FRAG, 2, big)
    snap = pack_snapshot(RUN, FRAG, 2, big)
    s = _state()
    s["theta"] = {f"t{i}": np.ones((512, 256), np.float32) for i in range(8)}
    s["momentum"] = list(s["theta"].values())
    s["history"] = {"1": s["theta"]}
    state_blob = pack_state(s)
    for fn, size in [(lambda: unpack_tensors(blob), len(blob)),
                     (lambda: parse_entry(entry_of(int8)), len(int8)),
                     (lambda: parse_global_frames(frames), sum(len(f) for f in frames)),
                     (lambda: unpack_snapshot(snap), len(snap)),
                     (lambda: unpack_state(state_blob), len(state_blob))]:
        peak, held, result = measure(fn)
        assert result is not None
        assert peak <= 3 * (size + held) + MiB, (peak, size, held)
