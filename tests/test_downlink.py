"""The delta down link (`sync.down_delta`): merged values sent as quantised deltas against the
exact reference every learner holds, with the error of one publish fed into the next."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
from helpers_broker import store_run, tiny_config

from broker import codec
from broker.connection import connect
from broker.errors import DecodeError
from pipeline import quant
from pipeline.config import OuterConfig, SyncConfig
from pipeline.contribution import Contribution
from pipeline.downlink import apply_delta
from pipeline.model import is_embedding
from pipeline.syncer import FragmentSyncer
from workers.common import open_run

DELTA = SyncConfig(quorum=1, grace_max_s=0.0, codec_down="int4", down_delta=True, guard=False)


def _theta(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.normal(0, 0.1, s).astype(np.float32) for n, s in shapes.items()}


def _round(s: FragmentSyncer, i: int, scale: float = 1e-2):
    """Offer one learner's random contribution and close the round."""
    rng = np.random.default_rng(100 + i)
    delta = {n: quant.quantize(rng.normal(0, scale, v.shape).astype(np.float32), "int4")
             for n, v in s.theta.items()}
    ok, why = s.offer(Contribution("L0", s.fragment, s.version, 10 * (i + 1), 10, 1000,
                                   delta=delta, entry_id=f"{i + 1}-0"), float(i))
    assert ok, why
    return s.close(float(i), "quorum")


def _frames(s: FragmentSyncer, run: str = "dl") -> list[bytes]:
    """The syncer's current publish, as a learner receives it."""
    return [bytes(memoryview(f).cast("B")) for f in codec.global_frames(
        run, s.fragment, s.version, s.sent, base=s.sent_base, value=s.sent_hash)]


def test_the_reference_tracks_the_global_value_within_one_quantisation_step():
    shapes = {"w": (64, 48), "b": (48,)}
    s = FragmentSyncer(0, _theta(shapes), OuterConfig(), DELTA, is_embedding=lambda n: False)
    assert s.sent_base == -1 and all(q.codec == "fp32" for q in s.sent.values())
    learner = {n: quant.dequantize(q) for n, q in s.sent.items()}
    for i in range(40):
        before = dict(s.sent_values)
        r = _round(s, i)
        assert r.sent_base == r.version - 1 and all(q.codec == "int4" for q in r.sent.values())
        header, tensors = codec.parse_global_frames(_frames(s))
        learner = apply_delta(learner, tensors)
        # every learner rebuilds the syncer's reference bit for bit, and the hash says so
        assert quant.tensors_hash(learner) == header.value == r.sent_hash
        for n, v in learner.items():
            np.testing.assert_array_equal(v, s.sent_values[n])
            # error feedback: the reference misses Θ by one quantisation of the last delta,
            # never by an error accumulated over rounds
            bound = quant.error_bound(s.theta[n] - before[n], "int4")
            assert (np.abs(v - s.theta[n]) <= bound + 1e-7).all(), n
    # a payload of int4 deltas is about a quarter of bf16 values' (block scales included)
    int4 = sum(quant.payload_nbytes(q) for q in s.sent.values())
    bf16 = sum(quant.payload_nbytes(quant.quantize(v, "bf16")) for v in s.theta.values())
    assert int4 < 0.3 * bf16


def test_a_restarted_syncer_publishes_its_exact_reference_whole():
    shapes = {"w": (16, 8)}
    s = FragmentSyncer(0, _theta(shapes), OuterConfig(), DELTA, is_embedding=lambda n: False)
    for i in range(5):
        _round(s, i)
    back = FragmentSyncer.from_state_dict(s.state_dict(), OuterConfig(), DELTA,
                                          is_embedding=lambda n: False)
    assert back.version == s.version and back.sent_base == -1
    assert back.sent_hash == s.sent_hash  # the same value, now as an fp32 key frame
    np.testing.assert_array_equal(quant.dequantize(back.sent["w"]), s.sent_values["w"])
    a, b = _round(s, 9), _round(back, 9)  # and both continue identically
    assert a.sent_hash == b.sent_hash and a.sent_base == b.sent_base == a.version - 1


def test_snapshots_hold_whole_values_only():
    s = FragmentSyncer(0, _theta({"w": (4, 4), "b": (4,), "a": (2, 2)}), OuterConfig(), DELTA,
                       is_embedding=lambda n: False)
    _round(s, 0)
    blob = codec.pack_snapshot("dl", 0, s.version, s.snapshot_tensors)
    header, tensors = codec.unpack_snapshot(blob)
    assert header.base == -1 and quant.tensors_hash(tensors) == s.sent_hash
    # in name order: the value's hash is the snapshot's own (the syncer hashes it once)
    assert list(header.names) == ["a", "b", "w"] and header.sha256 == s.sent_hash
    with pytest.raises(ValueError, match="needs the SHA-256"):
        codec.global_frames("dl", 0, 3, s.sent, base=2)
    with pytest.raises(ValueError, match="base"):
        codec.global_frames("dl", 0, 3, s.sent, base=3, value="a" * 64)


