"""`diloco replay` and the entry archive, on one real multi-process run shared by the module.

The run (a syncer and two learners as OS processes over a private redis-server) is started
once; each test works on its own copy of the run's keys (Redis COPY under another run name),
so tests can delete or alter entries without affecting each other.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import redis

from broker import archive
from broker.archive import ArchiveError, archive_below, archive_entries, load_archive
from broker.entries import entry_fields, parse_entry
from broker.keys import RunKeys
from ops import cli
from ops.cluster.redis_server import RedisServer
from pipeline import config as cfgmod
from pipeline import quant

REPO = Path(__file__).resolve().parent.parent
RUN = "rp"
CONFIG = {
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32},
    "data": {"max_bytes": 600_000, "eval_batches": 4},
    "inner": {"lr": 3e-3, "warmup_steps": 5, "batch_size": 8},
    "sync": {"fragments": 2, "sync_every": 10},
    "broker": {"keep_rounds": 10_000},  # nothing is trimmed: every merged entry stays
    "learners": 2,
    "steps": 30,
}


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """(redis url, run summary) of one finished distributed run named `RUN`."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    tmp = tmp_path_factory.mktemp("replay-run")
    cfg_path = tmp / "run.toml"
    cfg_path.write_text(cfgmod.dumps_toml(cfgmod.from_dict(CONFIG)))
    server = RedisServer(workdir=tmp / "redis", appendonly=False).start()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "ops.cli", "run", "--config", str(cfg_path), "--redis-url",
             server.url, "--run", RUN, "--out", str(tmp / "runs"), "--json", "--quiet"],
            cwd=REPO, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-4000:]
        yield server.url, json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        server.stop()


@pytest.fixture
def r(finished_run):
    client = redis.Redis.from_url(finished_run[0])
    yield client
    client.close()


def clone_run(r: redis.Redis, dst: str) -> RunKeys:
    """Copy every key of run `RUN` to run `dst` (replacing what `dst` had)."""
    src_keys, dst_keys = RunKeys(RUN), RunKeys(dst)
    r.copy(src_keys.config, dst_keys.config, replace=True)
    for p in range(n_fragments(r)):
        src, dst_tag = src_keys.fragment(p), f"ddl:{{{dst}/f{p:04d}}}"
        prefix = src.frags[: -len(":frags")]
        for key in r.scan_iter(match=prefix + ":*"):
            r.copy(key, dst_tag + key.decode()[len(prefix):], replace=True)
    return dst_keys


def n_fragments(r: redis.Redis) -> int:
    return len(list(r.scan_iter(match=f"ddl:{{{RUN}/f*}}:rounds")))


def diloco(*argv: str) -> int:
    """`diloco ...` in-process."""
    return cli.main(list(argv))


