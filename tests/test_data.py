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
    assert len(c.eval) == 5000 and len(c.train) == 95_000
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