def test_delta_headers_are_validated():
    s = FragmentSyncer(0, _theta({"w": (4, 4)}), OuterConfig(), DELTA,
                       is_embedding=lambda n: False)
    _round(s, 0)
    frames = _frames(s)
    import msgpack
    header = msgpack.unpackb(frames[1], raw=False)
    for patch in ({"base": 1}, {"base": -2}, {"base": "0"}, {"value": "A" * 64},
                  {"value": 5}):
        bad = [frames[0], msgpack.packb({**header, **patch}), *frames[2:]]
        with pytest.raises(DecodeError):
            codec.parse_global_frames(bad)
    lone = {k: v for k, v in header.items() if k != "value"}  # base without value
    with pytest.raises(DecodeError):
        codec.parse_global_frames([frames[0], msgpack.packb(lone), *frames[2:]])


def test_a_learner_holds_a_delta_until_it_has_its_base_and_checks_every_value(redis_url):
    import zmq

    from workers.learner_net import LearnerNet

    r = connect(redis_url)
    cfg = tiny_config(sync={"down_delta": True, "codec_down": "int4"})
    store_run(r, "dl", cfg)
    ctx = open_run(redis_url, "dl", wait_s=0)
    p = 0
    shapes = {n: tuple(ctx.shapes[n]) for n in ctx.fragments[p]}
    s = FragmentSyncer(p, _theta(shapes), OuterConfig(), DELTA, is_embedding=is_embedding)
    zctx = zmq.Context()
    net = LearnerNet(ctx, "L0", zctx)
    try:
        net.joined_at(p, 0, dict(s.sent_values))
        published = {}
        for i in range(5):
            _round(s, i)
            published[s.version] = codec.parse_global_frames(_frames(s))
            if s.version == 3:
                snapshot_v3 = codec.unpack_snapshot(
                    codec.pack_snapshot("dl", p, 3, s.snapshot_tensors))
        net._deliver(*published[2])  # arrives before version 1: held, the snapshot is asked
        assert net.inbox.empty() and net.stats.deltas_held == 1
        assert net.snapshot_requests.get_nowait() == p
        net._deliver(*published[1])  # its base arrives: 1 and then the held 2 apply
        got = [net.inbox.get_nowait() for _ in range(2)]
        assert [v for _, v, *_ in got] == [1, 2] and net.stats.rejected == 0
        assert quant.tensors_hash(got[1][2]) == published[2][0].value
        net._deliver(*published[4])  # 3 was missed: held until the snapshot of 3 arrives
        assert net.inbox.empty()
        net._deliver(*snapshot_v3)
        got = [net.inbox.get_nowait() for _ in range(2)]
        assert [v for _, v, *_ in got] == [3, 4]
        assert quant.tensors_hash(got[1][2]) == published[4][0].value
        # the trainer shares the reference's arrays (one copy of the fragment), read-only: a
        # write raises instead of changing the value the next delta applies to
        for v in got[1][2].values():
            with pytest.raises(ValueError, match="read-only"):
                v += 1.0
        net._deliver(*published[5])
        assert net.inbox.get_nowait()[1] == 5
        while not net.snapshot_requests.empty():
            net.snapshot_requests.get_nowait()
        # a delta that decodes to another value than the syncer's hash says: refused
        _round(s, 5)
        h, t = codec.parse_global_frames(_frames(s))
        forged = codec.GlobalHeader(h.run, h.fragment, h.version, h.names, h.codecs, h.shapes,
                                    h.blocks, h.sha256, h.base, "0" * 64)
        net._deliver(forged, t)
        assert net.inbox.empty() and net.stats.rejected == 1
        assert net.snapshot_requests.get_nowait() == p
        net._deliver(h, t)  # the real one still applies onto the untouched reference
        assert net.inbox.get_nowait()[1] == 6 and net.stats.rejected == 1
    finally:
        net.sub.close()
        zctx.term()


