"""Tests of broker.codec: round trips, validation, size limits and fuzzing of every decoder."""

from __future__ import annotations

import dataclasses
import pathlib
import random
import re

import msgpack
import numpy as np
import pytest

from broker import codec
from broker.codec import (
    MAX_PAYLOAD_BYTES,
    WIRE_VERSION,
    GlobalHeader,
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
from pipeline.contribution import Contribution, PushHeader
from pipeline.quant import CODECS, QTensor, dequantize, quantize

SHAPES = [(), (0,), (1,), (5,), (3, 7), (2, 0, 4), (65,), (129,)]


def _tensors(codec_name: str, seed: int = 0, block: int = 64) -> dict[str, QTensor]:
    rng = np.random.default_rng(seed)
    return {
        f"layer{i}/w": quantize(
            np.asarray(rng.standard_normal(shape), dtype=np.float32), codec_name, block
        )
        for i, shape in enumerate(SHAPES)
    }


def _assert_same(a: dict[str, QTensor], b: dict[str, QTensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        qa, qb = a[name], b[name]
        assert (qa.codec, tuple(qa.shape), qa.block) == (qb.codec, tuple(qb.shape), qb.block)
        assert qa.data.dtype == qb.data.dtype
        np.testing.assert_array_equal(qa.data, qb.data)
        assert (qa.scales is None) == (qb.scales is None)
        if qa.scales is not None:
            np.testing.assert_array_equal(qa.scales, qb.scales)
        np.testing.assert_array_equal(dequantize(qa), dequantize(qb))


def _redis_style(fields: dict) -> dict[bytes, bytes]:
    """What redis-py's XREAD returns: every key and value as bytes, ints as decimal ascii."""
    out = {}
    for k, v in fields.items():
        if isinstance(v, int):
            v = str(v).encode()
        elif isinstance(v, str):
            v = v.encode()
        out[k.encode()] = v
    return out


META = PushHeader("learner-3", 12, 40, 1000, 500, 2_048_000)


def _entry(codec_name: str = "int4", seed: int = 0) -> dict[bytes, bytes]:
    return _redis_style(entry_fields(META, _tensors(codec_name, seed), codec_name))


# ------------------------------------------------------------------------ round trips


def test_constants() -> None:
    assert MAX_PAYLOAD_BYTES == 256 * 2**20 and WIRE_VERSION == 1


@pytest.mark.parametrize("codec_name", CODECS)
def test_pack_unpack_tensors_round_trip(codec_name: str) -> None:
    tensors = _tensors(codec_name)
    blob = pack_tensors(tensors)
    assert isinstance(blob, bytes)
    doc = msgpack.unpackb(blob, raw=False)
    assert doc["v"] == 1 and [row[0] for row in doc["t"]] == list(tensors)
    assert (
        doc["t"][1][4] == {"fp32": "<f4", "bf16": "<u2", "int8": "|i1", "int4": "|u1"}[codec_name]
    )
    _assert_same(tensors, unpack_tensors(blob))


def test_pack_tensors_empty_mapping_and_odd_block() -> None:
    assert unpack_tensors(pack_tensors({})) == {}
    tensors = _tensors("int4", 1, block=7)
    _assert_same(tensors, unpack_tensors(pack_tensors(tensors)))


@pytest.mark.parametrize("codec_name", CODECS)
def test_entry_round_trip_with_redis_bytes(codec_name: str) -> None:
    meta = dataclasses.replace(META, seconds=2.5, final=True)
    tensors = _tensors(codec_name)
    fields = entry_fields(meta, tensors, codec_name)
    assert set(fields) == {
        "learner",
        "fragment",
        "base_version",
        "step",
        "steps",
        "tokens",
        "codec",
        "nbytes",
        "sha256",
        "payload",
        "seconds",
        "final",
    }
    assert fields["nbytes"] == len(fields["payload"])
    assert fields["sha256"] == sha256_hex(fields["payload"])
    got_meta, got = parse_entry(_redis_style(fields))
    assert got_meta == meta and (got_meta.seconds, got_meta.final) == (2.5, True)
    _assert_same(tensors, got)
    # str keys / int values (as a caller building the dict by hand would) also work.
    got_meta2, _ = parse_entry(fields)
    assert got_meta2 == meta


def test_an_entry_carries_its_learner_process_epoch() -> None:
    """The epoch goes on the wire only when set (an entry without one reads as epoch 0, as
    entries written before epochs do); a malformed epoch is refused like any bad field."""
    tensors = _tensors("int4")
    plain = entry_fields(META, tensors, "int4")
    assert "epoch" not in plain and parse_entry(_redis_style(plain))[0].epoch == 0
    meta = dataclasses.replace(META, epoch=7)
    fields = entry_fields(meta, tensors, "int4")
    assert fields["epoch"] == 7
    got, _ = parse_entry(_redis_style(fields))
    assert got.epoch == 7 and got == META  # bookkeeping: not part of the entry's identity
    for bad in (b"-1", b"x", b"1.5", b"", b"9" * 20):
        with pytest.raises(DecodeError, match="epoch"):
            parse_entry({**_redis_style(fields), b"epoch": bad})
    with pytest.raises(ValueError, match="epoch"):
        entry_fields(dataclasses.replace(META, epoch=-1), tensors, "int4")


def test_an_entry_carries_its_chain() -> None:
    """The chain (the step of the first push of the chain the entry continues) goes on the
    wire when set; an entry without one (a version before chains) reads as None. A chain
    that is not an int, or after the entry's own step, is refused."""
    tensors = _tensors("int4")
    plain = entry_fields(META, tensors, "int4")
    assert "chain" not in plain and parse_entry(_redis_style(plain))[0].chain is None
    fields = entry_fields(dataclasses.replace(META, chain=990), tensors, "int4")
    assert fields["chain"] == 990
    got, _ = parse_entry(_redis_style(fields))
    assert got.chain == 990 and Contribution.of(got, {}).chain == 990
    assert parse_entry(_redis_style(entry_fields(dataclasses.replace(META, chain=META.step),
                                                 tensors, "int4")))[0].chain == META.step
    for bad in (b"-1", b"x", b"", b"9" * 20, str(META.step + 1).encode()):
        with pytest.raises(DecodeError, match="chain"):
            parse_entry({**_redis_style(fields), b"chain": bad})
    for bad in (-1, META.step + 1, "3", 2.0):
        with pytest.raises(ValueError, match="chain"):
            entry_fields(dataclasses.replace(META, chain=bad), tensors, "int4")


def test_entry_fields_rejects_codec_mismatch_and_bad_meta() -> None:
    with pytest.raises(ValueError):
        entry_fields(META, _tensors("int8"), "int4")
    with pytest.raises(ValueError):
        entry_fields(PushHeader("l", -1, 0, 0, 0, 0), {}, "int4")
    with pytest.raises(ValueError):
        entry_fields(PushHeader("", 1, 0, 0, 0, 0), {}, "int4")
    with pytest.raises(ValueError):
        entry_fields(PushHeader("l", 1, 0, 0, 0, 0), {}, "int3")
    for bad in (-1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="seconds"):
            entry_fields(PushHeader("l", 1, 0, 0, 0, 0, seconds=bad), {}, "int4")


@pytest.mark.parametrize("codec_name", CODECS)
def test_global_frames_round_trip_zero_copy(codec_name: str) -> None:
    tensors = _tensors(codec_name)
    frames = global_frames("run-a", 7, 42, tensors)
    assert frames[0] == b"f0007"
    n_bufs = sum(2 if q.scales is not None else 1 for q in tensors.values())
    assert len(frames) == 2 + n_bufs
    first = tensors["layer0/w"]
    assert np.shares_memory(np.frombuffer(frames[2], np.uint8), first.data)
    header, got = parse_global_frames(frames)
    assert header == GlobalHeader(
        "run-a",
        7,
        42,
        tuple(tensors),
        (codec_name,) * len(tensors),
        tuple(tuple(q.shape) for q in tensors.values()),
        tuple(q.block for q in tensors.values()),
        sha256_hex(*frames[2:]),
    )
    _assert_same(tensors, got)
    assert np.shares_memory(got["layer0/w"].data, np.frombuffer(frames[2], np.uint8))


class _FrameWithBuffer:
    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


class _FrameWithBytes:
    def __init__(self, data: bytes) -> None:
        self.bytes = data


def test_parse_global_frames_accepts_frame_like_objects() -> None:
    tensors = _tensors("int8")
    raw = [bytes(f) for f in global_frames("r", 0, 1, tensors)]
    for wrap in (_FrameWithBuffer, _FrameWithBytes, bytearray, memoryview):
        _, got = parse_global_frames([wrap(f) for f in raw])
        _assert_same(tensors, got)
    zmq = pytest.importorskip("zmq")
    _, got = parse_global_frames([zmq.Frame(f) for f in raw])
    _assert_same(tensors, got)


@pytest.mark.parametrize("codec_name", CODECS)
def test_snapshot_round_trip(codec_name: str) -> None:
    tensors = _tensors(codec_name)
    blob = pack_snapshot("run-a", 3, 9, tensors)
    header, got = unpack_snapshot(blob)
    frames_header, _ = parse_global_frames(global_frames("run-a", 3, 9, tensors))
    assert header == frames_header
    _assert_same(tensors, got)


def test_topic_is_fixed_width() -> None:
    assert topic(0) == b"f0000" and topic(12) == b"f0012" and topic(9999) == b"f9999"
    assert not topic(1).startswith(topic(10)) and not topic(10).startswith(topic(1))
    for bad in (-1, 10000, True, 1.0):
        with pytest.raises(ValueError):
            topic(bad)


# ----------------------------------------------------------------------- validation


def test_oversized_rejected_before_unpacking(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = msgpack.unpackb

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    tensors = _tensors("int8")
    blob = pack_tensors(tensors)
    snap = pack_snapshot("r", 1, 1, tensors)
    frames = global_frames("r", 1, 1, tensors)
    entry = entry_fields(PushHeader("l", 1, 0, 0, 0, 0), tensors, "int8")
    monkeypatch.setattr(msgpack, "unpackb", spy)
    with pytest.raises(DecodeError, match="limit"):
        unpack_tensors(blob, max_bytes=len(blob) - 1)
    with pytest.raises(DecodeError, match="limit"):
        unpack_snapshot(snap, max_bytes=len(snap) - 1)
    with pytest.raises(DecodeError, match="limit"):
        parse_global_frames(frames, max_bytes=sum(len(f) for f in frames) - 1)
    with pytest.raises(DecodeError, match="limit"):
        parse_entry(_redis_style(entry), max_bytes=len(blob) - 1)
    assert calls == []
    unpack_tensors(blob, max_bytes=len(blob))
    assert calls == [1]


def test_entry_checksum_and_field_errors() -> None:
    good = _entry()
    cases = {
        "sha": {b"sha256": b"0" * 64},
        "nbytes": {b"nbytes": b"1"},
        "negative": {b"step": b"-1"},
        "not int": {b"tokens": b"12a"},
        "plus sign": {b"steps": b"+5"},
        "spaces": {b"steps": b" 5"},
        "float": {b"base_version": b"1.0"},
        "fragment": {b"fragment": b"f0012"},
        "codec": {b"codec": b"int8"},
        "unknown codec": {b"codec": b"int2"},
        "learner utf8": {b"learner": b"\xff\xfe"},
        "empty learner": {b"learner": b""},
    }
    for label, patch in cases.items():
        with pytest.raises(DecodeError):
            parse_entry({**good, **patch})
            pytest.fail(label)
    for key in set(good) - {b"seconds", b"final"}:  # those two: optional (older entries)
        with pytest.raises(DecodeError):
            parse_entry({k: v for k, v in good.items() if k != key})
    # A flipped payload bit with a matching nbytes field is caught by the checksum.
    payload = bytearray(good[b"payload"])
    payload[len(payload) // 2] ^= 1
    with pytest.raises(DecodeError, match="sha256"):
        parse_entry({**good, b"payload": bytes(payload)})
    assert parse_entry({**good, b"extra": b"ignored"})[0].learner == "learner-3"


def _doc(codec_name: str = "int8") -> dict:
    return msgpack.unpackb(pack_tensors(_tensors(codec_name)), raw=False)


def _row_patch(index: int, value: object, codec_name: str = "int8") -> bytes:
    doc = _doc(codec_name)
    doc["t"][3][index] = value
    return msgpack.packb(doc, use_bin_type=True)


def test_unpack_tensors_structure_errors() -> None:
    doc = _doc()
    bad_docs = [
        {**doc, "v": 2},
        {**doc, "v": True},
        {"v": 1},
        {**doc, "x": 1},
        {"v": 1, "t": {}},
        [1, []],
        {"v": 1, "t": [[1, 2, 3]]},
        {"v": 1, "t": doc["t"] + [doc["t"][0]]},  # duplicate name
    ]
    for bad in bad_docs:
        with pytest.raises(DecodeError):
            unpack_tensors(msgpack.packb(bad, use_bin_type=True))
    row_patches = [
        (0, ""),
        (0, 5),
        (1, "int2"),
        (1, "fp32"),  # codec/dtype/scales mismatch
        (2, [3, -7]),
        (2, [2**41]),
        (2, [2**20, 2**20, 2**20]),
        (2, [3, 7.0]),
        (2, "37"),
        (2, [3, 8]),  # data length mismatch
        (3, 0),
        (3, True),
        (3, 2**40),
        (4, "<f4"),
        (4, "<i1"),
        (5, "not bytes"),
        (5, b"\x00"),
        (6, None),
        (6, b"\x00\x00\x80\x7f"),  # scales length, inf
        (6, "s"),
    ]
    for index, value in row_patches:
        with pytest.raises(DecodeError):
            unpack_tensors(_row_patch(index, value))
    # Non-finite and negative scales.
    for bad_scale in (np.inf, np.nan, -1.0):
        doc = _doc()
        scales = np.frombuffer(doc["t"][3][6], "<f4").copy()
        scales[0] = bad_scale
        doc["t"][3][6] = scales.tobytes()
        with pytest.raises(DecodeError, match="scales"):
            unpack_tensors(msgpack.packb(doc, use_bin_type=True))
    # fp32 tensors must have block 0 and no scales.
    for index, value in ((3, 64), (6, b"\x00" * 4)):
        with pytest.raises(DecodeError):
            unpack_tensors(_row_patch(index, value, "fp32"))


def test_global_frames_errors() -> None:
    tensors = _tensors("int4")
    frames = [bytes(f) for f in global_frames("run", 5, 2, tensors)]
    header = msgpack.unpackb(frames[1], raw=False)

    def with_header(**patch: object) -> list[bytes]:
        return [frames[0], msgpack.packb({**header, **patch}), *frames[2:]]

    bad_messages = [
        [],
        frames[:1],
        frames[:-1],
        [*frames, b""],
        [b"f0006", *frames[1:]],
        [b"f00050", *frames[1:]],
        [frames[0], frames[1], *frames[2:-1], frames[-1] + b"\x00"],
        [frames[0], frames[1], b"\x01" + frames[2][1:], *frames[3:]],
        with_header(sha256="0" * 64),
        with_header(sha256="X" * 64),
        with_header(v=2),
        with_header(run=""),
        with_header(fragment=-1),
        with_header(version=-1),
        with_header(names=header["names"][:-1]),
        with_header(names=[header["names"][0]] * len(header["names"])),
        with_header(codecs=["int8"] * len(header["codecs"])),
        with_header(codecs=["nope"] * len(header["codecs"])),
        with_header(blocks=[0] * len(header["blocks"])),
        with_header(shapes=[[1]] * len(header["shapes"])),
        [frames[0], b"\xc1", *frames[2:]],
        [frames[0], msgpack.packb([1, 2]), *frames[2:]],
        [frames[0], frames[1], *frames[2:], 42],
    ]
    for message in bad_messages:
        with pytest.raises(DecodeError):
            parse_global_frames(message)
    for not_frames in (b"abc", "abc", None, 5):
        with pytest.raises(DecodeError):
            parse_global_frames(not_frames)  # type: ignore[arg-type]


def test_snapshot_errors() -> None:
    tensors = _tensors("bf16")
    doc = msgpack.unpackb(pack_snapshot("r", 1, 1, tensors), raw=False)
    bad_docs = [
        {"h": doc["h"]},
        {**doc, "t": doc["t"][:-1]},
        {**doc, "t": [*doc["t"][:-1], doc["t"][-1] + b"\x00\x00"]},
        {**doc, "t": ["x"] * len(doc["t"])},
        {**doc, "h": {**doc["h"], "sha256": "1" * 64}},
        {**doc, "extra": 1},
    ]
    for bad in bad_docs:
        with pytest.raises(DecodeError):
            unpack_snapshot(msgpack.packb(bad, use_bin_type=True))
    for not_bytes in ("text", None, 12):
        with pytest.raises(DecodeError):
            unpack_snapshot(not_bytes)  # type: ignore[arg-type]
        with pytest.raises(DecodeError):
            unpack_tensors(not_bytes)  # type: ignore[arg-type]


def test_pack_rejects_inconsistent_tensors() -> None:
    good = quantize(np.ones(10, np.float32), "int8", 4)
    for bad in (
        good._replace(codec="int3"),
        good._replace(scales=None),
        good._replace(data=good.data[:-1]),
        good._replace(data=good.data.astype(np.float32)),
        good._replace(shape=(11,)),
    ):
        for fn in (pack_tensors, lambda t: global_frames("r", 0, 0, t)):
            with pytest.raises(ValueError):
                fn({"w": bad})
    with pytest.raises(ValueError):
        pack_tensors({"": good})
    with pytest.raises(ValueError):
        global_frames("", 0, 0, {"w": good})
    with pytest.raises(ValueError):
        pack_snapshot("r", 0, -1, {"w": good})


def test_no_object_serialisation_in_sources() -> None:
    for module in (codec, __import__("pipeline.quant", fromlist=["x"])):
        source = pathlib.Path(module.__file__).read_text()
        assert "pickle" not in source.lower(), module.__name__
        assert not re.search(r"\b(marshal|shelve|eval|exec)\b", source), module.__name__


# --------------------------------------------------------------------------- fuzzing


def _decode_all(kind: str, obj: object) -> None:
    """Run one decoder; only DecodeError may escape, successes must dequantize."""
    try:
        if kind == "tensors":
            tensors = unpack_tensors(obj)  # type: ignore[arg-type]
        elif kind == "snapshot":
            tensors = unpack_snapshot(obj)[1]  # type: ignore[arg-type]
        elif kind == "frames":
            tensors = parse_global_frames(obj)[1]  # type: ignore[arg-type]
        else:
            tensors = parse_entry(obj)[1]  # type: ignore[arg-type]
    except DecodeError:
        return
    for q in tensors.values():
        dequantize(q)


def _mutate(rng: random.Random, blob: bytes) -> bytes:
    b = bytearray(blob)
    op = rng.randrange(5)
    if op == 0 and b:  # bit flips
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif op == 1:  # truncation
        del b[rng.randrange(len(b) + 1) :]
    elif op == 2:  # extension
        b += rng.randbytes(rng.randint(1, 16))
    elif op == 3 and b:  # byte overwrite with msgpack-significant values
        i = rng.randrange(len(b))
        b[i] = rng.choice([0x00, 0x7F, 0x80, 0x90, 0xC0, 0xC1, 0xC4, 0xD9, 0xDC, 0xDE, 0xFF])
    elif b:  # splice a chunk elsewhere
        i, j = sorted(rng.randrange(len(b)) for _ in range(2))
        k = rng.randrange(len(b))
        b[k:k] = b[i:j]
    return bytes(b)


def test_fuzz_random_bytes() -> None:
    rng = random.Random(1234)
    for i in range(2000):
        blob = rng.randbytes(rng.choice([0, 1, 2, 5, 17, 64, 300]))
        if i % 2:  # give it a msgpack map/array prefix to get past the first byte
            blob = bytes([rng.choice([0x82, 0x92, 0xDE, 0xDC, 0x81])]) + blob
        _decode_all(rng.choice(["tensors", "snapshot"]), blob)
        _decode_all("frames", [blob[:5], blob[5:], rng.randbytes(8)][: rng.randint(0, 3)])
        _decode_all("frames", [topic(1), blob])
        _decode_all(
            "entry",
            {**_FUZZ_ENTRY, b"payload": blob, b"nbytes": b"%d" % len(blob),
             b"sha256": sha256_hex(blob).encode()},
        )  # fmt: skip


_FUZZ_TENSORS = {
    **_tensors("int4", 5, block=3),
    **{f"b{k}": v for k, v in _tensors("bf16", 6).items()},
}
_FUZZ_ENTRY = _entry("int8", 7)


def test_fuzz_mutations() -> None:
    rng = random.Random(99)
    blob = pack_tensors(_FUZZ_TENSORS)
    snap = pack_snapshot("run", 4, 3, _FUZZ_TENSORS)
    frames = [bytes(f) for f in global_frames("run", 4, 3, _FUZZ_TENSORS)]
    for _ in range(2000):
        _decode_all("tensors", _mutate(rng, blob))
        _decode_all("snapshot", _mutate(rng, snap))
        mutated = list(frames)
        which = rng.randrange(len(mutated) + 1)
        if which == len(mutated):
            if rng.random() < 0.5:
                del mutated[rng.randrange(len(mutated))]
            else:
                mutated.insert(rng.randrange(len(mutated) + 1), rng.randbytes(4))
        else:
            mutated[which] = _mutate(rng, mutated[which])
        _decode_all("frames", mutated)
        entry = dict(_FUZZ_ENTRY)
        key = rng.choice(list(entry))
        entry[key] = _mutate(rng, entry[key])
        if key == b"payload" and rng.random() < 0.7:  # get past the checksum
            entry[b"nbytes"] = b"%d" % len(entry[key])
            entry[b"sha256"] = sha256_hex(entry[key]).encode()
        _decode_all("entry", entry)


_POOL = [None, True, -1, 0, 1, 3, 64, 2**63, 1.5, "", "x", "int4", "fp32", "<f4", "|u1",
         b"", b"\x00" * 4, [], [0], [-1], [2, 3], {}, {"a": 1}]  # fmt: skip


def _structural(rng: random.Random, obj: object, depth: int = 0) -> object:
    """Replace a random node of a decoded msgpack document by a pool value."""
    if depth and rng.random() < 0.25:
        return rng.choice(_POOL)
    if isinstance(obj, dict) and obj:
        key = rng.choice(list(obj))
        return {**obj, key: _structural(rng, obj[key], depth + 1)}
    if isinstance(obj, list) and obj:
        i = rng.randrange(len(obj))
        return [*obj[:i], _structural(rng, obj[i], depth + 1), *obj[i + 1 :]]
    return rng.choice(_POOL)


def test_fuzz_structure() -> None:
    rng = random.Random(7)
    doc = msgpack.unpackb(pack_tensors(_FUZZ_TENSORS), raw=False)
    snap = msgpack.unpackb(pack_snapshot("run", 4, 3, _FUZZ_TENSORS), raw=False)
    frames = [bytes(f) for f in global_frames("run", 4, 3, _FUZZ_TENSORS)]
    header = msgpack.unpackb(frames[1], raw=False)
    for _ in range(700):
        _decode_all("tensors", msgpack.packb(_structural(rng, doc), use_bin_type=True))
        _decode_all("snapshot", msgpack.packb(_structural(rng, snap), use_bin_type=True))
        new_header = msgpack.packb(_structural(rng, header), use_bin_type=True)
        _decode_all("frames", [frames[0], new_header, *frames[2:]])


@pytest.mark.parametrize("codec_name", CODECS)
def test_a_snapshot_in_name_order_takes_the_value_hash_as_its_own(codec_name: str) -> None:
    """The record's value hash (`tensors_hash`, by name) is the snapshot's header SHA-256 when
    the tensors are in name order: the syncer passes it instead of hashing the value again,
    and the blob is byte for byte the one hashed here."""
    from pipeline.quant import tensors_hash

    tensors = dict(sorted(_tensors(codec_name).items()))
    blob = pack_snapshot("r", 3, 7, tensors)
    assert pack_snapshot("r", 3, 7, tensors, sha256=tensors_hash(tensors)) == blob
    assert unpack_snapshot(blob)[0].sha256 == tensors_hash(tensors)
    # the whole-value message (`sync.down_delta = false`) takes it the same way
    frames = global_frames("r", 3, 7, tensors)
    assert global_frames("r", 3, 7, tensors, sha256=tensors_hash(tensors)) == frames
    assert parse_global_frames(frames)[0].sha256 == tensors_hash(tensors)
