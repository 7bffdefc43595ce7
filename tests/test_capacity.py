"""A model too large for its settings is refused before anything is written, in one line that
names the setting that fixes it (the ~300M byte GPT with the default 4 fragments used to break
the syncer's first state write with a misleading `LeaseLost`)."""

from __future__ import annotations

import logging

import pytest

from pipeline import capacity
from pipeline import config as cfgmod
from pipeline.task import task_of

BIG = {"model.d_model": 2048, "model.n_layers": 6, "model.n_heads": 16}  # ~302M values
BIG_ARGS = [a for k, v in BIG.items() for a in ("--set", f"{k}={v}")]


def _check(over: dict, limits: capacity.Limits | None = None) -> str | None:
    cfg = cfgmod.override(cfgmod.RunConfig(), **over)
    task = task_of(cfg, local=cfg.task)
    return capacity.check(cfg, task.param_shapes(), task.is_embedding,
                          limits or capacity.Limits(cfg.broker.max_payload_bytes))


def test_value_bytes_per_codec():
    cfg = cfgmod.RunConfig()  # int4 up, int4 delta down: snapshots are the fp32 reference
    v = capacity.value_bytes(cfg, 6400)
    # the first published value is the fp32 reference, every later one an int4 delta
    assert v == {"push": 3200 + 4 * 100, "publish": 4 * 6400, "publish_steady": 3200 + 4 * 100,
                 "snapshot": 4 * 6400, "state": 8 * 6400}
    whole = cfgmod.override(cfg, **{"sync.codec_down": "bf16", "sync.down_delta": False})
    assert capacity.value_bytes(whole, 6400)["snapshot"] == 2 * 6400


def test_the_300m_model_is_refused_with_the_fragments_that_fit():
    said = _check(BIG)
    assert said is not None
    assert said.startswith("fragment 1 holds 100,681,728 values: its published value is 384 MiB,"
                           " over broker.max_payload_bytes (256 MiB)"), said
    assert said.endswith("set sync.fragments to at least 6 (the largest fragment then holds "
                         "62,914,560 values)"), said
    assert _check({**BIG, "sync.fragments": 5}) is not None  # 6 is the fewest
    assert _check({**BIG, "sync.fragments": 6}) is None
    # or the payload bound raised instead: the state (800 MB, over Redis's 512 MB for one
    # value) is stored in pieces of broker.piece_bytes
    assert _check({**BIG, "broker.max_payload_bytes": 2**31}) is None


def test_a_tensor_too_large_for_any_fragment_names_the_limit_to_raise():
    limits = capacity.Limits(2**20, 2**20, "Redis's proto-max-bulk-len", piece_bytes=2**18)
    said = _check({}, limits)  # the default model: its largest tensor has 65,536 values
    assert said is not None and "set sync.fragments" not in said
    assert "no number of fragments fits it" in said and "raise broker.max_payload_bytes" in said


def test_the_default_and_demo_models_pass():
    assert _check({}) is None
    cfg = cfgmod.demo_config()
    task = task_of(cfg, local=cfg.task)
    assert capacity.check(cfg, task.param_shapes(), task.is_embedding,
                          capacity.Limits(cfg.broker.max_payload_bytes)) is None


