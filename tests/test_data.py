"""Data sources and splits: stdlib text, user text folders, uint16 token files."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.config import DataConfig
from pipeline.data import load_tokens, make_corpus


def test_stdlib_corpus_is_real_text():
    toks = load_tokens(DataConfig(max_bytes=200_000))
    assert toks.dtype == np.uint8 and len(toks) == 200_000
    assert b"def " in toks.tobytes()


def test_text_folder_and_token_file(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello world\n" * 500)
    (tmp_path / "docs" / "b.md").write_text("# title\n" * 500)
    (tmp_path / "docs" / "skip.bin.gz").write_bytes(b"\x00" * 100)
    toks = load_tokens(DataConfig(source=str(tmp_path / "docs")))
    assert toks.tobytes().startswith(b"hello world")
    assert b"# title" in toks.tobytes() and b"\x00" not in toks.tobytes()
    ids = np.arange(5000, dtype="<u2") % 300
    ids.tofile(tmp_path / "tokens.bin")
    got = load_tokens(DataConfig(source=str(tmp_path / "tokens.bin")))
    np.testing.assert_array_equal(got, ids)
    with pytest.raises(FileNotFoundError, match="data.source"):
        load_tokens(DataConfig(source=str(tmp_path / "missing")))


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
    train = c.train
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
    assert set(c.eval.tolist()).isdisjoint(c.train.tolist())
    assert len(c.eval) + len(c.train) == n
    assert len(c.eval) % 32 == 0  # whole windows: none straddles two places
    held = np.sort(c.eval)
    assert held[0] < n // 32 and held[-1] == n - 1  # from the start to the end
    assert np.diff(held).max() <= n // 64 + 32  # no stretch of the corpus left out
    ev = c.eval_batches(4, 8)
    firsts = ev[:, :, 0].ravel()
    assert firsts.min() < n // 8 and firsts.max() > n - n // 8
    assert all(np.array_equal(r, np.arange(r[0], r[0] + 32)) for r in ev.reshape(-1, 32))
    with pytest.raises(ValueError, match="too few"):
        make_corpus(np.arange(100), learners=2, seq_len=31, eval_fraction=0.9, seed=0)
