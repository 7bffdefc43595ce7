"""The typed cross-process records (broker/records.py): encode/decode round trips, strict
refusals, lenient reading for the tools, and the drop reasons' kinds."""

from __future__ import annotations

import json

import pytest

from broker.errors import DecodeError
from broker.records import (
    Drop,
    Heartbeat,
    Included,
    LearnerFinal,
    Reason,
    RoundRecord,
    SyncerInfo,
)

REC = RoundRecord(version=7, fragment=1, reason="grace window over",
                  included=(Included("5-0", "L0", 2.5, 0), Included("6-1", "L1", 1.25, 2)),
                  dropped=(("4-0", Reason(Drop.STALE, "stale: base version 1, global 7")),),
                  hash="ab" * 32, tokens=4096, steps=20, scale=0.5, seconds=(1.5, 2.0),
                  quorum_wait_s=0.01, grace_wait_s=0.2, merge_s=0.003, syncer="s0", t=12.5)


def redis_form(fields: dict) -> dict[bytes, bytes]:
    """What XRANGE returns for fields written by redis-py."""
    return {k.encode(): (v if isinstance(v, str) else repr(v)).encode()
            for k, v in fields.items()}


def test_round_record_round_trips_through_stream_fields_and_jsonl():
    assert RoundRecord.from_fields(redis_form(REC.to_fields())) == REC
    assert RoundRecord.from_fields(json.loads(json.dumps(REC.to_dict()))) == REC
    back = RoundRecord.from_fields(redis_form(REC.to_fields()))
    assert back.dropped[0][1].kind is Drop.STALE


@pytest.mark.parametrize("change", [
    {"version": "x"}, {"included": "not json"}, {"included": '[["5-0", "L0", 2.5]]'},
    {"included": '[["5-0", "L0", "heavy", 0]]'}, {"dropped": '[["4-0"]]'},
    {"seconds": '["soon"]'}, {"scale": "nan"},
    {"included": '[["5-0", "L0", 1, 0], ["5-0", "L1", 1, 0]]'},
], ids=str)
def test_strict_decoding_refuses_what_does_not_fit(change):
    fields = {**REC.to_fields(), **change}
    with pytest.raises(DecodeError):
        RoundRecord.from_fields(fields)


@pytest.mark.parametrize("missing", ["version", "fragment", "included", "hash"])
def test_strict_decoding_needs_the_identity_fields(missing):
    fields = {k: v for k, v in REC.to_fields().items() if k != missing}
    with pytest.raises(DecodeError):
        RoundRecord.from_fields(fields)


def test_lenient_decoding_keeps_what_it_can():
    fields = {**REC.to_fields(), "dropped": "bad", "scale": "x", "hash": None,
              "included": '[["5-0", "L0", 2.5, 0], ["broken"]]'}
    del fields["hash"]
    rec = RoundRecord.from_fields(fields, lenient=True)
    assert rec.included == (REC.included[0],) and rec.dropped == () and rec.scale == 1.0
    with pytest.raises(DecodeError):  # a version is needed even so
        RoundRecord.from_fields({"t": 1.0}, lenient=True)


@pytest.mark.parametrize("text, kind", [
    ("duplicate", Drop.DUPLICATE), ("defer: learner already contributed", Drop.DEFER),
    ("stale: base version 1, global version 9, max_staleness 4", Drop.STALE),
    ("base version 3 no longer held", Drop.UNANCHORED),
    ("base version 9 is ahead of global version 3", Drop.AHEAD),
    ("empty contribution (steps 0, tokens 0)", Drop.EMPTY),
    ("tensors do not match the fragment's names and shapes", Drop.SHAPE),
    ("non-finite values in the contribution", Drop.NON_FINITE),
    ("malformed tensors: bad scales", Drop.MALFORMED),
    ("finished: its learner's last push of the fragment (final) is merged", Drop.FINISHED),
    ("something new", Drop.OTHER),
])
def test_recorded_reason_texts_read_back_into_their_kind(text, kind):
    reason = Reason.of(text)
    assert reason.kind is kind and reason == text


def test_heartbeat_and_reports_round_trip_and_refuse_bad_numbers():
    hb = Heartbeat(t=1.0, step=5, tokens=40, tokens_per_s=9.5, versions=[1, 2], loss=3.2)
    assert Heartbeat.from_json(hb.to_json()) == hb
    rep = LearnerFinal(hashes={"0": "a" * 64}, versions=[3], steps=9, tokens=90)
    assert LearnerFinal.from_json(rep.to_json().encode()) == rep
    info = SyncerInfo(endpoint="tcp://h:1", fragments=[0, 1], rounds=4)
    assert SyncerInfo.from_json(info.to_json()).endpoint == "tcp://h:1"
    # a newer writer's extra field is ignored; a wrong type or not an object is refused
    assert Heartbeat.from_json(json.dumps({"step": 1, "new_field": 2})).step == 1
    for bad in ('{"step": "many"}', "[1]", "not json", '{"step": true}'):
        with pytest.raises(DecodeError):
            Heartbeat.from_json(bad)