def test_init_refuses_in_one_line_and_stores_nothing(capsys, redis_server):
    from broker.connection import connect
    from ops.cli import main

    # sync.fragments set to a number whose values do not fit: refused, nothing stored
    code = main(["init", "--redis-url", redis_server.url, "--run", "big", *BIG_ARGS,
                 "--set", "sync.fragments=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "set sync.fragments to at least 6" in err[0] and "Traceback" not in err[0], err
    r = connect(redis_server.url)
    assert not r.keys("ddl:{big*"), r.keys("*")
    # not set: chosen for the model (one line says so) and stored
    assert main(["init", "--redis-url", redis_server.url, "--run", "big", *BIG_ARGS]) == 0
    assert "sync.fragments = 6: not set" in capsys.readouterr().err
    import tomllib

    from broker import registry
    from broker.keys import RunKeys
    stored = cfgmod.from_stored(tomllib.loads(registry.load_config(r, RunKeys("big"))[0]))
    assert stored.sync.fragments == 6
    r.close()


@pytest.fixture
def small_bulk_redis(tmp_path):
    """A redis-server that takes values of at most 1 MB (its smallest proto-max-bulk-len)."""
    from ops.cluster.redis_server import RedisServer

    server = RedisServer(workdir=tmp_path / "redis",
                         extra=("--proto-max-bulk-len", "1mb")).start()
    yield server
    server.stop()


def test_redis_limit_is_read_and_the_syncer_refuses_a_run_stored_without_the_check(
        small_bulk_redis, caplog):
    from broker import registry
    from broker.connection import connect, value_limits
    from broker.keys import RunKeys
    from workers import syncer

    url = small_bulk_redis.url
    r = connect(url)
    limits = value_limits(r, 256 * 2**20)
    assert limits.redis_bulk_bytes == 2**20 and limits.redis_source == \
        "Redis's proto-max-bulk-len"
    cfg = cfgmod.RunConfig()  # the default model: a fragment's state is ~1.8 MB
    said = _check({}, limits)
    assert said == ("broker.piece_bytes (64 MiB) does not fit one Redis value (Redis's "
                    "proto-max-bulk-len: 1 MiB): lower broker.piece_bytes"), said
    assert _check({}, capacity.Limits(256 * 2**20, 2**20, "x", piece_bytes=2**18)) is None
    # stored as an earlier version's `init` would have: the syncer refuses before any write
    registry.store_config(r, RunKeys("old"), cfgmod.dumps_toml(cfg), cfg.run_hash())
    with caplog.at_level(logging.ERROR, logger="workers.syncer"):
        code = syncer.main(syncer.parse_args(["--redis-url", url, "--run", "old",
                                              "--insecure"]))
    assert code == 2
    assert any("cannot start" in rec.getMessage() and "proto-max-bulk-len" in rec.getMessage()
               for rec in caplog.records), caplog.text
    assert not [k for k in r.keys("ddl:{old*") if k.endswith(b":state")], r.keys("*")
    r.close()


def test_a_value_over_redis_limit_is_an_outage_not_a_lost_lease(small_bulk_redis):
    """redis-py turns a connection that dies while a key is watched into a WatchError; the
    fenced writes said "lease changed" for it. A value Redis refuses is not a lost lease."""
    import redis

    from broker.commit import LeaseLost
    from broker.connection import connect
    from broker.keys import RunKeys
    from broker.streams import FragmentStreams

    r = connect(small_bulk_redis.url)
    streams = FragmentStreams(r, RunKeys("big"))
    assert streams.state.acquire_lease(0, "s0", 10_000)
    with pytest.raises(redis.ConnectionError) as err:
        streams.state.init_fragment(0, "s0", state=b"\0" * (2 << 20), snapshot=b"x")
    assert not isinstance(err.value, LeaseLost)
    assert streams.state.load_state(0, 2**30) is None  # nothing half-written
    r.close()


def test_a_value_over_redis_limit_goes_in_pieces(small_bulk_redis):
    """The same values over the same 1 MB limit, with pieces of 256 KiB: written, read back
    whole, replaced whole."""
    from broker import pieces
    from broker.connection import connect
    from broker.keys import RunKeys
    from broker.streams import FragmentStreams

    r = connect(small_bulk_redis.url)
    keys = RunKeys("big")
    streams = FragmentStreams(r, keys, piece_bytes=2**18)
    state, snap = bytes(range(256)) * (2 << 12), b"s" * (3 << 20)
    assert streams.state.acquire_lease(0, "s0", 10_000)
    assert streams.state.init_fragment(0, "s0", state=state, snapshot=snap)
    assert streams.state.load_state(0, 2**30) == state and streams.read_global(0, 2**30) == snap
    assert r.type(keys.fragment(0).state) == b"hash" and r.hlen(keys.fragment(0).state) == 9
    new = b"n" * ((2 << 20) + 5)
    streams.state.commit_round(0, "s0", state=new, snapshot=b"tiny", version=1,
                         record={"version": 1}, ack_ids=[])
    assert streams.state.load_state(0, 2**30) == new and streams.read_global(0, 2**30) == b"tiny"
    assert pieces.nbytes(r, keys.fragment(0).state) == len(new)
    assert streams.state.load_sent(0, [0, 1], 2**30) == {0: snap, 1: b"tiny"}
    assert not list(r.scan_iter("*staging*"))
    r.close()


def test_a_tensor_with_more_dimensions_than_the_state_holds_is_refused_up_front():
    """The wire took 32 dimensions, the syncer's state 8, a task anything: a 9-dimensional
    tensor trained, crossed the wire, and left a state no successor could read. One bound
    (`pipeline.limits`), checked where the task is loaded."""
    import numpy as np

    from broker import codec
    from pipeline.config import ConfigError
    from pipeline.limits import MAX_NDIM
    from pipeline.task import TreeTask, check

    shape = (1,) * (MAX_NDIM + 1)
    task = TreeTask(run=cfgmod.RunConfig(), name="deep",
                    init=lambda s: {"w": np.zeros(shape, np.float32)},
                    loss=lambda t, b: (t["w"] ** 2).sum())
    with pytest.raises(ConfigError, match="9 dimensions"):
        check(task)
    q = {"w": capacity.quant.quantize(np.zeros(shape[:MAX_NDIM], np.float32), "fp32")}
    blob = codec.pack_snapshot("r", 1, 1, q)  # MAX_NDIM dimensions: the codec's limit too
    assert codec.unpack_snapshot(blob)[1]["w"].shape == shape[:MAX_NDIM]


def test_init_refuses_a_redis_whose_maxmemory_cannot_hold_the_run(tmp_path, capsys):
    """The demo run needs 2 MiB of Redis at the least (checkpoints, the latest snapshot twice,
    a push per learner): a 1 MB maxmemory is refused in one line naming the setting (the
    plan's steady state is `diloco plan`'s to print, not a refusal)."""
    from broker.connection import connect, value_limits
    from ops.cli import main
    from ops.cluster.redis_server import RedisServer

    server = RedisServer(workdir=tmp_path / "redis", extra=("--maxmemory", "1mb")).start()
    try:
        r = connect(server.url)
        assert value_limits(r, 2**28).redis_maxmemory == 2**20
        r.close()
        assert main(["init", "--redis-url", server.url, "--run", "small"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Redis's maxmemory (1 MiB) cannot hold what this run needs " \
            "at the least (2 MiB" in err[0], err
        assert "raise maxmemory in redis.conf" in err[0] and "Traceback" not in err[0]
    finally:
        server.stop()


def test_each_role_checks_its_planned_memory_against_its_host(tmp_path, caplog):
    """A learner or syncer whose arrays (`pipeline.plan.role_bytes`) exceed the host's memory
    is refused in one line naming what to change; one that exceeds only what is available
    now starts with a warning; a host whose memory is not known starts."""
    from pipeline.plan import Workload, memory, role_bytes
    from workers.common import memory_refusal

    cfg = cfgmod.RunConfig()
    sizes = [600_000_000, 400_000_000]
    planned = memory(cfg, Workload(tuple(sizes), cfg.learners, 1.0, 1.0, 1.0))
    assert role_bytes(cfg, sizes, "learner") == int(planned["learner_bytes"])
    assert role_bytes(cfg, sizes, "syncer") == int(planned["syncer_bytes"])
    assert role_bytes(cfg, sizes[1:], "syncer") < role_bytes(cfg, sizes, "syncer")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16777216 kB\nMemFree:  1 kB\nMemAvailable:    4194304 kB\n")
    need = role_bytes(cfg, sizes, "syncer")  # ~30 GiB
    why = memory_refusal("syncer", need, "give this syncer fewer fragments (--fragments)", meminfo)
    assert why is not None and "16.0 GiB" in why and "--fragments" in why and "\n" not in why
    with caplog.at_level(logging.WARNING, logger="diloco.common"):
        assert memory_refusal("learner", 8 * 2**30, "x", meminfo) is None
    assert "more than the 4.0 GiB available on this host now" in caplog.text
    assert memory_refusal("learner", 2**50, "x", tmp_path / "missing") is None


def test_fragments_not_set_are_chosen_for_the_model_and_a_set_number_is_kept(tmp_path, capsys):
    """Without `sync.fragments` set, the command line raises it to the least whose values fit
    (said in one line); set on the command line or in the file, it is kept (and a run that
    does not fit is refused by `init`, naming it)."""
    import argparse

    from ops.cli.common import config_from_args

    big = ["model.d_model=2048", "model.n_layers=12", "model.n_heads=16"]

    def args(*sets, config=None):
        return argparse.Namespace(set=list(sets), config=config)

    cfg = config_from_args(args(*big))
    task = task_of(cfg, local=cfg.task)
    limits = capacity.Limits(cfg.broker.max_payload_bytes)
    assert cfg.sync.fragments == 11 and capacity.check(
        cfg, task.param_shapes(), task.is_embedding, limits) is None
    assert capacity.fragments_needed(cfgmod.override(cfg, **{"sync.fragments": 4}),
                                     task.param_shapes(), task.is_embedding, limits) == 11
    assert "sync.fragments = 11: not set" in capsys.readouterr().err
    assert config_from_args(args(*big, "sync.fragments=4")).sync.fragments == 4
    toml = tmp_path / "run.toml"
    toml.write_text("[model]\nd_model = 2048\nn_layers = 12\nn_heads = 16\n[sync]\nfragments = 4\n")
    assert config_from_args(args(config=str(toml))).sync.fragments == 4
    assert capsys.readouterr().err == ""
    assert config_from_args(args()).sync.fragments == cfgmod.RunConfig().sync.fragments
