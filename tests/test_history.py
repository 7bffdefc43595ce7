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
