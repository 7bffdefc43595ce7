"""Benchmarks of the distributed pipeline (`diloco bench overlap|pipeline|memory|latency`).

Each one measures its ratio side by side in one run on this machine:

* overlap — a learner's steady inner-step rate with syncing on ÷ off (real processes);
* pipeline — the syncer's MB/s of contributions read, decoded and merged ÷ raw XREADGROUP MB/s
  of the same entries (same stream, two consumer groups, alternating passes);
* memory — the syncer's peak RSS with 4 vs 64 synthetic pushers on the same fragment size;
* latency — from the last needed contribution's XADD to the subscriber receiving the merged
  value, p50/p99, for ~4 MB fragments;
* recovery — a successor syncer's start against the rounds since the last checkpoint;
* cluster — the same syncer work on one redis-server and on a local Redis Cluster.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import zmq

from broker import codec, registry, signing
from broker.attest import Attestation
from broker.connection import connect
from broker.entries import entry_fields
from broker.keys import RunKeys
from broker.pubsub import Subscriber
from broker.records import Heartbeat
from broker.streams import FragmentStreams
from ops.cluster import ClusterServers, RedisServer, SecureSetup, store_run_config
from pipeline import config as cfgmod
from pipeline import kernels, quant
from pipeline.config import RunConfig
from pipeline.contribution import PushHeader
from pipeline.fragments import partition
from pipeline.task import task_of
from workers.common import open_run
from workers.syncer import Syncer, SyncerConfig

# The default checkpoint interval (broker.checkpoint_rounds)
CHECKPOINT_ROUNDS = cfgmod.BrokerConfig().checkpoint_rounds
# A model whose non-embedding fragments hold ~1M fp32 parameters (~4 MB) each at P=5.
BIG = {"model": {"d_model": 288, "n_layers": 4, "n_heads": 4, "seq_len": 64},
       "data": {"max_bytes": 400_000}, "sync": {"fragments": 5}}


def machine() -> str:
    """This machine in one line (for the benchmarks' JSON)."""
    return (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()}")


def _fragment_delta(cfg: RunConfig, p: int, seed: int) -> dict[str, quant.QTensor]:
    task = task_of(cfg, local=cfg.task)
    shapes = task.param_shapes()
    names = partition(shapes, cfg.effective_sync().fragments, task.is_embedding)[p]
    rng = np.random.default_rng(seed)
    return {n: quant.quantize((rng.standard_normal(shapes[n]) * 1e-3).astype(np.float32),
                              cfg.sync.codec_up, cfg.sync.quant_block) for n in names}


def entry(cfg: RunConfig, learner: str, p: int, base: int, step: int,
          tensors: dict[str, quant.QTensor]) -> dict:
    return entry_fields(PushHeader(learner, p, base, step, 10, 10 * 1024, seconds=1.0),
                        tensors, cfg.sync.codec_up)


# -- pipeline efficiency -----------------------------------------------------------------------

def bench_pipeline(quick: bool = False) -> dict:
    """Pipeline efficiency, side by side in one run: 64 learners pushing once each into one
    round (decode + merge dominate; one commit per 64 entries) for each up-link codec (int4 is
    the shipped default); 4 learners with a round (merge, outer step, atomic commit, publish)
    every 4 entries, int4 and fp32, with the full state checkpointed every round (as every
    commit wrote it before checkpoints) and every `CHECKPOINT_ROUNDS` (the default); and the
    first again with the merge kernels on 1 and 2 threads.

    ``commit_ratio_*``: the syncer's MB/s with a round every 4 entries ÷ its MB/s with one
    round per 64 entries (the same codec) — what per-round work costs."""

    out: dict = {"bench": "pipeline", "merge_kernels": kernels.backend()}
    reps = 2 if quick else 3
    for codec_up in ("int4", "int8", "bf16", "fp32"):
        out[f"decode_merge_{codec_up}"] = _pipeline_pass(64, 1, reps, codec_up)
    n_rounds = 4 if quick else CHECKPOINT_ROUNDS  # one checkpoint per pass at the default
    for codec_up in ("int4", "fp32"):
        for every in (1, CHECKPOINT_ROUNDS):
            r = _pipeline_pass(4, n_rounds, reps, codec_up, broker={"checkpoint_rounds": every,
                                                                    "checkpoint_s": 0.0})
            key = f"with_commits_{codec_up}_checkpoint_{every}"
            out[key] = {**r, "checkpoint_rounds": every}
            out[f"commit_ratio_{codec_up}_checkpoint_{every}"] = (
                r["syncer_mb_s"] / out[f"decode_merge_{codec_up}"]["syncer_mb_s"])
    out["with_commits"] = out[f"with_commits_int4_checkpoint_{CHECKPOINT_ROUNDS}"]
    # the syncer's capacity against the threads its merge kernels may use (int4, 64 entries
    # into one round): contributions/s, and MB/s per thread
    out["merge_threads"] = {}
    for t in (1, 2):
        kernels.set_threads(t)
        try:
            r = _pipeline_pass(64, 1, reps, "int4")
        finally:
            kernels.set_threads(1)
        out["merge_threads"][str(t)] = {
            **r, "contributions_per_s": r["syncer_mb_s"] / r["entry_wire_mb"],
            "mb_s_per_thread": r["syncer_mb_s"] / t}
    out["ratio"] = out["decode_merge_int4"]["ratio"]
    out["ratio_with_commits"] = out["with_commits"]["ratio"]
    return out


def _pipeline_pass(M: int, n_rounds: int, reps: int, codec_up: str = "int4",
                   broker: dict | None = None) -> dict:

    cfg = cfgmod.from_dict({**BIG, "learners": M, "broker": broker or {},
                            "sync": {**BIG["sync"], "quorum": M, "codec_up": codec_up}})
    p = 1
    with RedisServer(appendonly=False) as srv:
        store_run_config(srv.url, "bench", cfg)
        ctx = open_run(srv.url, "bench")
        zctx = zmq.Context()
        syncer = Syncer(SyncerConfig(srv.url, "bench", fragments=(p,)), ctx, zctx)
        syncer.start()
        for m in range(M):  # live learners: rounds close as soon as all of them contributed
            registry.heartbeat(ctx.r, ctx.keys, f"L{m}", Heartbeat(step_s=1.0), ttl_s=3600)
        streams = FragmentStreams(ctx.r, ctx.keys)
        payloads = [_fragment_delta(cfg, p, seed) for seed in range(4)]
        wire_mb = sum(len(codec.pack_tensors(t)) for t in payloads) / len(payloads) / 1e6
        raw_rates, syncer_rates = [], []
        for rep in range(reps):
            version = syncer.frags[p].core.version
            ids = []
            for rnd in range(n_rounds):
                for m in range(M):
                    ids.append(streams.push(p, entry(cfg, f"L{m}", p, version + rnd,
                                                     1000 * rep + rnd + 1, payloads[m % 4])))
            group = f"raw{rep}"
            ctx.r.xgroup_create(ctx.keys.fragment(p).frags, group, id=_before(ids[0]))
            t0 = time.perf_counter()
            n = 0
            while n < len(ids):
                reply = ctx.r.xreadgroup(group, "c", {ctx.keys.fragment(p).frags: ">"}, count=8)
                n += sum(len(items) for _, items in reply)
            raw_rates.append(len(ids) * wire_mb / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            start_version = syncer.frags[p].core.version
            while syncer.frags[p].core.version < start_version + n_rounds:
                syncer.poll_once()
            syncer_rates.append(len(ids) * wire_mb / (time.perf_counter() - t0))
        syncer.pub.close()
        zctx.term()
    raw, merged = statistics.median(raw_rates), statistics.median(syncer_rates)
    return {"learners": M, "rounds_per_pass": n_rounds, "entries_per_pass": M * n_rounds,
            "fragment_params": _frag_params(cfg, p), "codec_up": cfg.sync.codec_up,
            "entry_wire_mb": round(wire_mb, 3), "raw_xreadgroup_mb_s": raw,
            "syncer_mb_s": merged, "ratio": merged / raw, "raw_passes": raw_rates,
            "syncer_passes": syncer_rates}


def _before(entry_id: str) -> str:
    ms, seq = entry_id.split("-")
    return f"{ms}-{int(seq) - 1}" if int(seq) > 0 else f"{int(ms) - 1}-18446744073709551615"


def _frag_params(cfg: RunConfig, p: int) -> int:
    task = task_of(cfg, local=cfg.task)
    shapes = task.param_shapes()
    names = partition(shapes, cfg.effective_sync().fragments, task.is_embedding)[p]
    return int(sum(np.prod(shapes[n]) for n in names))


# -- one redis-server vs a Redis Cluster, the same syncer work -------------------------------

def bench_cluster(quick: bool = False) -> dict:
    """A syncer serving every fragment of the 1M-parameter model (5 fragments, 4 learners, int4
    entries, a round per 4 entries with commits) on one redis-server and on a local Redis
    Cluster (3 masters with a replica each, the fragments' slots spread over them), side by
    side in one run; AOF everysec on every server. ``syncer_mb_s``: entries' wire bytes merged
    per second."""
    reps = 2 if quick else 3
    n_rounds = 3 if quick else 8
    out: dict = {"bench": "cluster", "learners": 4, "rounds_per_pass": n_rounds, "reps": reps}
    for kind in ("standalone", "cluster"):
        out[kind] = _all_fragments_pass(kind, n_rounds, reps)
    out["ratio_cluster_vs_standalone"] = (out["cluster"]["syncer_mb_s"]
                                          / out["standalone"]["syncer_mb_s"])
    return out


def _all_fragments_pass(kind: str, n_rounds: int, reps: int, M: int = 4) -> dict:
    cfg = cfgmod.from_dict({**BIG, "learners": M,
                            "sync": {**BIG["sync"], "quorum": M, "codec_up": "int4"}})
    n_frags = cfg.effective_sync().fragments
    with contextlib.ExitStack() as stack:
        server = ClusterServers() if kind == "cluster" else RedisServer()
        stack.enter_context(server)
        store_run_config(server.url, "bench", cfg)
        ctx = open_run(server.url, "bench")
        stack.callback(ctx.r.close)
        zctx = zmq.Context()
        stack.callback(zctx.term)
        syncer = Syncer(SyncerConfig(server.url, "bench"), ctx, zctx)
        stack.callback(syncer.pub.close)
        syncer.start()
        if syncer.owned != list(range(n_frags)):
            raise RuntimeError(f"the syncer owns {syncer.owned}")
        for m in range(M):
            registry.heartbeat(ctx.r, ctx.keys, f"L{m}", Heartbeat(step_s=1.0), ttl_s=3600)
        streams = FragmentStreams(ctx.r, ctx.keys)
        payloads = {p: [_fragment_delta(cfg, p, seed) for seed in range(M)]
                    for p in range(n_frags)}
        wire = {p: [len(codec.pack_tensors(t)) for t in payloads[p]] for p in range(n_frags)}
        rates = []
        for rep in range(reps):
            start = {p: f.core.version for p, f in syncer.frags.items()}
            total = 0
            for rnd in range(n_rounds):
                for p in range(n_frags):
                    for m in range(M):
                        streams.push(p, entry(cfg, f"L{m}", p, start[p] + rnd,
                                              1000 * rep + rnd + 1, payloads[p][m]))
                        total += wire[p][m]
            t0 = time.perf_counter()
            while any(syncer.frags[p].core.version < start[p] + n_rounds
                      for p in range(n_frags)):
                syncer.poll_once()
            rates.append(total / 1e6 / (time.perf_counter() - t0))
    return {"server": kind, "fragments": n_frags, "syncer_mb_s": statistics.median(rates),
            "passes": rates}


# -- recovery after a syncer dies, vs rounds since its last checkpoint --------------------------

def bench_recovery(quick: bool = False) -> dict:
    """How long a successor syncer takes to start on a fragment whose last checkpoint is R
    rounds behind its committed version (4 int4 contributions per round, the 1M-parameter
    fragment): a syncer commits R rounds with no checkpoint after version 0 and is gone (its
    lease deleted, as when it runs out); a second one starts, replays the R rounds and must
    hold the same value (its hash). ``start_s`` is the whole start (state, replay,
    re-publish, pending entries), ``replay_s`` the replay alone; the lease timeout
    (``broker.lease_ms``) comes on top when a syncer dies without releasing it."""
    points = (0, 4, 8) if quick else (0, 5, 10, 20, 40)
    out: dict = {"bench": "recovery", "learners": 4, "points": []}
    for n in points:
        out["points"].append(_recovery_point(n))
    pts = [x for x in out["points"] if x["rounds_since_checkpoint"] > 0]
    out["replay_s_per_round"] = statistics.median(x["replay_s"] / x["rounds_since_checkpoint"]
                                                  for x in pts)
    return out


def _recovery_point(n_rounds: int, M: int = 4) -> dict:
    cfg = cfgmod.from_dict({**BIG, "learners": M,
                            "broker": {"checkpoint_rounds": 10**6, "checkpoint_s": 0.0},
                            "sync": {**BIG["sync"], "quorum": M, "codec_up": "int4"}})
    p = 1
    with RedisServer(appendonly=False) as srv:
        store_run_config(srv.url, "bench", cfg)
        ctx = open_run(srv.url, "bench")
        zctx = zmq.Context()
        try:
            first = Syncer(SyncerConfig(srv.url, "bench", "syncer-a", fragments=(p,)), ctx, zctx)
            first.start()
            for m in range(M):
                registry.heartbeat(ctx.r, ctx.keys, f"L{m}", Heartbeat(step_s=1.0), ttl_s=3600)
            streams = FragmentStreams(ctx.r, ctx.keys)
            payloads = [_fragment_delta(cfg, p, seed) for seed in range(M)]
            for rnd in range(n_rounds):
                v = first.frags[p].core.version
                for m in range(M):
                    streams.push(p, entry(cfg, f"L{m}", p, v, rnd + 1, payloads[m]))
                while first.frags[p].core.version == v:
                    first.poll_once()
            want = first.frags[p].core.sent_hash
            first.pub.close()
            ctx.r.delete(ctx.keys.fragment(p).lease)  # gone without a word: the lease ran out
            t0 = time.perf_counter()
            second = Syncer(SyncerConfig(srv.url, "bench", "syncer-b", fragments=(p,)), ctx,
                            zctx)
            second.start()
            start_s = time.perf_counter() - t0
            second.pub.close()
            got = second.frags[p].core
            if got.version != n_rounds or got.sent_hash != want:
                raise RuntimeError(f"the successor holds v{got.version} {got.sent_hash[:12]}, "
                                   f"the first syncer v{n_rounds} {want[:12]}")
            replay_s = 0.0
            for _, f in ctx.r.xrange(ctx.keys.events):
                if f.get(b"kind") == b"recovered":
                    replay_s = float(f[b"seconds"])
        finally:
            ctx.r.close()
            zctx.term()
    return {"rounds_since_checkpoint": n_rounds, "start_s": start_s, "replay_s": replay_s,
            "fragment_params": _frag_params(cfg, p)}


# -- syncer memory and round latency (a real syncer process, synthetic pushers) -----------------

def servers(stack: contextlib.ExitStack, secure: bool, run: str, learners: list[str]
             ) -> tuple[str, str, list[str], SecureSetup | None]:
    """(admin URL, learner URL, the syncer's Redis/CURVE/signing arguments, the setup): an
    open redis-server, or with `secure` a TLS-only one with ACL users, CURVE and signing keys
    (`ops.cluster.SecureSetup`)."""
    if not secure:
        srv = stack.enter_context(RedisServer(appendonly=False))
        return srv.url, srv.url, ["--redis-url", srv.url], None
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
    sec = SecureSetup(tmp, run, learners).start()
    stack.callback(sec.stop)
    return sec.admin_url, sec.urls["learner"], sec.syncer_args(), sec


def _syncer_run(M: int, rounds: int, *, latency: bool, secure: bool = False) -> dict:
    cfg = cfgmod.from_dict({**BIG, "learners": M, "sync": {**BIG["sync"], "quorum": M}})
    p = 1
    with contextlib.ExitStack() as stack:
        admin, learner_url, syncer_args, sec = servers(stack, secure, "bench",
                                                        [f"L{m}" for m in range(M)])
        store_run_config(admin, "bench", cfg)
        proc = subprocess.Popen([sys.executable, "-m", "workers.syncer", *syncer_args,
                                 "--run", "bench", "--fragments", str(p)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            r = connect(learner_url)  # pushes and heartbeats with a learner's credential
            keys = RunKeys("bench")
            streams = FragmentStreams(r, keys)
            deadline = time.monotonic() + 120
            while not registry.endpoints(r, keys) or not r.exists(keys.fragment(p).global_):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the syncer did not start")
                time.sleep(0.05)
            zctx = zmq.Context()
            sub = Subscriber(zctx, [p], curve=sec.curve_client("L0") if sec else None)
            sub.connect(registry.endpoints(r, keys))
            time.sleep(0.5)  # let the subscription reach the publisher (slow joiner)
            payloads = [_fragment_delta(cfg, p, seed) for seed in range(min(M, 8))]
            wire_mb = sum(len(codec.pack_tensors(t)) for t in payloads) / len(payloads) / 1e6
            sign = {f"L{m}": sec.sign_key(f"L{m}") for m in range(M)} if sec else {}
            for n in (f"L{m}" for m in range(M)):  # signed as learners sign them (counted)
                registry.heartbeat(r, keys, n, Heartbeat(step_s=1.0), ttl_s=600, sign=partial(
                    signing.sign_record, sign[n], "bench", "heartbeat", n) if sign else None)
            lat = []
            version = 0
            rss_before = rss_peak(proc.pid)
            t_start = time.perf_counter()
            for rnd in range(rounds):
                for m in range(M):
                    fields = entry(cfg, f"L{m}", p, version, rnd + 1, payloads[m % len(payloads)])
                    if sign:
                        fields = signing.signed(sign[f"L{m}"], "bench", fields)
                    streams.push(p, fields)
                t_last = time.perf_counter()
                while True:
                    msg = sub.recv(30_000)
                    if msg is None:
                        raise RuntimeError(f"no merged value for round {rnd + 1}")
                    if not isinstance(msg, Attestation) and msg[0].version > version:
                        break  # (with CURVE the syncer also attests: `broker.attest`)
                lat.append(time.perf_counter() - t_last)
                version = msg[0].version
            elapsed = time.perf_counter() - t_start
            peak = rss_peak(proc.pid)
            sub.close()
            zctx.term()
        finally:
            proc.kill()
            proc.wait()
    out = {"pushers": M, "rounds": rounds, "fragment_params": _frag_params(cfg, p),
           "syncer_peak_rss_mb": peak / 2**20, "syncer_rss_after_start_mb": rss_before / 2**20,
           "entry_wire_mb": wire_mb,
           "throughput_mb_s": rounds * M * wire_mb / elapsed}  # push → merged value out
    if latency:
        lat_ms = np.array(lat) * 1000
        out.update({"latency_ms_p50": float(np.percentile(lat_ms, 50)),
                    "latency_ms_p99": float(np.percentile(lat_ms, 99)),
                    "latency_ms_max": float(lat_ms.max())})
    return out


def rss_peak(pid: int) -> int:
    """VmHWM (peak resident set) of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc")


def bench_memory(quick: bool = False) -> dict:
    rounds = 2 if quick else 4
    small = _syncer_run(4, rounds, latency=False)
    large = _syncer_run(64, rounds, latency=False)
    return {"bench": "memory", "pushers_4": small, "pushers_64": large,
            "peak_rss_ratio_64_vs_4": large["syncer_peak_rss_mb"] / small["syncer_peak_rss_mb"]}


def bench_latency(quick: bool = False) -> dict:
    res = _syncer_run(4, 10 if quick else 60, latency=True)
    res["bench"] = "latency"
    res["fragment_mb_fp32"] = res["fragment_params"] * 4 / 1e6
    return res


def curve_cost(size: int = 2 * 1024 * 1024, n: int = 60) -> dict:
    """What ZeroMQ CURVE adds to one published value: the median time of a `size`-byte message
    from a PUB to a SUB socket over loopback TCP, plain and with CURVE (encrypted by the
    publisher's I/O thread for each subscriber, decrypted by the subscriber's), twice each,
    alternating, in this process."""
    def one(curve: bool) -> float:
        ctx = zmq.Context()
        pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
        try:
            if curve:
                server_pub, server_sec = zmq.curve_keypair()
                client_pub, client_sec = zmq.curve_keypair()
                pub.curve_server = True
                pub.curve_secretkey, pub.curve_publickey = server_sec, server_pub
                sub.curve_serverkey = server_pub
                sub.curve_publickey, sub.curve_secretkey = client_pub, client_sec
            port = pub.bind_to_random_port("tcp://127.0.0.1")
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVTIMEO, 10_000)
            sub.connect(f"tcp://127.0.0.1:{port}")
            msg = os.urandom(size)
            for _ in range(50):  # the subscription reaches the publisher (slow joiner)
                pub.send(b"hello")
                if sub.poll(100):
                    break
            else:
                raise RuntimeError("the subscriber never received a message")
            while sub.poll(200):  # every greeting sent before the first one arrived
                sub.recv()
            times = []
            for _ in range(n):
                t = time.perf_counter()
                pub.send(msg)
                if len(sub.recv()) != size:
                    raise RuntimeError("a message arrived cut")
                times.append(time.perf_counter() - t)
            return statistics.median(times) * 1e3
        finally:
            pub.close(0)
            sub.close(0)
            ctx.term()

    runs = {"plain": [], "curve": []}
    for _ in range(2):
        for mode in runs:
            runs[mode].append(one(mode == "curve"))
    plain, curve = statistics.mean(runs["plain"]), statistics.mean(runs["curve"])
    return {"message_bytes": size, "messages": n, "ms_plain": plain, "ms_curve": curve,
            "curve_ms_added": curve - plain, "runs": runs}


def bench_security(quick: bool = False) -> dict:
    """The cost of security, side by side in one run: round latency p50/p99 and throughput
    through a real syncer process (4 pushers, 4 MB fragments), and one learner's steady
    step rate while syncing (the overlap set-up), each open vs TLS + ACL users + CURVE +
    signed contributions (`ops.cluster.SecureSetup`)."""
    rounds = 10 if quick else 60
    out: dict = {"bench": "security"}
    for mode in ("open", "secure"):
        out[f"latency_{mode}"] = _syncer_run(4, rounds, latency=True, secure=mode == "secure")
    steps = 300 if quick else 1500
    base = cfgmod.override(cfgmod.demo_config(), learners=1, steps=steps,
                           **{"sync.quorum": 1})
    from ops.bench.overlap import run_overlap

    out["overlap"] = run_overlap(base, [sys.executable, "-m", "workers.learner"], quick,
                                 modes=("on", "secure"))
    lo, ls = out["latency_open"], out["latency_secure"]
    out["throughput_ratio"] = ls["throughput_mb_s"] / lo["throughput_mb_s"]
    out["latency_p50_ratio"] = ls["latency_ms_p50"] / lo["latency_ms_p50"]
    out["latency_p99_ratio"] = ls["latency_ms_p99"] / lo["latency_ms_p99"]
    ov = out["overlap"]
    out["overlap_ratio"] = ov["steps_per_s_secure"] / ov["steps_per_s_on"]
    # what CURVE alone adds to one published value of this benchmark's size (fp32 4 MB
    # fragment, published in bf16)
    out["curve"] = curve_cost(n=10 if quick else 60)
    return out
