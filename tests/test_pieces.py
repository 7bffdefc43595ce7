"""Values of any size in pieces (`broker.pieces`, `broker.entries`): written whole or not at
all, read back piece by piece with each piece checked, replaced atomically, refused when
malformed — against a real redis-server; the manifest and entry checks without one."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import redis

from broker import pieces
from broker.connection import connect
from broker.entries import entry_fields, parse_entry, payload_size
from broker.errors import DecodeError
from broker.keys import RunKeys
from broker.streams import FragmentStreams
from pipeline import quant
from pipeline.contribution import PushHeader

KEYS = RunKeys("pieces")
FK = KEYS.fragment(0)


def _blob(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _manifest(nbytes: int, piece: int, shas: list[str] | None = None) -> bytes:
    if shas is None:
        shas = ["0" * 64] * -(-nbytes // piece)
    return json.dumps({"v": 1, "bytes": nbytes, "piece_bytes": piece, "sha256": shas}).encode()


# ------------------------------------------------------------------------ without a server


def test_a_manifest_is_checked_before_anything_is_allocated():
    ok = pieces.parse_manifest(_manifest(2500, 1000), 2500, "v")
    assert ok.span(2) == (2000, 500) and len(ok.sha256) == 3
    with pytest.raises(DecodeError, match="exceeds the limit of 2499"):
        pieces.parse_manifest(_manifest(2500, 1000), 2499, "v")
    for bad in (b"not json", b"[1, 2]", _manifest(2500, 1000, ["0" * 64] * 2),
                _manifest(2500, 1000, ["X" * 64] * 3), _manifest(2500, 0, []),
                json.dumps({"v": 2, "bytes": 10, "piece_bytes": 10, "sha256": ["0" * 64]}),
                json.dumps({"v": 1, "bytes": 10.0, "piece_bytes": 10, "sha256": ["0" * 64]}),
                json.dumps({"v": 1, "bytes": 10, "piece_bytes": 10, "sha256": ["0" * 64],
                            "x": 1}),
                # more pieces than any value may have: refused before the list is read
                _manifest(2**40, 1, [])):
        with pytest.raises(DecodeError):
            pieces.parse_manifest(bad, 2**50, "v")


def _entry(piece_bytes: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(1)
    tensors = {f"t{i}": quant.quantize(rng.standard_normal((64, 40)).astype(np.float32),
                                       "bf16") for i in range(3)}
    meta = PushHeader("L0", 0, 0, 10, 10, 640)
    return entry_fields(meta, tensors, "bf16", piece_bytes=piece_bytes), tensors


def test_a_push_larger_than_a_piece_is_split_across_entry_fields_and_joined_back():
    whole, tensors = _entry(2**20)
    split, _ = _entry(4096)
    assert "pieces" not in whole and split["pieces"] == 4  # 15,4xx bytes of payload
    assert [k for k in split if k.startswith("payload")] == \
        ["payload", "payload:1", "payload:2", "payload:3"]
    assert max(len(split[k]) for k in split if k.startswith("payload")) == 4096
    assert split["sha256"] == whole["sha256"] and split["nbytes"] == whole["nbytes"]
    assert payload_size(split) == whole["nbytes"]
    raw = {k.encode(): bytes(v) if isinstance(v, memoryview) else v for k, v in split.items()}
    meta, got = parse_entry(raw)
    assert meta.learner == "L0"
    for name, q in tensors.items():
        np.testing.assert_array_equal(quant.dequantize(got[name]), quant.dequantize(q))
    # a missing, reordered or oversized piece is refused before anything is decoded
    for change, why in ((lambda f: f.pop(b"payload:2"), "lacks field 'payload:2'"),
                        (lambda f: f.update({b"payload:1": raw[b"payload:3"],
                                             b"payload:3": raw[b"payload:1"]}), "sha256"),
                        (lambda f: f.update({b"pieces": b"5000"}), "from 1 to 4096"),
                        (lambda f: f.update({b"pieces": b"3"}), "nbytes field says")):
        bad = dict(raw)
        change(bad)
        with pytest.raises(DecodeError, match=why):
            parse_entry(bad)
    with pytest.raises(DecodeError, match="exceeds the limit"):
        parse_entry(raw, max_bytes=10_000)


# ---------------------------------------------------------------------------- with a server


@pytest.fixture
def r(redis_url):
    client = connect(redis_url)
    yield client
    client.close()


def test_values_round_trip_whole_or_in_pieces_and_replace_atomically(r):
    s = FragmentStreams(r, KEYS, piece_bytes=1000)
    state, snap = _blob(3500), _blob(999, 1)
    assert s.state.acquire_lease(0, "s0", 10_000)
    assert s.state.init_fragment(0, "s0", state=state, snapshot=snap)
    assert r.type(FK.state) == b"hash" and r.type(FK.global_) == b"string"  # 999 <= 1000
    man = json.loads(r.hget(FK.state, "m"))  # what `redis-cli HGET <key> m` shows
    assert man == {"v": 1, "bytes": 3500, "piece_bytes": 1000, "sha256": [
        hashlib.sha256(state[i:i + 1000]).hexdigest() for i in range(0, 3500, 1000)]}
    assert r.ttl(FK.state) == -1  # the staging key's TTL is cleared when it is named
    assert s.state.load_state(0, 3500) == state and s.read_global(0, 999) == snap
    with pytest.raises(DecodeError, match="exceeds the limit of 3499"):
        s.state.load_state(0, 3499)
    # a round that writes a smaller state and a snapshot in pieces: each key replaced whole
    state1, snap1 = _blob(1200, 2), _blob(2001, 3)
    s.state.commit_round(0, "s0", state=state1, snapshot=snap1, version=1, record={"version": 1},
                   ack_ids=[], extra_sent={0: snap})
    assert r.hlen(FK.state) == 3 and r.hlen(FK.sent(1)) == 4 and r.hlen(FK.global_) == 4
    assert s.state.load_state(0, 2**20) == state1 and s.read_global(0, 2**20) == snap1
    assert s.state.load_sent(0, [0, 1, 2], 2**20) == {0: snap, 1: snap1}
    assert pieces.nbytes(r, FK.sent(1)) == 2001 and pieces.nbytes(r, FK.sent(0)) == 999
    s.state.checkpoint(0, "s0", state=b"small", version=1)
    assert r.type(FK.state) == b"string" and s.state.load_state(0, 10) == b"small"
    assert not list(r.scan_iter("*staging*"))


def test_a_writer_that_dies_between_pieces_leaves_nothing_visible(r):
    s = FragmentStreams(r, KEYS, piece_bytes=1000)
    assert s.state.acquire_lease(0, "s0", 10_000)
    assert s.state.init_fragment(0, "s0", state=b"old", snapshot=b"old")
    staged = pieces.stage(r, FK.state, _blob(5000), 1000)  # staged, never named
    assert staged is not None and staged.startswith(FK.state + ":staging:")
    assert 0 < r.pttl(staged) <= pieces.STAGE_TTL_MS  # it expires by itself
    assert s.state.load_state(0, 100) == b"old"
    # a commit whose staged pieces vanished (expired) writes nothing, and says why
    real_stage = pieces.stage
    try:
        def stage_then_lose(client, key, blob, piece_bytes, after_piece=None):
            name = real_stage(client, key, blob, piece_bytes, after_piece)
            if name:
                client.delete(name)
            return name
        pieces.stage = stage_then_lose
        with pytest.raises(redis.ConnectionError, match="expired before their commit"):
            s.state.commit_round(0, "s0", state=_blob(3000), snapshot=b"new", version=1,
                           record={"version": 1}, ack_ids=[])
    finally:
        pieces.stage = real_stage
    assert s.state.load_state(0, 100) == b"old" and s.read_global(0, 100) == b"old"
    assert not r.exists(FK.rounds) and not r.exists(FK.sent(1))
    # a commit fenced by the lease drops its staged pieces at once
    r.set(FK.lease, "s1")
    with pytest.raises(Exception, match="lease held by 's1'"):
        s.state.checkpoint(0, "s0", state=_blob(3000), version=0)
    assert [k for k in r.scan_iter("*staging*")] == [staged.encode()]


def test_a_value_replaced_while_it_is_read_is_read_again_whole(r, redis_url):
    s = FragmentStreams(r, KEYS, piece_bytes=1000)
    assert s.state.acquire_lease(0, "s0", 10_000)
    first, second = _blob(4000, 1), _blob(2500, 2)
    assert s.state.init_fragment(0, "s0", state=first, snapshot=b"x")
    writer = connect(redis_url)
    other = FragmentStreams(writer, KEYS, piece_bytes=1000)
    real_hget, calls = r.hget, []

    def hget(key, field):
        calls.append(field)
        if field == "2" and len(calls) == 4:  # between pieces 1 and 2 of the first read
            other.state.checkpoint(0, "s0", state=second, version=0)
        return real_hget(key, field)

    r.hget = hget
    try:
        assert s.state.load_state(0, 2**20) == second
    finally:
        r.hget = real_hget
        writer.close()
    # the first read's piece 2 was of the new value: it read the new manifest and its pieces
    assert calls == [pieces.MANIFEST, "0", "1", "2", pieces.MANIFEST, "0", "1", "2"], calls


def test_a_corrupt_piece_or_manifest_is_refused_with_the_key_named(r):
    s = FragmentStreams(r, KEYS, piece_bytes=1000)
    assert s.state.acquire_lease(0, "s0", 10_000)
    assert s.state.init_fragment(0, "s0", state=_blob(3000), snapshot=_blob(10))
    r.hset(FK.state, "1", b"forged" * 100)
    with pytest.raises(DecodeError, match=r"fragment 0's state at .*:state: piece 1 does not "
                                          r"match the manifest \(3 reads\)"):
        s.state.load_state(0, 2**20)
    r.hset(FK.state, "m", _manifest(2**40, 2**30))
    with pytest.raises(DecodeError, match="exceeds the limit"):
        s.state.load_state(0, 2**30)
    r.hdel(FK.state, "m")
    with pytest.raises(DecodeError, match="it has no manifest"):
        s.state.load_state(0, 2**30)
    r.delete(FK.state)
    r.rpush(FK.state, b"a list")
    with pytest.raises(DecodeError):
        s.state.load_state(0, 2**30)
    # read_many: strings in one round trip, the rest on their own, missing keys None
    r.set(FK.sent(3), b"three")
    got = pieces.read_many(r, [FK.sent(3), FK.sent(4), FK.global_], max_bytes=100)
    assert got[:2] == [b"three", None] and len(got[2]) == 10


def test_a_push_in_pieces_goes_through_redis_and_the_dead_letter_stream(r):
    fields, tensors = _entry(4096)
    s = FragmentStreams(r, KEYS)
    s.ensure_group(0)
    entry_id = s.push(0, fields)
    ((got_id, raw),) = r.xrange(FK.frags)
    assert got_id.decode() == entry_id and raw[b"pieces"] == b"4"
    meta, got = parse_entry(raw)
    assert set(got) == set(tensors) and meta.step == 10
    from broker.streams import Entry
    s.dead_letter(0, Entry(0, entry_id, raw), "test", keep_payload=False)
    ((_, dead),) = r.xrange(FK.dlq)
    assert not [k for k in dead if k.startswith(b"payload")] and dead[b"pieces"] == b"4"


def test_staging_that_outlasts_the_lease_extends_it_but_never_takes_it_back(r, monkeypatch):
    """Sending a large value takes time the lease was not renewed in: the owner extends its
    lease once the pieces are staged (if it still holds it), and a syncer that lost the lease
    meanwhile commits nothing."""
    import time

    from broker.commit import LeaseLost

    s = FragmentStreams(r, KEYS, piece_bytes=1000)
    assert s.state.acquire_lease(0, "s0", 400)
    assert s.state.init_fragment(0, "s0", state=b"old", snapshot=b"old")
    real_stage = pieces.stage

    def slow_stage(client, key, blob, piece_bytes, after_piece=None):
        def slow():  # 0.15 s a piece, 3 pieces: longer than the lease
            time.sleep(0.15)
            after_piece()
        return real_stage(client, key, blob, piece_bytes, slow)

    monkeypatch.setattr(pieces, "stage", slow_stage)
    assert s.state.acquire_lease(0, "s0", 400)
    s.state.checkpoint(0, "s0", state=_blob(3000), version=0)
    assert len(s.state.load_state(0, 2**20)) == 3000
    # the lease expires during staging and another syncer takes it: nothing is written
    assert s.state.acquire_lease(0, "s0", 400)

    def stage_and_lose(client, key, blob, piece_bytes, after_piece=None):
        def lose():
            time.sleep(0.15)
            client.set(FK.lease, "s1", px=10_000)  # taken by another syncer meanwhile
            after_piece()
        return real_stage(client, key, blob, piece_bytes, lose)

    monkeypatch.setattr(pieces, "stage", stage_and_lose)
    with pytest.raises(LeaseLost, match="held by 's1'"):
        s.state.checkpoint(0, "s0", state=_blob(4000), version=0)
    assert len(s.state.load_state(0, 2**20)) == 3000 and r.get(FK.lease) == b"s1"


def test_staging_renews_every_lease_held_and_a_checkpoint_retakes_an_expired_one(r, monkeypatch):
    """A syncer writing one fragment's large state for longer than a lease keeps its other
    fragments' leases too; a checkpoint whose lease expired with nobody taking it (the end of
    a run on a loaded host) takes it again instead of failing the run."""
    import time

    s = FragmentStreams(r, KEYS, piece_bytes=1000)
    other = RunKeys("pieces").fragment(1)
    for p in (0, 1):
        assert s.state.acquire_lease(p, "s0", 400)
    assert s.state.init_fragment(0, "s0", state=b"old", snapshot=b"old")
    real_stage = pieces.stage

    def slow_stage(client, key, blob, piece_bytes, after_piece=None):
        def slow():
            time.sleep(0.15)
            after_piece()
        return real_stage(client, key, blob, piece_bytes, slow)

    monkeypatch.setattr(pieces, "stage", slow_stage)
    s.state.checkpoint(0, "s0", state=_blob(5000), version=0)  # 5 pieces: 0.75 s
    assert r.get(other.lease) == b"s0"  # fragment 1's lease renewed as well
    monkeypatch.setattr(pieces, "stage", real_stage)
    r.delete(FK.lease)  # expired, and nobody took it
    s.state.checkpoint(0, "s0", state=_blob(3000, 4), version=0)
    assert s.state.load_state(0, 2**20) == _blob(3000, 4) and r.get(FK.lease) == b"s0"