def test_with_curve_a_repairing_learner_takes_only_the_snapshot_the_syncers_attested(
        redis_url, tmp_path):
    """A learner repairing a gap reads the fragment's snapshot from Redis: with a pinned
    syncer key it takes it only once its hash is the one the syncers attested over ZeroMQ
    (`broker.attest`). A forged snapshot (finite, of the run's fragment and shapes, its own
    hash right) is refused with its reason and read again later; the real one is taken."""
    import zmq
    import zmq.auth

    from broker.pubsub import CurveClient
    from workers.learner_net import LearnerNet

    for name in ("syncer", "L0"):
        zmq.auth.create_certificates(str(tmp_path), name)
    r = connect(redis_url)
    store_run(r, "att", tiny_config(sync={"down_delta": True, "codec_down": "int4"}))
    ctx = open_run(redis_url, "att", wait_s=0)
    p, fk = 0, ctx.keys.fragment(0)
    shapes = {n: tuple(ctx.shapes[n]) for n in ctx.fragments[p]}
    s = FragmentSyncer(p, _theta(shapes), OuterConfig(), DELTA, is_embedding=is_embedding)
    _round(s, 0)
    real = bytes(codec.pack_snapshot("att", p, s.version, s.snapshot_tensors))
    forged = bytes(codec.pack_snapshot("att", p, s.version, {
        k: quant.quantize(v + np.float32(0.5), "fp32") for k, v in s.sent_values.items()}))
    zctx = zmq.Context()
    net = LearnerNet(ctx, "L0", zctx, curve=CurveClient(str(tmp_path / "L0.key_secret"),
                                                        str(tmp_path / "syncer.key")))
    repair = net.snapshots
    try:
        r.set(fk.global_, forged)
        net.request_snapshot(p)
        repair.serve()  # nothing attested yet: kept, not taken
        assert net.inbox.empty() and net.stats.rejected == 0 and p in repair.unattested
        net.attested.note("att", p, s.version, s.sent_hash)  # the syncer's word, heard
        repair.serve()  # checked again without reading: forged, refused, read again later
        assert net.inbox.empty() and net.stats.rejected == 1 and net.stats.snapshots_read == 1
        assert repair.again[p] > time.monotonic() + 4.0 and not repair.unattested
        r.set(fk.global_, real)
        repair.again[p] = 0.0
        repair.serve()
        got = net.inbox.get_nowait()
        assert got[1] == s.version and quant.tensors_hash(got[2]) == s.sent_hash
        assert not repair.again and net.stats.rejected == 1
        # another fragment's genuine snapshot (attested, same size) under this one's key
        relabelled = bytes(codec.pack_snapshot("att", 1, s.version, s.snapshot_tensors))
        r.set(fk.global_, relabelled)
        net.request_snapshot(p)
        repair.serve()
        assert net.inbox.empty() and net.stats.rejected == 2
    finally:
        net.sub.close()
        zctx.term()


def test_ending_the_zeromq_context_under_a_running_network_thread_does_not_hang(redis_url):
    """A learner's close() stops waiting for its network thread after a few seconds (a Redis
    call over a slow link can take longer) and ends the ZeroMQ context: the thread must
    close its socket when its next poll says so, or the context's termination never
    returns (seen in the lab: learners hung at exit behind a 1.6 Mbit/s link)."""
    import threading

    import zmq

    from workers.learner_net import LearnerNet

    r = connect(redis_url)
    store_run(r, "zt", tiny_config())
    ctx = open_run(redis_url, "zt", wait_s=0)
    zctx = zmq.Context()
    net = LearnerNet(ctx, "L0", zctx)
    net.start()
    time.sleep(0.3)  # the thread is in its loop, polling its SUB socket
    ended = threading.Event()
    t = threading.Thread(target=lambda: (zctx.term(), ended.set()), daemon=True)
    t.start()
    assert ended.wait(10), "zmq.Context.term() hung on the network thread's socket"
    net.join(5)
    assert not net.is_alive()
    net.stop_event.set()
    r.close()