def replay_json(capsys, url: str, run: str, *extra: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = diloco("replay", "--redis-url", url, "--run", run, "--json", *extra)
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def records(r: redis.Redis, keys: RunKeys, p: int) -> list[dict]:
    out = []
    for _, fields in r.xrange(keys.fragment(p).rounds):
        out.append({"version": int(fields[b"version"]),
                    "included": json.loads(fields[b"included"])})
    return out


def move_to_archive(r: redis.Redis, keys: RunKeys, p: int, directory: Path) -> list:
    """Archive all of fragment p's entries, then delete them from Redis; returns the rows."""
    key = keys.fragment(p).frags
    rows = r.xrange(key)
    archive_entries(directory, keys.run, p, rows)
    if rows:
        r.xdel(key, *[i for i, _ in rows])
    return rows


# --------------------------------------------------------------------------------------- tests


def test_replay_verifies_a_finished_run_bit_for_bit(finished_run, r, capsys):
    url, summary = finished_run
    keys = RunKeys(RUN)
    code, rep = replay_json(capsys, url, RUN)
    assert code == 0, rep
    assert rep["ok"] and rep["status"] == "verified" and rep["error"] is None
    assert rep["run"] == RUN and rep["until"] is None
    assert [f["fragment"] for f in rep["fragments"]] == list(range(n_fragments(r)))
    assert rep["rounds_checked"] == summary["rounds"] > 0
    for f in rep["fragments"]:
        fk = keys.fragment(f["fragment"])
        assert f["verified"] and f["divergence"] is None and f["missing_entries"] == []
        assert f["rounds_checked"] == f["rounds"] == r.xlen(fk.rounds) > 0
        assert f["last_version"] == summary["versions"][f["fragment"]]
        merged = sum(len(rec["included"]) for rec in records(r, keys, f["fragment"]))
        assert f["entries_from"] == {"redis": merged, "archive": 0}
        assert f["state_checked"]  # the committed fp32 value and momentum match exactly
        assert f["last_version"] in f["snapshots_checked"]
    capsys.readouterr()
    assert diloco("replay", "--redis-url", url, "--run", RUN) == 0
    text = capsys.readouterr().out
    assert "verified" in text and "OK" in text


def test_replay_until_and_fragment(finished_run, capsys):
    url, _ = finished_run
    code, rep = replay_json(capsys, url, RUN, "--fragment", "1", "--until", "1")
    assert code == 0 and rep["ok"] and rep["until"] == 1
    [f] = rep["fragments"]
    assert f["fragment"] == 1 and f["rounds_checked"] == 1 and f["last_version"] == 1
    assert f["rounds"] >= 2 and not f["state_checked"]  # stopped before the committed version
    code, rep = replay_json(capsys, url, RUN, "--fragment", "7")
    assert code == 2 and not rep["ok"] and "--fragment 7" in rep["error"]
    code, rep = replay_json(capsys, url, "no-such-run")
    assert code == 2 and rep["status"] == "incomplete" and "no configuration" in rep["error"]


def test_archiving_writes_files_of_bounded_size(finished_run, r, tmp_path):
    """Files of about `file_bytes` each (one entry more at most), whatever the backlog: the
    syncer's memory while archiving does not grow with the model."""
    keys = clone_run(r, "rp-pages")
    key = keys.fragment(1).frags
    rows = r.xrange(key)
    sizes = [sum(len(k) + len(v) for k, v in f.items()) for _, f in rows]
    top = rows[-1][0].decode().split("-")
    assert archive_below(r, keys, 1, f"{top[0]}-{int(top[1]) + 1}", tmp_path / "arch",
                         file_bytes=max(sizes)) == len(rows)
    # a file closes once it holds the largest entry's bytes: two entries at most
    files = sorted((tmp_path / "arch").rglob("*.msgpack"))
    assert len(files) >= -(-len(rows) // 2) >= 2
    assert max(f.stat().st_size for f in files) < 2 * max(sizes) + 4096
    assert load_archive(tmp_path / "arch", keys.run, 1) == {i.decode(): f for i, f in rows}


def test_replay_from_the_archive_alone(finished_run, r, capsys, tmp_path):
    url, _ = finished_run
    keys = clone_run(r, "rp-arch")
    total = 0
    for p in range(n_fragments(r)):
        key = keys.fragment(p).frags
        rows = r.xrange(key)
        assert len(rows) >= 3
        floor = rows[2][0].decode()
        # what the syncer does before XTRIM MINID floor: archive everything below the floor
        assert archive_below(r, keys, p, floor, tmp_path / "arch", page=1) == 2
        r.xtrim(key, minid=floor)
        assert r.xlen(key) == len(rows) - 2
        move_to_archive(r, keys, p, tmp_path / "arch")
        assert r.xlen(key) == 0
        loaded = load_archive(tmp_path / "arch", keys.run, p)
        assert loaded == {i.decode(): f for i, f in rows}  # raw fields, bytes for bytes
        total += sum(len(rec["included"]) for rec in records(r, keys, p))
    code, rep = replay_json(capsys, url, keys.run, "--archive", str(tmp_path / "arch"))
    assert code == 0, rep
    assert all(f["verified"] for f in rep["fragments"])
    assert sum(f["entries_from"]["archive"] for f in rep["fragments"]) == total
    assert sum(f["entries_from"]["redis"] for f in rep["fragments"]) == 0


def _altered(fields: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """The same push with a different (validly encoded and checksummed) delta."""
    meta, tensors = parse_entry(fields)
    new = {}
    for name, q in tensors.items():
        values = quant.dequantize(q)
        values = values + np.float32(0.01) * np.sign(values + np.float32(1e-3))
        new[name] = quant.quantize(values.astype(np.float32), q.codec, q.block or 64)
    out = {k.encode(): (v if isinstance(v, bytes) else str(v).encode())
           for k, v in entry_fields(meta, new, next(iter(new.values())).codec).items()}
    out[b"seconds"], out[b"final"] = fields[b"seconds"], fields[b"final"]
    return out


def test_replay_detects_an_altered_entry(finished_run, r, capsys, tmp_path):
    url, _ = finished_run
    keys = clone_run(r, "rp-alt")
    p = n_fragments(r) - 1
    target = records(r, keys, p)[-1]  # the fragment's last round
    victim = target["included"][0][0]
    rows = {}
    for q in range(n_fragments(r)):
        rows[q] = move_to_archive(r, keys, q, tmp_path / "good")
    altered = [(i, _altered(f) if i.decode() == victim else f) for i, f in rows[p]]
    assert any(a != b for (_, a), (_, b) in zip(altered, rows[p], strict=True))
    for q in range(n_fragments(r)):
        archive_entries(tmp_path / "bad", keys.run, q, altered if q == p else rows[q])
    code, rep = replay_json(capsys, url, keys.run, "--archive", str(tmp_path / "bad"))
    assert code == 1 and rep["status"] == "diverged" and not rep["ok"]
    by_p = {f["fragment"]: f for f in rep["fragments"]}
    assert all(by_p[q]["verified"] for q in by_p if q != p)
    f = by_p[p]
    d = f["divergence"]
    assert not f["verified"] and f["missing_entries"] == []
    assert d["version"] == target["version"] and d["kind"] == "hash"
    assert f["rounds_checked"] == f["last_version"] == target["version"] - 1
    assert d["recorded_hash"] != d["recomputed_hash"] and d["recomputed_hash"]
    assert [row["entry_id"] for row in d["inputs"]] == [x[0] for x in target["included"]]
    for row, (_, learner, weight, staleness) in zip(d["inputs"], target["included"],
                                                           strict=True):
        assert row["learner"] == learner and row["accepted"] and row["source"] == "archive"
        assert row["weight"] == row["recorded_weight"] == weight
        assert row["staleness"] == row["recorded_staleness"] == staleness
        assert row["steps"] > 0 and row["tokens"] > 0 and row["base_version"] >= 0
    capsys.readouterr()
    assert diloco("replay", "--redis-url", url, "--run", keys.run, "--archive",
                  str(tmp_path / "bad")) == 1
    assert f"DIVERGED at v{target['version']}" in capsys.readouterr().out
    # bytes flipped without a valid checksum: the entry no longer decodes
    flipped = [(i, {**f, b"payload": f[b"payload"][:-1] + bytes([f[b"payload"][-1] ^ 1])}
                if i.decode() == victim else f) for i, f in rows[p]]
    archive_entries(tmp_path / "flip", keys.run, p, flipped)
    code, rep = replay_json(capsys, url, keys.run, "--archive", str(tmp_path / "flip"),
                            "--fragment", str(p))
    assert code == 1
    d = rep["fragments"][0]["divergence"]
    assert d["version"] == target["version"] and d["kind"] == "decode"
    assert "sha256" in d["problems"][0]
    # the untouched archive still verifies
    code, rep = replay_json(capsys, url, keys.run, "--archive", str(tmp_path / "good"))
    assert code == 0, rep


def test_replay_lists_entries_missing_everywhere(finished_run, r, capsys, tmp_path):
    url, _ = finished_run
    keys = clone_run(r, "rp-miss")
    recs = records(r, keys, 0)
    rows = r.xrange(keys.fragment(0).frags)
    first_round = {x[0] for x in recs[0]["included"]}
    archive_entries(tmp_path / "arch", keys.run, 0,
                    [(i, f) for i, f in rows if i.decode() in first_round])
    r.xdel(keys.fragment(0).frags, *[i for i, _ in rows])
    later = sorted((x[0] for rec in recs[1:] for x in rec["included"]),
                   key=lambda i: tuple(map(int, i.split("-"))))
    code, rep = replay_json(capsys, url, keys.run, "--archive", str(tmp_path / "arch"))
    assert code == 2 and rep["status"] == "incomplete" and rep["error"] is None
    f0, f1 = rep["fragments"]
    assert f1["verified"]
    assert not f0["verified"] and f0["divergence"] is None
    assert f0["missing_entries"] == later and f0["rounds_checked"] == 1
    code, rep = replay_json(capsys, url, keys.run)  # without the archive: every entry missing
    assert code == 2
    assert len(rep["fragments"][0]["missing_entries"]) == len(later) + len(first_round)
    capsys.readouterr()
    assert diloco("replay", "--redis-url", url, "--run", keys.run) == 2
    assert "neither in Redis nor in the archive" in capsys.readouterr().out


def test_replay_flags_altered_or_missing_round_records(finished_run, r, capsys):
    url, _ = finished_run
    keys = clone_run(r, "rp-rec")
    fk = keys.fragment(0)
    recs = r.xrange(fk.rounds)
    r.delete(fk.rounds)
    for rid, fields in recs:  # same records, the last one claims another hash
        r.xadd(fk.rounds, {**fields, b"hash": b"0" * 64} if rid == recs[-1][0] else fields,
               id=rid)
    code, rep = replay_json(capsys, url, keys.run, "--fragment", "0")
    d = rep["fragments"][0]["divergence"]
    assert code == 1 and d["kind"] == "hash" and d["recorded_hash"] == "0" * 64
    assert d["version"] == int(recs[-1][1][b"version"])
    r.delete(fk.rounds)
    r.xadd(fk.rounds, recs[0][1], id=recs[0][0])  # the later records are lost
    code, rep = replay_json(capsys, url, keys.run, "--fragment", "0")
    f = rep["fragments"][0]
    assert code == 2 and f["divergence"] is None and f["rounds_checked"] == 1
    assert "round records are missing" in f["error"]


_SYNCER_ARCHIVES = "archive_dir" in {f.name for f in dataclasses.fields(cfgmod.BrokerConfig)}


@pytest.mark.skipif(not _SYNCER_ARCHIVES, reason="the syncer has no broker.archive_dir yet")
def test_syncer_archives_before_trimming_and_replay_reads_both(redis_url, tmp_path, capsys):
    """A run that trims its streams (keep_rounds 2; a checkpoint every 2 rounds, so the rounds
    since it are few) replays from Redis + the syncer's archive."""
    config = {**CONFIG, "steps": 24,
              "sync": {"fragments": 2, "sync_every": 4, "quorum": 2, "strict": True},
              "broker": {"keep_rounds": 2, "checkpoint_rounds": 2,
                         "archive_dir": str(tmp_path / "archive")}}
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(cfgmod.dumps_toml(cfgmod.from_dict(config)))
    out = subprocess.run(
        [sys.executable, "-m", "ops.cli", "run", "--config", str(cfg_path), "--redis-url",
         redis_url, "--run", "trim", "--out", str(tmp_path / "runs"), "--json", "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    code, rep = replay_json(capsys, redis_url, "trim")
    assert code == 2 and any(f["missing_entries"] for f in rep["fragments"])  # trimmed
    code, rep = replay_json(capsys, redis_url, "trim", "--archive", str(tmp_path / "archive"))
    assert code == 0, rep
    assert sum(f["entries_from"]["archive"] for f in rep["fragments"]) > 0
    assert all(f["rounds_checked"] == f["rounds"] > 2 for f in rep["fragments"])


# ------------------------------------------------------------------------------- archive files


def test_archive_files_are_atomic_merged_and_checked(tmp_path):
    rows = [(b"5-1", {b"a": b"\x00\x01", b"payload": b"x" * 10}), ("5-0", {b"a": b"2"})]
    path = archive_entries(tmp_path, "run.1", 3, rows)
    assert path == tmp_path / "run.1" / "f0003" / "5-0_5-1.msgpack"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    assert archive_entries(tmp_path, "run.1", 3, []) is None
    archive_entries(tmp_path, "run.1", 3, rows[:1])  # archived twice: harmless
    archive_entries(tmp_path, "run.1", 3, [("7-0", {"learner": "L0", "step": 3})])
    got = load_archive(tmp_path, "run.1", 3)
    assert got == {"5-1": rows[0][1], "5-0": rows[1][1],
                   "7-0": {b"learner": b"L0", b"step": b"3"}}
    assert load_archive(tmp_path, "run.1", 4) == {} == load_archive(tmp_path / "x", "r", 0)
    archive_entries(tmp_path, "run.1", 3, [("5-0", {b"a": b"other"})])
    with pytest.raises(ArchiveError, match="differs"):
        load_archive(tmp_path, "run.1", 3)
    (archive.fragment_dir(tmp_path, "r2", 0)).mkdir(parents=True)
    (archive.fragment_dir(tmp_path, "r2", 0) / "1-0_1-0.msgpack").write_bytes(b"\xc1garbage")
    with pytest.raises(ArchiveError):
        load_archive(tmp_path, "r2", 0)
    moved = archive.fragment_dir(tmp_path, "r3", 1)
    moved.mkdir(parents=True)
    shutil.copy(path, moved / path.name)  # a file of another run/fragment
    with pytest.raises(ArchiveError, match="holds run"):
        load_archive(tmp_path, "r3", 1)
    for bad in ("../x", "a/b", "..", ""):
        with pytest.raises(ValueError):
            archive_entries(tmp_path, bad, 0, rows)
    with pytest.raises(ValueError, match="entry id"):
        archive_entries(tmp_path, "r", 0, [("nope", {})])
