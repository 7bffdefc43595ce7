"""The syncers' attestations of merged values (`broker.attest`): their wire form against
hostile input, and what a learner concludes from them about a snapshot read from Redis."""

import threading
import time

import msgpack
import pytest

from broker import attest, codec
from broker.errors import DecodeError

SHA = "ab" * 32


def test_an_attestation_goes_through_and_a_merged_value_is_not_one():
    got = attest.parse(attest.frames("run", 3, [(v, SHA) for v in range(2, 8)]))
    assert got == attest.Attestation("run", 3, tuple((v, SHA) for v in range(8 - attest.SENT, 8)))
    assert sum(len(f) for f in attest.frames("r" * 64, 3, [(2**40, SHA)] * attest.SENT)) < 600
    import numpy as np

    from pipeline import quant
    merged = codec.global_frames("run", 3, 7, {"w": quant.quantize(np.ones(4, np.float32),
                                                                  "fp32")})
    assert attest.parse(merged) is None


@pytest.mark.parametrize(("frames", "why"), [
    ([codec.topic(0), attest.MARK], "3 frames"),
    ([codec.topic(0), attest.MARK, b"x", b"y"], "3 frames"),
    ([codec.topic(0), attest.MARK, b"\x00" * 1100], "bytes"),
    ([codec.topic(0), attest.MARK, b"\xc1"], "attestation"),
    ([codec.topic(0), attest.MARK, msgpack.packb({"run": "r", "fragment": 0})], "attestation"),
    ([codec.topic(0), attest.MARK, msgpack.packb(
        {"run": "r", "fragment": 0, "hashes": [[1, SHA]], "x": 1})], "attestation"),
    ([codec.topic(0), attest.MARK, msgpack.packb(
        {"run": "r", "fragment": 0, "hashes": [[1, SHA]] * (attest.SENT + 1)})], "attestation"),
    ([codec.topic(0), attest.MARK, msgpack.packb(
        {"run": "r", "fragment": 0, "hashes": [[1, SHA, 2]]})], "attestation"),
    ([codec.topic(0), attest.MARK, msgpack.packb(
        {"run": "", "fragment": 0, "hashes": [[1, SHA]]})], "run"),
    ([codec.topic(0), attest.MARK, msgpack.packb(
        {"run": "r", "fragment": -1, "hashes": [[1, SHA]]})], "fragment"),
    ([codec.topic(0), attest.MARK, msgpack.packb(
        {"run": "r", "fragment": 0, "hashes": [[-1, SHA]]})], "version"),
    ([codec.topic(0), attest.MARK, msgpack.packb(
        {"run": "r", "fragment": 0, "hashes": [[2**63, SHA]]})], "attestation|version"),
    ([codec.topic(0), attest.MARK, msgpack.packb(
        {"run": "r", "fragment": 0, "hashes": [[1, "AB" * 32]]})], "hex"),
    ([codec.topic(1), attest.MARK, msgpack.packb(
        {"run": "r", "fragment": 0, "hashes": [[1, SHA]]})], "topic"),
])
def test_a_malformed_attestation_is_refused_with_its_reason(frames, why):
    with pytest.raises(DecodeError, match=why):
        attest.parse(frames)


def test_a_snapshot_is_taken_only_as_attested():
    a = attest.Attestations("run", 2, required=True)
    assert a.check(0, 5, SHA) == attest.UNKNOWN  # nothing heard yet: wait
    a.note("other", 0, 5, SHA)                   # another run's word counts for nothing
    a.note("run", 9, 5, SHA)                     # nor a fragment the run does not have
    assert a.check(0, 5, SHA) == attest.UNKNOWN and a.newest(0) == -1
    a.note("run", 0, 5, SHA)
    assert a.check(0, 5, SHA) == attest.OK
    assert a.check(0, 5, "cd" * 32) == attest.FORGED
    assert a.check(0, 6, SHA) == attest.UNKNOWN   # not attested yet
    assert a.check(0, 4, SHA) == attest.OLDER     # a newer one is: read it again
    assert a.check(1, 5, SHA) == attest.UNKNOWN   # per fragment
    for v in range(6, 6 + attest.KEEP):
        a.note("run", 0, v, SHA)
    assert a.check(0, 5, SHA) == attest.OLDER and a.newest(0) == 5 + attest.KEEP
    # without CURVE nothing is authenticated: any snapshot is taken, as before
    assert attest.Attestations("run", 2, required=False).check(0, 5, "cd" * 32) == attest.OK


def _header(fragment=0, version=3, names=("a", "b"), codecs=("fp32", "fp32"), blocks=(0, 0),
            run="run", sha=SHA):
    return codec.GlobalHeader(run, fragment, version, names, codecs, ((2,), (2,)), blocks, sha)


def test_a_snapshot_is_taken_only_in_the_layout_a_syncer_writes():
    """The attested hash covers the tensors' bytes one after the other: the names in order,
    one codec and one block size leave one way to cut them into tensors. A snapshot read as
    fragment 0 must say fragment 0 of this run (a genuine snapshot of another fragment
    relabelled is refused)."""
    a = attest.Attestations("run", 2, required=True, codec="fp32")
    a.note("run", 0, 3, SHA)
    assert a.snapshot(0, _header()) == attest.OK
    for bad in (_header(names=("b", "a")), _header(codecs=("fp32", "bf16")),
                _header(blocks=(0, 4)), _header(fragment=1), _header(run="other")):
        assert a.snapshot(0, bad) == attest.FORGED, bad
    assert attest.Attestations("run", 2, required=True, codec="bf16").snapshot(
        0, _header()) == attest.FORGED
    assert attest.Attestations("run", 2, required=False).snapshot(0, _header(
        names=("b", "a"))) == attest.OK


def test_a_joining_learner_waits_for_the_attestation_and_no_longer():
    a = attest.Attestations("run", 1, required=True)
    t0 = time.monotonic()
    assert a.wait(0, _header(), timeout_s=0.2) == attest.UNKNOWN
    assert 0.2 <= time.monotonic() - t0 < 2.0
    later = threading.Timer(0.1, a.note_all, (attest.Attestation("run", 0, ((2, SHA), (3, SHA))),))
    later.start()
    try:
        assert a.wait(0, _header(), timeout_s=10.0) == attest.OK
    finally:
        later.cancel()
