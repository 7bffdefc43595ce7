"""A run recorded by an earlier version of the project still replays bit for bit.

`fixtures/legacy_run/` holds a small distributed run (2 learners, 2 fragments, 80 steps,
``keep_rounds = 2`` so the oldest merged entries went to the archive) recorded with the code of
commit 2107ba1, before the key names became final: ``run.msgpack`` is every Redis key of the
run (name, type, content as XRANGE/HGETALL/GET returned it), ``archive/`` the syncer's archive
and ``run.toml`` the configuration it ran with. The test restores the keys' contents under
today's key names (the stored formats — configuration, stream entries, round records, syncer
state, snapshots, archive files — are what must stay readable) and replays every round.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import msgpack
import pytest
import redis

from broker import registry
from broker.errors import BrokerError
from broker.keys import RunKeys
from ops.cli import main
from ops.tools import replay as replay_mod
from pipeline import config as cfgmod

FIXTURE = Path(__file__).parent / "fixtures" / "legacy_run"
RUN = "legacy"
_RUN_WIDE = re.compile(rb"ddl:legacy:(config|learners|syncers|events|done)")
_FRAGMENT = re.compile(rb"ddl:\{legacy/f(\d{4})\}:(frags|state|global|rounds|dlq|lease|sent:\d+)")


def current_key(keys: RunKeys, old: bytes) -> str:
    """Today's name of a key that the recorded run stored under `old`."""
    if m := _RUN_WIDE.fullmatch(old):
        return getattr(keys, m.group(1).decode())
    m = _FRAGMENT.fullmatch(old)
    assert m, f"unexpected key in the fixture: {old!r}"
    fk, role = keys.fragment(int(m.group(1))), m.group(2).decode()
    if role.startswith("sent:"):
        return fk.sent(int(role.split(":")[1]))
    return fk.global_ if role == "global" else getattr(fk, role)


def restore(r: redis.Redis, dump: dict, *, rename: bool = True) -> None:
    """Write the dumped keys: under today's names, or (``rename=False``) as recorded."""
    keys = RunKeys(RUN)
    for old, kind, content in dump["keys"]:
        key, kind = current_key(keys, old) if rename else old, kind.decode()
        if kind == "string":
            r.set(key, content)
        elif kind == "hash":
            r.hset(key, mapping=dict(content))
        else:
            assert kind == "stream"
            for entry_id, fields in content:
                r.xadd(key, dict(fields), id=entry_id)


def load_dump() -> dict:
    dump = msgpack.unpackb((FIXTURE / "run.msgpack").read_bytes(), raw=True,
                           strict_map_key=False)
    return {k.decode(): v for k, v in dump.items()}


@pytest.fixture
def legacy_url(redis_url):
    r = redis.Redis.from_url(redis_url)
    try:
        restore(r, load_dump())
    finally:
        r.close()
    return redis_url


def test_recorded_run_replays_bit_for_bit(legacy_url, tmp_path):
    archive = tmp_path / "archive"
    shutil.copytree(FIXTURE / "archive", archive)
    report = replay_mod.replay(legacy_url, RUN, archive_dir=archive)
    assert report["status"] == "verified", report
    assert report["rounds_checked"] == 8
    for frag in report["fragments"]:
        assert frag["entries_from"]["archive"] >= 1  # the oldest round needs the archive
        assert frag["state_checked"]


def test_recorded_run_without_its_archive_is_incomplete(legacy_url):
    report = replay_mod.replay(legacy_url, RUN)
    assert report["status"] == "incomplete"
    assert all(f["missing_entries"] for f in report["fragments"])


def test_a_run_under_the_old_key_names_is_refused(redis_url, capsys):
    r = redis.Redis.from_url(redis_url)
    try:
        restore(r, load_dump(), rename=False)
        report = replay_mod.replay(redis_url, RUN)
        assert report["status"] == "incomplete"
        assert "stored by an earlier version" in report["error"]
        assert main(["status", "--redis-url", redis_url, "--run", RUN]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "stored by an earlier version" in err[0]
        # nor is a new run started over it under the same name
        cfg = cfgmod.load(FIXTURE / "run.toml")
        with pytest.raises(BrokerError, match="earlier version"):
            registry.store_config(r, RunKeys(RUN), cfgmod.dumps_toml(cfg), cfg.run_hash())
    finally:
        r.close()
