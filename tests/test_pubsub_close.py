"""A syncer's PUB socket sends what it queued before it closes: the final values a syncer
publishes just before it exits reach the learners (closed without linger, they were dropped
— and libzmq 4.3.5 could abort the syncer when a learner disconnected while a message was
half sent, zeromq/libzmq#3442)."""

import time

import numpy as np
import zmq

from broker import codec
from broker.pubsub import Publisher, Subscriber
from pipeline import quant


def test_a_value_published_just_before_the_syncer_closes_reaches_the_learner():
    pctx, sctx = zmq.Context(), zmq.Context()
    pub = Publisher(pctx, "tcp://127.0.0.1:0")
    sub = Subscriber(sctx, [0, 9999])
    try:
        sub.connect([pub.endpoint])
        probe = codec.global_frames("r", 9999, 0, {"p": quant.quantize(np.zeros(1), "fp32")})
        deadline = time.monotonic() + 10
        while True:  # the subscription is in place (the slow joiner)
            pub.publish(probe)
            msg = sub.recv(20)
            if msg is not None and msg[0].fragment == 9999:
                break
            assert time.monotonic() < deadline
        while sub.recv(50) is not None:  # the probes still on their way
            pass
        # 64 MB: still being written to the socket when close() is called
        final = {"w": quant.quantize(np.ones(16 << 20, np.float32), "fp32")}
        pub.publish(codec.global_frames("r", 0, 7, final))
        pub.close()
        pctx.term()
        got = None
        deadline = time.monotonic() + 10
        while got is None and time.monotonic() < deadline:
            got = sub.recv(100)
        assert got is not None and got[0].version == 7 and got[0].fragment == 0
    finally:
        sub.close()
        sctx.term()
