"""A learner with the wrong CURVE key is told so within seconds, on its side too (before, it
logged nothing and fell back to Redis snapshots in silence); the right keys say nothing."""

from __future__ import annotations

import logging
import shutil
import time

import pytest
import zmq
import zmq.auth

from broker.pubsub import CurveClient, CurveServer, Publisher, Subscriber, key_fingerprint


@pytest.fixture
def keys(tmp_path):
    for name in ("syncer", "L0", "rogue", "other-run-syncer"):
        zmq.auth.create_certificates(str(tmp_path), name)
    (tmp_path / "allow").mkdir()
    shutil.copy(tmp_path / "L0.key", tmp_path / "allow" / "L0.key")
    return tmp_path


def _handshake(keys, me: str, server: str, caplog) -> tuple[dict[str, str], list[str], str]:
    ctx = zmq.Context()
    pub = Publisher(ctx, "tcp://127.0.0.1:0",
                    curve=CurveServer(str(keys / "syncer.key_secret"), str(keys / "allow")))
    sub = Subscriber(ctx, [0], curve=CurveClient(str(keys / f"{me}.key_secret"),
                                                 str(keys / f"{server}.key")))
    try:
        with caplog.at_level(logging.WARNING, logger="diloco.pubsub"):
            sub.connect([pub.endpoint])
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and not sub.handshake_failures:
                sub.recv(50)
                if me == "L0" and server == "syncer" and time.monotonic() > deadline - 4.0:
                    break  # the right keys: a second is plenty to fail, were it to
        return dict(sub.handshake_failures), [r.getMessage() for r in caplog.records
                                              if r.name == "diloco.pubsub"], pub.endpoint
    finally:
        sub.close()
        pub.close()
        ctx.term()


def test_a_pinned_key_that_is_not_the_syncers(keys, caplog):
    failures, said, endpoint = _handshake(keys, "L0", "other-run-syncer", caplog)
    pinned = key_fingerprint((keys / "other-run-syncer.key").read_text().split('"')[1])
    assert list(failures) == [endpoint] and "not the one this learner pins" in failures[endpoint]
    line = next(m for m in said if "CURVE handshake with the syncer" in m)
    assert endpoint in line and pinned in line and "falls back to Redis" in line, line


def test_a_learner_key_off_the_allowlist(keys, caplog):
    failures, said, endpoint = _handshake(keys, "rogue", "syncer", caplog)
    assert "refused this learner's key" in failures[endpoint], failures
    assert any("CURVE handshake" in m and "allowlist" in m for m in said), said
    assert any("refused a ZeroMQ client" in m for m in said), said  # the syncer's side too


def test_the_right_keys_say_nothing(keys, caplog):
    failures, said, _ = _handshake(keys, "L0", "syncer", caplog)
    assert failures == {} and not [m for m in said if "handshake" in m], said


def test_status_shows_a_learner_whose_handshake_fails():
    """The learner's heartbeat carries the failures (validated like every record) and the
    plain `diloco status` view prints them under the learner."""
    from broker.records import Heartbeat
    from ops.tools.status import render

    why = "the syncer's key is not the one this learner pins (--curve-server-key sha256:ab)"
    hb = Heartbeat.from_json(Heartbeat(step=7, handshake_failures={"tcp://h:5555": why})
                             .to_json())
    assert hb.handshake_failures == {"tcp://h:5555": why}
    rep = {"run": "r", "mode": "decoupled", "config_hash": "x", "live_learners": ["L0"],
           "learners_expected": 1, "rounds": 0, "syncers": {}, "fragments": [],
           "learners": {"L0": {"live": True, "step": 7, "tokens_per_s": 0.0, "versions": [0],
                               "version_lag": [0], "last_heartbeat_age_s": 0.5,
                               "handshake_failures": hb.handshake_failures}}}
    out = render(rep).splitlines()
    assert out[2].strip() == f"CURVE handshake with tcp://h:5555 failing: {why}", out