def test_the_quality_bench_compares_down_links_and_skips_finished_runs(tmp_path):
    from ops.bench import quality
    from pipeline import config as cfgmod

    base = cfgmod.from_dict({
        "model": {"d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 16},
        "data": {"max_bytes": 200_000, "eval_batches": 2},
        "inner": {"batch_size": 4, "warmup_steps": 2},
        "sync": {"sync_every": 8, "fragments": 2},
        "engine": {"eval_every": 10}, "learners": 2, "steps": 16})
    only = ["frontier H=4 int4/bf16", "frontier H=4 int4/int4Δ"]
    said: list[str] = []
    quality.run_quality(base, tmp_path, only=only, frontier=[4], progress=said.append)
    first = json.loads((tmp_path / "results.json").read_text())
    assert list(first) == only and not any("skipped" in s for s in said)
    bf16, int4 = (first[k] for k in only)
    assert bf16["rounds"] == int4["rounds"] > 0
    # the same rounds; each merged value costs about a quarter of the bytes as int4 deltas
    assert int4["bytes_received"] < 0.45 * bf16["bytes_received"]
    assert int4["bytes_sent"] == bf16["bytes_sent"]
    said.clear()
    quality.run_quality(base, tmp_path, only=only, frontier=[4], progress=said.append)
    assert all("skipped" in s for s in said) and len(said) == 2
    assert json.loads((tmp_path / "results.json").read_text()) == first


def test_a_kept_run_stays_valid_when_a_setting_is_added_at_its_old_behaviour():
    import hashlib

    from ops.bench import quality
    from pipeline import config as cfgmod

    cfg = quality.default_model_config()
    d = cfgmod.to_dict(cfg)
    assert d["sync"]["up_feedback"] is False and d["sync"]["final_step"] == "nesterov"
    # the key a run got before `sync.up_feedback` and `sync.final_step` existed
    before = {**d, "sync": {k: v for k, v in d["sync"].items()
                            if k not in ("up_feedback", "final_step")}}
    old_key = hashlib.sha256(json.dumps(before, sort_keys=True,
                                        default=str).encode()).hexdigest()[:16]
    assert quality.config_key(cfg) == old_key
    on = cfgmod.override(cfg, **{"sync.up_feedback": True})
    assert quality.config_key(on) != old_key
    plain = cfgmod.override(cfg, **{"sync.final_step": "plain"})
    assert quality.config_key(plain) != old_key
    assert quality.config_key(cfgmod.override(cfg, seed=1)) != old_key


def test_the_quality_bench_sweeps_seeds_and_learning_rates_alike_for_every_variant(tmp_path):
    from ops.bench import quality
    from pipeline import config as cfgmod

    base = cfgmod.from_dict({
        "model": {"d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 16},
        "data": {"max_bytes": 200_000, "eval_batches": 2},
        "inner": {"batch_size": 4, "warmup_steps": 2},
        "sync": {"sync_every": 4, "fragments": 2},
        "engine": {"eval_every": 0}, "learners": 2, "steps": 8})
    with pytest.raises(ValueError, match="unknown variants"):
        quality.run_quality(base, tmp_path, only=["nope"])
    with pytest.raises(ValueError, match="repeat"):
        quality.run_quality(base, tmp_path, only=["ddp"], lrs=[1e-3, 0.001])
    md = quality.run_quality(base, tmp_path, only=["decoupled int4/bf16", "ddp"], seeds=[0, 1],
                             lrs=[1e-3, 3e-3])
    res = json.loads((tmp_path / "results.json").read_text())
    # in the order asked for, every variant at every lr and seed
    assert list(res)[:2] == ["decoupled int4/bf16 lr=0.001 seed=0",
                             "decoupled int4/bf16 lr=0.001 seed=1"] and len(res) == 8
    assert {s["config_key"] for s in res.values()}.__len__() == 8
    rows = quality.seed_summary(res)
    ddp = {k: r for k, r in rows.items() if r["variant"] == "ddp"}
    best = min(ddp.values(), key=lambda r: r["mean"])
    ours = rows["decoupled int4/bf16 lr=0.001"]
    assert ours["ddp_lr"] == best["lr"] and ours["seeds_compared"] == [0, 1]
    l0, l1 = (res[f"decoupled int4/bf16 lr=0.001 seed={s}"]["final_eval_loss"] for s in (0, 1))
    b0, b1 = (res[f"ddp lr={best['lr']} seed={s}"]["final_eval_loss"] for s in (0, 1))
    assert ours["gap_mean"] == pytest.approx((l0 + l1) / (b0 + b1) - 1)
    assert ours["gap_worst_seed"] == pytest.approx(max(l0 / b0, l1 / b1) - 1)
    assert l0 != l1  # the seed changes the run
    assert "| decoupled int4/bf16 | 0.001 | 0,1 |" in md
    # the per-run table compares each run with ddp at its best lr and the same seed
    best_lr = best["lr"]
    assert f"{100 * (l1 / b1 - 1):+.2f}%" in md.split("decoupled int4/bf16 lr=0.001 seed=1 |")[1]
    assert best_lr in ("0.001", "0.003")
    # --report: the same tables from results.json alone, running nothing
    assert quality.report(tmp_path, base) == md
    with pytest.raises(ValueError, match="does not exist"):
        quality.report(tmp_path / "none", base)


def test_the_quality_bench_sweeps_the_outer_rate_as_part_of_the_variant():
    from ops.bench import quality
    from pipeline import config as cfgmod

    base = cfgmod.from_dict({"learners": 2, "steps": 8})
    runs = quality.sweep({"ddp": cfgmod.override(base, mode="ddp"), "dec": base}, [0], [1e-3],
                         [0.4, 1.0])
    # data parallel has no outer step: not swept over it
    assert list(runs) == ["ddp lr=0.001 seed=0", "dec olr=0.4 lr=0.001 seed=0",
                          "dec olr=1 lr=0.001 seed=0"]
    assert runs["dec olr=0.4 lr=0.001 seed=0"].outer.lr == 0.4
    assert runs["dec olr=1 lr=0.001 seed=0"].inner.lr == 1e-3
    # the tables group over seeds by variant, the outer rate in the variant's name
    assert quality._parse_label("dec olr=0.4 lr=0.001 seed=2") == ("dec olr=0.4", "0.001", 2)
    with pytest.raises(ValueError, match="outer learning rates .* repeat"):
        quality.sweep({"dec": base}, None, None, [0.4, 0.40000001])
    # the outer momentum likewise, named before the outer rate
    runs = quality.sweep({"ddp": cfgmod.override(base, mode="ddp"), "dec": base}, [0], None,
                         [1.0], [0.0, 0.5])
    assert list(runs) == ["ddp seed=0", "dec om=0 olr=1 seed=0", "dec om=0.5 olr=1 seed=0"]
    assert runs["dec om=0 olr=1 seed=0"].outer.momentum == 0.0
    assert runs["dec om=0.5 olr=1 seed=0"].outer.lr == 1.0
    assert quality._parse_label("dec om=0.5 olr=1 seed=0") == ("dec om=0.5 olr=1", None, 0)


def test_a_learner_that_never_hears_the_syncer_pushes_only_unmerged_progress(tmp_path,
                                                                             redis_url):
    """Real processes: L1 subscribes to a port nobody publishes on, so no merged value reaches
    it by ZeroMQ and every push of it is superseded H steps later. Each time the syncer's
    merge record says the superseded push was merged, L1 rebases onto that version's snapshot
    first; when the record comes after L1 asked (a slow syncer), the superseding push
    continues the chain, and the syncer counts only what it adds: no step of L1 is merged
    twice, and both learners end on the same values."""
    import subprocess
    import sys

    from helpers_broker import REPO, run_to_the_end, syncer_cmd

    from broker import registry
    from broker.records import read_rounds
    from ops.cluster import free_port

    r = connect(redis_url)
    steps = 60
    # with up-link error feedback: a rebase over a merged push must not send its error twice
    cfg = tiny_config(learners=2, steps=steps, sync={"quorum": 1, "up_feedback": True,
                                                     "codec_up": "int4"},
                      broker={"snapshot_timeout_s": 30.0})
    assert cfg.sync.codec_up == "int4"
    keys = store_run(r, "deaf", cfg)
    base = [sys.executable, "-m", "workers.learner", "--redis-url", redis_url, "--run", "deaf",
            "--state-dir", str(tmp_path / "state")]
    cmds = {"syncer": syncer_cmd(redis_url, "deaf"), "L0": [*base, "--id", "L0"],
            "L1": [*base, "--id", "L1", "--delay-s", "0.02",
                   "--sub-endpoint", f"tcp://127.0.0.1:{free_port()}"]}
    logs = {n: open(tmp_path / f"{n}.log", "wb") for n in cmds}
    procs = {n: subprocess.Popen(c, cwd=REPO, stdout=logs[n], stderr=subprocess.STDOUT)
             for n, c in cmds.items()}
    try:
        run_to_the_end(procs, ("L0", "L1", "syncer"), tmp_path, timeout_s=240)
    finally:
        for fh in logs.values():
            fh.close()
    ctx = open_run(redis_url, "deaf", wait_s=0)
    reports = registry.learner_final_reports(r, keys)
    assert reports["L0"].hashes == reports["L1"].hashes
    for p in range(len(ctx.fragments)):
        fk = ctx.keys.fragment(p)
        # a push that superseded one not known to be merged holds its chain's steps before
        # it (the syncer merged the earlier one first when the answer came too early): as the
        # syncer does (`FragmentSyncer._repeats`), count what each merged push of L1 adds to
        # L1's merged push before it when both are of one chain, else all its steps
        fields = {i.decode(): f for i, f in r.xrange(fk.frags)}
        counted, last = 0, None
        for i in (i for rnd in read_rounds(r, fk) for i in rnd.included if i.learner == "L1"):
            f = fields[i.entry_id]
            head = (f.get(b"epoch", b"0"), f.get(b"chain"), int(f[b"steps"]))
            same = last is not None and head[:2] == last[:2] and head[0] != b"0" and head[1]
            counted += head[2] - last[2] if same else head[2]
            last = head
        # every step of L1 is merged at most once (the run is short: nothing trimmed)
        assert 0 < counted <= steps, (p, counted)
    assert reports["L1"].rebased_merged > 0, (tmp_path / "L1.log").read_text()[-3000:]
    for name in ("L0", "L1"):
        rep = reports[name]
        assert 0 < rep.sync_s < rep.train_s, rep  # the sync work is measured, and not all
        log_text = (tmp_path / f"{name}.log").read_text()
        # where the cold start's time went, mark by mark
        assert re.search(r"s after the process started \(imported [0-9.]+ s, kernels [0-9.]+ s, "
                         r"run opened [0-9.]+ s, data [0-9.]+ s, join [0-9.]+ s, "
                         r"joined [0-9.]+ s\)", log_text), log_text[-3000:]
        with np.load(tmp_path / "state" / f"{name}.ckpt.npz") as z:  # residuals checkpointed
            assert any(k.startswith("core/residual") for k in z.files), z.files


def test_a_restored_learner_does_not_push_again_what_it_pushed_after_its_checkpoint(
        tmp_path, redis_url):
    """In-process islands, a real syncer process: L0 checkpoints with nothing of a fragment in
    flight, pushes that fragment after the checkpoint, sees the push merged, and dies before
    its next checkpoint. Restored at the checkpoint (a new island on the same state folder),
    it takes that push from its push log as in flight: the merged value is applied and its
    next push of the fragment carries only progress made after the restore, not the
    checkpoint's progress a second time (which the merged push already held)."""
    import dataclasses
    import subprocess

    from helpers_broker import REPO, poll_until, syncer_cmd

    from broker import registry
    from workers.island import Island, IslandConfig
    from workers.learner_net import read_push_log

    r = connect(redis_url)
    steps, every, lr = 40, 4, 1e-3
    cfg = tiny_config(learners=1, steps=steps, sync={"quorum": 1})
    keys = store_run(r, "again", cfg)
    log = open(tmp_path / "syncer.log", "wb")
    syncer = subprocess.Popen(syncer_cmd(redis_url, "again"), cwd=REPO, stdout=log,
                              stderr=subprocess.STDOUT)
    icfg = IslandConfig(redis_url, "again", "L0", state_dir=str(tmp_path / "state"),
                        checkpoint_every=every)
    acks = tmp_path / "state" / "L0.acked.jsonl"

    def step(island, params):  # a fake inner step: every value moves by −lr
        time.sleep(0.02)
        return island.after_step({k: v - lr for k, v in params.items()})

    def settled(island, p) -> bool:  # the push in flight is acknowledged and merged
        f = island.core.inflight[p]
        rec = registry.merged(r, keys, "L0", p)
        logged = acks.exists() and any("id" in a and (a["fragment"], a["step"]) == (p, f.step)
                                       for a in read_push_log(acks))
        return logged and rec is not None and (rec.base_version, rec.step) == f.key

    try:
        a = Island(icfg)
        params, _ = a.start()
        free_at_ckpt, ckpt, hit = set(), 0, None
        while hit is None and a.step < steps:
            params = step(a, params)
            for p, f in enumerate(a.core.inflight):
                if f is not None and f.step == a.step:  # pushed now: wait for its merge
                    assert poll_until(lambda p=p: settled(a, p), 30), (tmp_path / "syncer.log"
                                                                       ).read_text()[-3000:]
                    if a.step % every and p in free_at_ckpt:
                        hit = p, a.step, f.key
            if a.step % every == 0:
                ckpt = a.step
                free_at_ckpt = {p for p, f in enumerate(a.core.inflight) if f is None}
        assert hit is not None, "no push after a checkpoint with the fragment free"
        a.close()  # dies: the merged value is never applied, no checkpoint after `ckpt`
        p, sent, key = hit
        # what else a state folder's log may hold, after the real record: another run's and
        # another learner's records, an older format without the run, malformed lines
        rec = {"id": "9-0", "fragment": p, "base_version": key[0], "learner": "L0"}
        with acks.open("a") as fh:
            for extra in ({"run": "another", "step": sent + 3}, {"step": sent + 4},
                          {"run": a.ctx.run_hash, "step": sent + 5, "learner": "L9"},
                          {"run": a.ctx.run_hash, "step": True},
                          {"run": a.ctx.run_hash, "step": sent + 6, "fragment": 99},
                          {"run": a.ctx.run_hash, "step": -1}):
                fh.write(json.dumps({**rec, **extra}) + "\n")
            fh.write("[" * 100_000 + "\n")
        with acks.open("ab") as fh:
            fh.write(b"\xff\xfe not UTF-8\n")

        b = Island(icfg)
        params, _ = b.start()
        assert b.step == ckpt < sent
        assert b.core.inflight[p].key == key and b.core.inflight[p].step == ckpt
        ck = b.checkpoints
        assert ck.resumable(p, *key) and ck.resumable(p, key[0], sent + 7)  # pending, maybe
        ck.sync = dataclasses.replace(ck.sync, strict=True)  # a strict learner waits for it:
        assert ck.resumable(p, *key) and not ck.resumable(p, key[0], sent + 7)  # merged only
        ck.sync = dataclasses.replace(ck.sync, strict=False)
        while b.core.inflight[p] is None or b.core.inflight[p].sent_step is not None:
            params = step(b, params)
            assert b.step < steps
        f = b.core.inflight[p]
        # the merged value came τ steps after the restore: "rebase" (the default) kept those
        # steps, "overwrite" would have dropped them; either way the push holds only steps
        # after the restore, each −lr (the checkpoint's progress would add more)
        dropped = cfg.sync.overlap_steps if cfg.sync.apply == "overwrite" else 0
        assert 0 < f.steps_at_push <= f.step - ckpt - dropped, (f, ckpt)
        for v in f.pushed_values().values():
            np.testing.assert_allclose(v, f.steps_at_push * lr, rtol=1e-3)
        while not b.done:
            params = step(b, params)
        b.finish(params)
        b.close()
        assert syncer.wait(timeout=60) == 0
    finally:
        if syncer.poll() is None:
            syncer.kill()
            syncer.wait()
        log.close()


def test_a_blocking_learner_stops_waiting_for_a_push_the_syncer_refused(tmp_path, redis_url):
    """A strict learner waits for its push's merged value; a refusal of that push (here
    written for a syncer that is stopped, so no other version can come) ends the wait instead
    of blocking the learner for ever, and the refused progress goes out with the next push."""
    import signal
    import subprocess
    import threading

    from helpers_broker import REPO, poll_until, syncer_cmd

    from broker import registry
    from broker.records import Refusal
    from workers.island import Island, IslandConfig

    r = connect(redis_url)
    cfg = tiny_config(learners=1, steps=40, sync={"quorum": 1, "strict": True},
                      broker={"snapshot_timeout_s": 0.5})
    keys = store_run(r, "refused", cfg)
    log = open(tmp_path / "syncer.log", "wb")
    syncer = subprocess.Popen(syncer_cmd(redis_url, "refused"), cwd=REPO, stdout=log,
                              stderr=subprocess.STDOUT)
    island = Island(IslandConfig(redis_url, "refused", "L0"))
    first = cfg.sync.delta_h  # the first push; blocked τ steps after it
    blocked_at = first + cfg.sync.overlap_steps
    errors = []

    def loop(params):  # to one step past the wait
        try:
            while island.step <= blocked_at:
                params = island.after_step({k: v - 1e-3 for k, v in params.items()})
        except BaseException as e:  # reported below
            errors.append(e)

    try:
        params, _ = island.start()  # the syncer wrote the first snapshots
        syncer.send_signal(signal.SIGSTOP)
        t = threading.Thread(target=loop, args=(params,), daemon=True)
        t.start()
        assert poll_until(lambda: island.step == blocked_at, 30)
        time.sleep(2.0)  # four snapshot timeouts: still waiting
        assert island.step == blocked_at and t.is_alive() and not errors
        [(p, f)] = [(p, f) for p, f in enumerate(island.core.inflight) if f is not None]
        registry.note_refused(r, keys, "L0", p, Refusal(*f.key, reason="stale"))
        t.join(10)
        assert not t.is_alive() and not errors, errors
        assert island.step == blocked_at + 1 and island.core.inflight[p] is None
        assert island.core.steps[p] == blocked_at + 1  # the refused progress stays, to go out
    finally:
        syncer.send_signal(signal.SIGCONT)
        syncer.kill()
        syncer.wait()
        island.close()
        log.close()


def _rebase_rig(redis_url: str, run: str, p: int):
    """A "rebase" run's fragment p: its state machine, its streams with the lease taken, and
    a learner's network thread (not started: values are handed to it one by one)."""
    import zmq

    from broker.streams import FragmentStreams
    from workers.learner_net import LearnerNet

    r = connect(redis_url)
    store_run(r, run, tiny_config(sync={"apply": "rebase"}))
    ctx = open_run(redis_url, run, wait_s=0)
    shapes = {n: tuple(ctx.shapes[n]) for n in ctx.fragments[p]}
    plain = SyncConfig(quorum=1, grace_max_s=0.0, guard=False)
    s = FragmentSyncer(p, _theta(shapes), OuterConfig(), plain, is_embedding=is_embedding)
    fs = FragmentStreams(r, ctx.keys)
    assert fs.state.acquire_lease(p, "S", 10_000)
    zctx = zmq.Context()
    return s, fs, zctx, LearnerNet(ctx, "L0", zctx)


def test_a_snapshot_comes_with_the_merge_records_committed_with_its_round(redis_url):
    """The syncer commits a round's merge records in the same transaction as its snapshot, so
    a learner reading a snapshot (a missed message, a rejoin) trusts the record it reads next
    exactly as for a published message: the record of an earlier round means this round
    merged no later push of the learner, no record means none was merged. (Before, a snapshot
    could precede its records, and such a read counted as "cannot tell".)"""

    from broker.records import Merged

    p = 0
    s, fs, zctx, net = _rebase_rig(redis_url, "snap", p)
    try:
        net.joined_at(p, 0, dict(s.sent_values))
        for i, merged in enumerate(({}, {"L0": Merged(0, 7, 2)}, {"L1": Merged(1, 9, 3)})):
            _round(s, i)
            fs.state.commit_round(p, "S", state=None,
                            snapshot=codec.pack_snapshot("snap", p, s.version,
                                                         s.snapshot_tensors),
                            version=s.version, record={"version": s.version}, ack_ids=[],
                            merged={n: m.to_json() for n, m in merged.items()})
            net.snapshot_requests.put(p)
            net.snapshots.serve()
            got = net.inbox.get_nowait()
            assert got[1] == s.version == i + 1
            # v1: no record of L0 → none merged; v2: merged L0's push at step 7; v3 (another
            # learner's record): v3 holds no later push of L0 than the one v2 merged
            assert got[3] == (None, (0, 7, 2), (0, 7, 2))[i], (i, got[3])
    finally:
        net.sub.close()
        zctx.term()


def test_a_published_value_carries_its_rounds_merge_records(redis_url):
    """A learner learns which of its pushes a published value holds from the message itself:
    after its first value (read once from Redis), every value that follows the one before
    says it with no Redis read — its own push merged, or none of its pushes this round (the
    record stays the one before). A missed value, or one without records (a re-publish),
    is read again. Records that do not fit the message are refused."""

    from broker.records import Merged

    p = 0
    s, fs, zctx, net = _rebase_rig(redis_url, "carried", p)
    rounds = ({"L1": (0, 4)}, {"L0": (0, 7), "L1": (1, 8)}, {"L1": (2, 9)}, None,
              {"L0": (3, 12)}, {"L1": (5, 13)})
    want = [None, (0, 7, 2), (0, 7, 2), (0, 7, 2), (3, 12, 5), (3, 12, 5)]
    try:
        net.joined_at(p, 0, dict(s.sent_values))
        got, reads = [], []
        for i, pushes in enumerate(rounds):
            _round(s, i)
            fs.state.commit_round(
                p, "S", state=None, version=s.version, record={"version": s.version},
                snapshot=codec.pack_snapshot("carried", p, s.version, s.snapshot_tensors),
                ack_ids=[], merged={n: Merged(b, st, s.version).to_json()
                                    for n, (b, st) in (pushes or {}).items()})
            if i == 4:
                continue  # this value never reaches the learner: the next one is read again
            frames = codec.global_frames("carried", p, s.version, s.sent, merged=pushes)
            header, tensors = codec.parse_global_frames(frames)
            assert header.merged == pushes
            net._deliver(header, tensors)
            got.append(net.inbox.get_nowait()[3])
            reads.append(net.stats.merge_reads)
        assert got == [want[i] for i in (0, 1, 2, 3, 5)]
        # read: the first value, the re-publish without records (v4), the one after the gap
        assert reads == [1, 1, 1, 2, 3]
    finally:
        net.sub.close()
        zctx.term()
    with pytest.raises(ValueError, match="merge record"):
        codec.global_frames("carried", p, 3, s.sent, merged={"L0": (3, 1)})  # base ≥ version
    import msgpack

    frames = codec.global_frames("carried", p, 3, s.sent, merged={"L0": (2, 1)})
    header = msgpack.unpackb(frames[1])
    for bad in ({"L0": [3, 1]}, {"L0": [-1, 1]}, {"L0": [0, -1]}, {"": [0, 1]},
                {"L0": [0]}, {"L0": [0, 1, 2]}, {"L0": ["0", 1]}, {"L0": [0, 1.5]},
                {"x" * 1025: [0, 1]}, [["L0", 0, 1]], {"L0": [0, 2**63]}):
        frames[1] = msgpack.packb({**header, "merged": bad})
        with pytest.raises(DecodeError):
            codec.parse_global_frames(frames)
