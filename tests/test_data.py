"""Data sources and splits: stdlib text, user text folders, JSONL, uint16/uint32 token files,
the byte cache, and splits that are views (nothing concatenated, nothing read whole)."""

from __future__ import annotations

import json
import logging
import os
import sys

import numpy as np
import pytest

from pipeline import config as cfgmod
from pipeline import data as data_mod
from pipeline.config import DataConfig
from pipeline.data import load_tokens, make_corpus, run_corpus


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test builds its caches in its own folder."""
    folder = tmp_path / "cache"
    monkeypatch.setattr(data_mod, "_cache_root", folder)
    return folder


def test_stdlib_corpus_is_real_text():
    toks = load_tokens(DataConfig(max_bytes=200_000))
    assert toks.dtype == np.uint8 and len(toks) == 200_000
    assert isinstance(toks, np.memmap)
    assert b"def " in toks.tobytes()


def test_text_folder_and_token_file(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello world\n" * 500)
    (tmp_path / "docs" / "b.md").write_text("# title\n" * 500)
    (tmp_path / "docs" / "skip.bin.gz").write_bytes(b"\x00" * 100)
    toks = load_tokens(DataConfig(source=str(tmp_path / "docs")))
    assert toks.tobytes() == b"hello world\n" * 500 + b"\n" + b"# title\n" * 500
    capped = load_tokens(DataConfig(source=str(tmp_path / "docs"), max_bytes=10_000))
    assert capped.tobytes() == toks.tobytes()[:10_000]
    ids = np.arange(5000, dtype="<u2") % 300
    ids.tofile(tmp_path / "tokens.bin")
    got = load_tokens(DataConfig(source=str(tmp_path / "tokens.bin")))
    assert isinstance(got, np.memmap) and got.dtype == np.uint16
    np.testing.assert_array_equal(got, ids)
    with pytest.raises(FileNotFoundError, match="data.source"):
        load_tokens(DataConfig(source=str(tmp_path / "missing")))


def test_u32_token_file_round_trip_and_cap(tmp_path):
    ids = (np.arange(20_000, dtype=np.uint64) * 7919 % 150_000).astype("<u4")  # > 65535 too
    ids.tofile(tmp_path / "tokens.u32")
    got = load_tokens(DataConfig(source=str(tmp_path / "tokens.u32")))
    assert isinstance(got, np.memmap) and got.dtype == np.uint32 and not got.flags.writeable
    np.testing.assert_array_equal(got, ids)
    # an explicit format reads any name; max_bytes caps bytes, so max_bytes // 4 tokens
    os.replace(tmp_path / "tokens.u32", tmp_path / "tokens.dat")
    got = load_tokens(DataConfig(source=str(tmp_path / "tokens.dat"), format="u32",
                                 max_bytes=10_002))
    np.testing.assert_array_equal(got, ids[:2500])
    c = make_corpus(got, learners=2, seq_len=15, eval_fraction=0.05, seed=0)
    assert c.batch(0, 0, 4).max() > 65535


def test_token_file_of_odd_size_is_refused(tmp_path):
    (tmp_path / "odd.u16").write_bytes(b"\x01" * 10_001)
    with pytest.raises(ValueError, match=r"data.source.*odd.u16.*10001 bytes"):
        load_tokens(DataConfig(source=str(tmp_path / "odd.u16")))
    (tmp_path / "six.bin").write_bytes(b"\x01" * 10_002)
    assert len(load_tokens(DataConfig(source=str(tmp_path / "six.bin")))) == 5001
    with pytest.raises(ValueError, match="data.source"):
        load_tokens(DataConfig(source=str(tmp_path / "six.bin"), format="u32"))


def test_jsonl_custom_field_skips_blank_and_bad_lines(tmp_path, caplog):
    docs = ["first document", "zweites Dokument — ü", "third\nwith a newline"]
    lines = [
        json.dumps({"body": docs[0], "id": 1}),
        "",
        "   ",
        "SECRET not json",                        # bad: line 4
        json.dumps({"text": "SECRET wrong field"}),  # bad
        json.dumps({"body": docs[1]}, ensure_ascii=False),
        json.dumps(["SECRET", "a list"]),          # bad
        json.dumps({"body": 42}),                  # bad
        json.dumps({"body": docs[2]}),
    ]
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="diloco.data"):
        toks = load_tokens(DataConfig(source=str(path), text_field="body"))
    assert toks.dtype == np.uint8 and isinstance(toks, np.memmap)
    assert toks.tobytes() == "\n".join(docs).encode("utf-8")
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "4 line(s)" in msg and "line 4" in msg and "SECRET" not in msg
    # max_bytes stops the stream
    path.write_text("\n".join(json.dumps({"text": "x" * 1000}) for _ in range(100)))
    assert len(load_tokens(DataConfig(source=str(path), max_bytes=10_000))) == 10_000
    path.write_text("\n" + json.dumps({"body": "no text field"}) + "\n")
    with pytest.raises(ValueError, match=r"data.source.*no documents"):
        load_tokens(DataConfig(source=str(path)))


def test_cache_is_reused_and_rebuilt_when_the_input_changes(tmp_path, cache):
    src = tmp_path / "book.txt"
    src.write_text("version one\n" * 2000)
    first = load_tokens(DataConfig(source=str(src)))
    (built,) = cache.iterdir()
    stamp = built.stat().st_mtime_ns
    again = load_tokens(DataConfig(source=str(src)))
    assert [p.name for p in cache.iterdir()] == [built.name]
    assert built.stat().st_mtime_ns == stamp  # read, not rewritten
    np.testing.assert_array_equal(first, again)
    src.write_text("version two, longer\n" * 2000)
    changed = load_tokens(DataConfig(source=str(src)))
    assert changed.tobytes() == b"version two, longer\n" * 2000
    assert len(list(cache.iterdir())) == 2  # a new cache; no temporary file left behind
    assert built.stat().st_mtime_ns == stamp
    # a different cap or field is a different cache
    load_tokens(DataConfig(source=str(src), max_bytes=20_000))
    assert len(list(cache.iterdir())) == 3


def test_unwritable_cache_falls_back_to_memory(tmp_path, monkeypatch, caplog):
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setattr(data_mod, "_cache_root", tmp_path / "a-file" / "cache")
    src = tmp_path / "book.txt"
    src.write_text("some text\n" * 2000)
    with caplog.at_level(logging.WARNING, logger="diloco.data"):
        toks = load_tokens(DataConfig(source=str(src)))
    assert toks.tobytes() == b"some text\n" * 2000
    assert "in memory" in caplog.text


def test_run_corpus_is_deterministic_across_builds(tmp_path):
    path = tmp_path / "docs.jsonl"
    with open(path, "w") as f:
        for i in range(3000):
            f.write(json.dumps({"text": f"document {i}: " + "lorem ipsum " * (i % 17)}) + "\n")
    cfg = cfgmod.from_dict({"model": {"seq_len": 32}, "learners": 3,
                            "data": {"source": str(path), "max_bytes": 150_000}})
    a, b = run_corpus(cfg), run_corpus(cfg)  # the first builds the cache, the second reads it
    assert a.shards == b.shards and len(a.train) == len(b.train)
    for learner in range(3):
        for step in (0, 5, 99):
            np.testing.assert_array_equal(a.batch(learner, step, 8), b.batch(learner, step, 8))
    np.testing.assert_array_equal(a.eval_batches(4, 8), b.eval_batches(4, 8))


def _old_corpus(tokens, learners, seq_len, eval_fraction, seed):
    """The concatenating implementation the views replaced: (train, eval, shards, batch,
    eval_batches) computed the old way, for comparison."""
    w = seq_len + 1
    n_eval = max(w, int(len(tokens) * eval_fraction))
    pieces = max(1, min(64, n_eval // w))
    block = len(tokens) // pieces
    take = max(1, (n_eval // pieces) // w) * w
    keep, ev = [], []
    for i in range(pieces):
        lo = i * block
        hi = len(tokens) if i == pieces - 1 else lo + block
        keep.append(tokens[lo:hi - take])
        ev.append(tokens[hi - take:hi])
    train, ev = np.concatenate(keep), np.concatenate(ev)
    per = len(train) // learners
    shards = tuple((m * per, (m + 1) * per) for m in range(learners))

    def batch(learner, step, batch_size):
        start, end = shards[learner]
        rng = np.random.default_rng([seed, learner, step])
        offs = start + rng.integers(0, end - start - seq_len - 1, size=batch_size)
        idx = offs[:, None] + np.arange(seq_len + 1)[None, :]
        return train[idx].astype(np.int32)

    def eval_batches(n, batch_size):
        total = len(ev) // w
        count = min(n * batch_size, total)
        pick = np.linspace(0, total - 1, count).round().astype(np.int64)
        windows = ev[: total * w].reshape(total, w)[pick].astype(np.int32)
        nb = max(1, count // batch_size)
        return windows[: nb * batch_size].reshape(nb, batch_size, w)

    return train, ev, shards, batch, eval_batches


@pytest.mark.parametrize("n,learners,seq_len,frac,dtype", [
    (50_000, 4, 31, 0.02, np.uint8), (123_457, 3, 64, 0.05, np.uint16),
    (30_011, 1, 16, 0.3, np.uint32), (200_003, 8, 127, 0.01, np.uint16),
    (9_001, 2, 7, 0.001, np.uint8),
])
def test_views_match_the_old_concatenating_corpus(tmp_path, n, learners, seq_len, frac, dtype):
    rng = np.random.default_rng(n)
    toks = rng.integers(0, np.iinfo(dtype).max, size=n, endpoint=True).astype(dtype)
    train, ev, shards, batch, eval_batches = _old_corpus(toks, learners, seq_len, frac, 5)
    toks.tofile(tmp_path / "t.bin")
    mapped = np.memmap(tmp_path / "t.bin", dtype=dtype, mode="r")
    for source in (toks, mapped):
        c = make_corpus(source, learners, seq_len, frac, seed=5)
        assert c.shards == shards and len(c.train) == len(train) and len(c.eval) == len(ev)
        np.testing.assert_array_equal(np.asarray(c.train), train)
        np.testing.assert_array_equal(np.asarray(c.eval), ev)
        np.testing.assert_array_equal(c.train[1000:len(train) - 7], train[1000:-7])
        idx = rng.integers(0, len(train), size=(3, 50))
        np.testing.assert_array_equal(c.train[idx], train[idx])
        assert c.eval[-1] == ev[-1] and c.train[12345 % len(train)] == train[12345 % len(train)]
        for learner in range(learners):
            for step in (0, 1, 17, 10_000):
                got = c.batch(learner, step, 16)
                assert got.dtype == np.int32 and got.shape == (16, seq_len + 1)
                np.testing.assert_array_equal(got, batch(learner, step, 16))
        for nb, bs in ((1, 8), (4, 8), (3, 5), (1000, 16)):
            try:
                want = eval_batches(nb, bs)
            except ValueError:  # fewer held-out windows than one batch: both refuse
                with pytest.raises(ValueError):
                    c.eval_batches(nb, bs)
                continue
            np.testing.assert_array_equal(c.eval_batches(nb, bs), want)


def test_shards_are_disjoint_and_batches_deterministic():
    toks = load_tokens(DataConfig(max_bytes=100_000))
    c = make_corpus(toks, learners=4, seq_len=32, eval_fraction=0.05, seed=3)
    assert len(c.eval) + len(c.train) == 100_000 and 4000 <= len(c.eval) <= 5000
    spans = sorted(c.shards)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    b1, b2 = c.batch(1, 7, 8), c.batch(1, 7, 8)
    np.testing.assert_array_equal(b1, b2)
    assert b1.shape == (8, 33)
    assert not np.array_equal(c.batch(1, 8, 8), b1)
    # every window of learner 1 lies inside its own shard
    start, end = c.shards[1]
    train = np.asarray(c.train)
    for row in b1:
        hits = [i for i in range(start, end - 32) if np.array_equal(train[i:i + 33], row)]
        assert hits
    ev = c.eval_batches(3, 8)
    assert ev.shape == (3, 8, 33)
    np.testing.assert_array_equal(ev, c.eval_batches(3, 8))


def test_eval_split_spans_the_corpus_and_is_held_out():
    """The held-out windows come from evenly spaced places along the whole corpus (a corpus
    of files sorted by name is not uniform), never from training data, and the evaluation
    batches sample all of them."""
    n = 200_000
    toks = np.arange(n, dtype=np.int64)  # every token names its position
    c = make_corpus(toks, learners=4, seq_len=31, eval_fraction=0.02, seed=0)
    assert set(np.asarray(c.eval).tolist()).isdisjoint(np.asarray(c.train).tolist())
    assert len(c.eval) + len(c.train) == n
    assert len(c.eval) % 32 == 0  # whole windows: none straddles two places
    held = np.sort(c.eval)
    assert held[0] < n // 32 and held[-1] == n - 1  # from the start to the end
    assert np.diff(held).max() <= n // 64 + 32  # no stretch of the corpus left out
    ev = c.eval_batches(4, 8)
    firsts = ev[:, :, 0].ravel()
    assert firsts.min() < n // 8 and firsts.max() > n - n // 8
    assert all(np.array_equal(r, np.arange(r[0], r[0] + 32)) for r in ev.reshape(-1, 32))
    # a learner's batch reads its own shard only
    for learner, (start, end) in enumerate(c.shards):
        pos = c.train.positions(np.arange(start, end))
        assert set(c.batch(learner, 3, 16).ravel().tolist()) <= set(pos.tolist())
    with pytest.raises(ValueError, match="too few"):
        make_corpus(np.arange(100), learners=2, seq_len=31, eval_fraction=0.9, seed=0)


def _rss_kb() -> tuple[int, int]:
    """(current, peak) resident set size of this process in kB."""
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return int(status["VmRSS"].split()[0]), int(status["VmHWM"].split()[0])


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_large_corpora_are_streamed_not_read_whole(tmp_path):
    n = 50_000_000  # 100 MB of uint16 tokens, written sparse
    path = tmp_path / "big.u16"
    mm = np.memmap(path, dtype="<u2", mode="w+", shape=(n,))
    mm[:: 1_000_003] = np.arange(len(mm[:: 1_000_003]), dtype="<u2") + 1
    mm.flush()
    del mm
    text = tmp_path / "big.txt"
    with open(text, "wb") as f:  # 48 MB of text (zero bytes), sparse
        f.truncate(48 << 20)
    budget_kb = 30 << 10

    def grows(fn):
        reset = _reset_peak()
        before, _ = _rss_kb()
        out = fn()
        now, peak = _rss_kb()
        return out, (peak if reset else now) - before

    def token_corpus():
        toks = load_tokens(DataConfig(source=str(path), max_bytes=10**12))
        assert isinstance(toks, np.memmap) and len(toks) == n
        c = make_corpus(toks, learners=4, seq_len=1023, eval_fraction=0.02, seed=0)
        return c, c.batch(3, 0, 16), c.eval_batches(2, 8)

    (c, b, ev), grew = grows(token_corpus)
    assert b.shape == (16, 1024) and ev.shape == (2, 8, 1024)
    assert grew < budget_kb, f"RSS grew by {grew} kB"

    def text_corpus():
        toks = load_tokens(DataConfig(source=str(text), max_bytes=10**12))
        assert isinstance(toks, np.memmap) and len(toks) == 48 << 20
        c = make_corpus(toks, learners=2, seq_len=255, eval_fraction=0.02, seed=0)
        return c.batch(1, 0, 8)

    b, grew = grows(text_corpus)
    assert b.shape == (8, 256) and not b.any()
    assert grew < budget_kb, f"RSS grew by {grew} kB"


@pytest.mark.parametrize("task", ["bytegpt", "llama"])
def test_token_ids_outside_the_vocabulary_are_refused_at_the_start(tmp_path, cache, task):
    """A token file made by another model's tokenizer: before, every id ≥ vocab_size was an
    out-of-range embedding lookup that JAX clamps in silence."""
    from pipeline.task import task_of

    ids = np.arange(40_000, dtype="<u2") % 300  # ids up to 299
    (tmp_path / "tok.u16").write_bytes(ids.tobytes())
    over = {"data.source": str(tmp_path / "tok.u16"), "task": task, "learners": 2,
            "model.d_model": 32, "model.n_heads": 2, "model.n_layers": 1, "model.seq_len": 32}
    cfg = cfgmod.override(cfgmod.RunConfig(), **over)
    with pytest.raises(ValueError, match=r"tok.u16 holds token id 299, outside the model's "
                                         r"vocabulary of 256 \(model.vocab_size\)"):
        task_of(cfg, local=cfg.task).data()
    assert list(cache.glob("largest-token-*"))  # remembered: a restart does not scan again
    ok = cfgmod.override(cfg, **{"model.vocab_size": 300})
    assert task_of(ok, local=ok.task).data().batch(0, 0, 2).max() <= 299


def test_largest_token_reads_in_pieces_and_remembers(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(data_mod, "_SCAN_BYTES", 4096)
    ids = np.zeros(3 * 2048 + 5, dtype="<u2")
    ids[-1] = 7
    (tmp_path / "big.u16").write_bytes(ids.tobytes())
    toks = load_tokens(DataConfig(source=str(tmp_path / "big.u16"), max_bytes=2**40))
    assert data_mod.largest_token(toks) == 7
    (memo,) = cache.glob("largest-token-*")
    memo.write_text("9")  # read back, not rescanned
    assert data_mod.largest_token(toks) == 9
    assert data_mod.largest_token(np.frombuffer(b"\x00\xff", np.uint8)) == 255
