"""Training data: a byte corpus, disjoint per-learner shards, a held-out evaluation split.

Sources: ``stdlib`` (the source files of the running interpreter's standard library — real text
present on every machine, nothing downloaded), a user text file or folder of text files, or a
``.bin``/``.u16`` file of little-endian uint16 tokens. Batches are a pure function of
(seed, learner, step), so every run, engine and process sees the same data.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.config import DataConfig, RunConfig

_TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".toml", ".cfg", ".json", ".html", ".c", ".h"}


def _text_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    files = [p for p in root.rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES
             and "site-packages" not in p.parts and "__pycache__" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_tokens(cfg: DataConfig) -> np.ndarray:
    """The whole corpus as a 1-D token array (uint8 for text, uint16 for token files)."""
    if cfg.source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [p for p in _text_files(root) if p.suffix == ".py" and "test" not in p.parts]
    else:
        root = Path(cfg.source).expanduser()
        if not root.exists():
            raise FileNotFoundError(f"data.source: {cfg.source} does not exist")
        if root.is_file() and root.suffix in (".bin", ".u16"):
            toks = np.fromfile(root, dtype="<u2")
            return toks[: cfg.max_bytes // 2]
        files = _text_files(root)
    chunks, total = [], 0
    for p in files:
        b = p.read_bytes()
        chunks.append(b)
        total += len(b)
        if total >= cfg.max_bytes:
            break
    if not chunks:
        raise ValueError(f"data.source: no text files found under {cfg.source}")
    data = np.frombuffer(b"\n".join(chunks)[: cfg.max_bytes], dtype=np.uint8)
    return data


@dataclass(frozen=True)
class Corpus:
    """Train shards (one per learner, disjoint, contiguous) and an evaluation split."""

    train: np.ndarray
    eval: np.ndarray
    shards: tuple[tuple[int, int], ...]  # [start, end) into train, per learner
    seq_len: int
    seed: int

    def batch(self, learner: int, step: int, batch_size: int) -> np.ndarray:
        """The ``[batch_size, seq_len+1]`` int32 window batch of `learner` at inner `step`."""
        start, end = self.shards[learner]
        rng = np.random.default_rng([self.seed, learner, step])
        offs = start + rng.integers(0, end - start - self.seq_len - 1, size=batch_size)
        idx = offs[:, None] + np.arange(self.seq_len + 1)[None, :]
        return self.train[idx].astype(np.int32)

    def eval_batches(self, n: int, batch_size: int) -> np.ndarray:
        """``n`` fixed, non-overlapping evaluation batches ``[n, batch_size, seq_len+1]``,
        windows evenly spaced over the evaluation split."""
        w = self.seq_len + 1
        total = len(self.eval) // w
        count = min(n * batch_size, total)
        if count == 0:
            raise ValueError("evaluation split is shorter than one sequence; raise "
                             "data.eval_fraction or data.max_bytes")
        # evenly spaced over the whole split (which spans the corpus), not its first windows
        pick = np.linspace(0, total - 1, count).round().astype(np.int64)
        windows = self.eval[: total * w].reshape(total, w)[pick].astype(np.int32)
        nb = max(1, count // batch_size)
        return windows[: nb * batch_size].reshape(nb, batch_size, w)


EVAL_PIECES = 64  # the evaluation split is drawn from this many places along the corpus


def make_corpus(tokens: np.ndarray, learners: int, seq_len: int, eval_fraction: float,
                seed: int) -> Corpus:
    """Split `tokens` into an evaluation split and `learners` disjoint training shards.

    The evaluation split is held out from `EVAL_PIECES` evenly spaced places along the corpus
    (the end of each of that many equal blocks, whole windows of seq_len + 1 tokens), so it
    represents the whole corpus; the rest, in order, is cut into contiguous shards, one per
    learner. (A corpus of files sorted by name is far from uniform: a tail-only split would
    measure the part nearest the last learner's shard.)
    """
    w = seq_len + 1
    n_eval = max(w, int(len(tokens) * eval_fraction))
    pieces = max(1, min(EVAL_PIECES, n_eval // w))
    block = len(tokens) // pieces
    take = max(1, (n_eval // pieces) // w) * w  # tokens held out per block, whole windows
    if take >= block:
        raise ValueError(f"data: {len(tokens)} tokens are too few to hold out "
                         f"eval_fraction {eval_fraction}; raise data.max_bytes")
    keep, ev = [], []
    for i in range(pieces):
        lo = i * block
        hi = len(tokens) if i == pieces - 1 else lo + block
        keep.append(tokens[lo:hi - take])
        ev.append(tokens[hi - take:hi])
    train, ev = np.concatenate(keep), np.concatenate(ev)
    per = len(train) // learners
    if per < 2 * w:
        raise ValueError(f"data: {len(train)} training tokens are too few for {learners} "
                         f"learners at seq_len {seq_len}; raise data.max_bytes")
    shards = tuple((m * per, (m + 1) * per) for m in range(learners))
    return Corpus(train=train, eval=ev, shards=shards, seq_len=seq_len, seed=seed)


def run_corpus(cfg: RunConfig) -> Corpus:
    """The corpus of a run: its tokens split for its learners (what every process of the run
    builds, so the shards and the evaluation split agree everywhere)."""
    return make_corpus(load_tokens(cfg.data), cfg.learners, cfg.model.seq_len,
                       cfg.data.eval_fraction, cfg.seed)
