"""The syncer's recent values (`pipeline.history`): kept as the wire's deltas or codes, rebuilt
bit for bit as learners rebuilt them, at a fraction of fp32's memory."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.downlink import encode_down, full_value
from pipeline.history import History


def _theta(rng, v):
    return {"a": rng.standard_normal((64, 33)).astype(np.float32) * (1 + v),
            "b": rng.standard_normal(500).astype(np.float32)}


@pytest.mark.parametrize("codec", ["int4", "int8", "bf16"])
def test_deltas_rebuild_every_kept_version_bit_for_bit(codec):
    rng = np.random.default_rng(0)
    theta = _theta(rng, 0)
    held = {0: {k: v.copy() for k, v in theta.items()}}  # what learners hold: R(v)
    h = History(0, held[0])
    whole = sum(a.nbytes for a in theta.values())
    for v in range(1, 12):
        theta = {k: x + 0.01 * rng.standard_normal(x.shape).astype(np.float32)
                 for k, x in theta.items()}
        sent, values = encode_down(theta, codec, 64, held[v - 1])
        held[v] = values
        h.add(v, values, sent, v - 1)
        h.keep_last(5)
        assert list(h) == list(range(max(0, v - 4), v + 1))
        for u in h:
            for k in theta:
                np.testing.assert_array_equal(h[u][k], held[u][k], err_msg=f"v{u} {k}")
        assert [u for u, _ in h.items()] == list(h)
        for u, values in h.items():
            assert all(np.array_equal(values[k], held[u][k]) for k in theta)
    # the oldest and the newest whole, and four deltas: about half of five whole values
    if codec == "int4":
        assert h.nbytes() < 2 * whole + 4 * whole * 0.15 < 0.6 * 5 * whole, (h.nbytes(), whole)
    assert 5 not in h and 11 in h


def test_a_value_sent_whole_in_a_codec_is_kept_coded_and_a_key_frame_whole():
    rng = np.random.default_rng(1)
    theta = _theta(rng, 0)
    sent, values = encode_down(theta, "bf16", 64)
    h = History(0, values)
    sent1, values1 = encode_down(_theta(rng, 1), "bf16", 64)
    h.add(1, values1, sent1, -1)
    sent2, values2 = encode_down(_theta(rng, 2), "bf16", 64)
    h.add(2, values2, sent2, -1)
    for u, want in ((0, values), (1, values1), (2, values2)):
        assert all(np.array_equal(h[u][k], want[k]) for k in want)
    key = _theta(rng, 3)
    h.add(3, key, full_value(key), -1)  # fp32: kept whole
    h.keep_last(2)
    assert list(h) == [2, 3] and all(np.array_equal(h[3][k], key[k]) for k in key)
    back = History.from_values({3: key, 2: values2})
    assert list(back) == [2, 3] and all(np.array_equal(back[2][k], values2[k]) for k in key)


def test_snapshots_kept_as_sent_rebuild_the_history_and_a_forged_delta_is_refused():
    """Redis keeps a fragment's ``sent:<v>`` as the delta sent but the oldest (whole): recovery
    rebuilds every version bit for bit, checks each delta against the hash of the value it
    names, and starts the chain again at a whole value when a delta's base is missing."""
    from broker import codec
    from broker.errors import DecodeError
    from pipeline.quant import tensors_hash
    from workers.recovery import history_from_snapshots

    rng = np.random.default_rng(1)
    theta = _theta(rng, 0)
    held = {0: {k: v.copy() for k, v in theta.items()}}
    blobs = {0: codec.pack_snapshot("r", 3, 0, full_value(held[0]))}
    for v in range(1, 6):
        theta = {k: x + 0.01 * rng.standard_normal(x.shape).astype(np.float32)
                 for k, x in theta.items()}
        sent, held[v] = encode_down(theta, "int4", 64, held[v - 1])
        blobs[v] = codec.pack_snapshot("r", 3, v, sent, base=v - 1,
                                       value=tensors_hash(held[v]))
    with pytest.raises(DecodeError, match="not a delta"):
        codec.unpack_snapshot(blobs[1])  # a reader that does not rebuild deltas refuses one
    shapes = {k: x.shape for k, x in theta.items()}
    h = history_from_snapshots(blobs, 2**30, shapes)
    assert list(h) == [0, 1, 2, 3, 4, 5]
    for u, values in h.items():
        assert all(np.array_equal(values[k], held[u][k]) for k in theta), u
    assert h.nbytes() < 0.5 * 6 * sum(a.nbytes for a in theta.values())  # kept as sent
    # the chain broken at v2 (its base gone): it starts again at the next whole value
    del blobs[2]
    blobs[4] = codec.pack_snapshot("r", 3, 4, full_value(held[4]))
    assert list(history_from_snapshots(blobs, 2**30, shapes)) == [4, 5]
    assert history_from_snapshots({1: blobs[1]}, 2**30, shapes) is None
    # a delta that does not make the value it names (a forged one: its own SHA-256 right)
    forged = {k: codec.QTensor(q.codec, q.shape, np.roll(q.data, 1), q.scales, q.block)
              for k, q in encode_down(theta, "int4", 64, held[4])[0].items()}
    blobs[5] = codec.pack_snapshot("r", 3, 5, forged, base=4, value=tensors_hash(held[5]))
    with pytest.raises(DecodeError, match="does not make the value"):
        history_from_snapshots(blobs, 2**30, shapes)
    # a delta of other tensors or shapes (a broadcast would build an n × n array) is refused
    # before it is applied
    for bad in ({"a": theta["a"]}, {"a": theta["a"].reshape(1, -1), "b": theta["b"]}):
        sent = encode_down(bad, "int4", 64, {k: np.zeros_like(x) for k, x in bad.items()})[0]
        blobs[5] = codec.pack_snapshot("r", 3, 5, sent, base=4, value=tensors_hash(held[5]))
        with pytest.raises(DecodeError, match="names and shapes"):
            history_from_snapshots(blobs, 2**30, shapes)
