"""Training data: a token corpus, disjoint per-learner shards, a held-out evaluation split.

Sources (``data.format``; ``auto`` picks by the suffix of ``data.source``):

* ``u16`` (``.bin``/``.u16``) and ``u32`` (``.u32``): a file of little-endian token ids of any
  tokenizer, memory-mapped read-only (never read whole) and capped at ``max_bytes`` bytes.
* ``text`` (anything else): ``stdlib`` (the source files of the running interpreter's standard
  library — real text present on every machine, nothing downloaded), or a user text file or
  folder of text files; bytes are the tokens, files joined by ``b"\\n"``.
* ``jsonl`` (``.jsonl``): one JSON object per line, its ``text_field`` string the document;
  documents joined by ``b"\\n"``, their UTF-8 bytes the tokens. Blank lines are skipped; lines
  that are not an object with a string ``text_field`` are skipped and counted.

Text and JSONL are streamed once into a byte cache file (``$DILOCO_DATA_CACHE``, default
``~/.cache/diloco/data``, named by a hash of the inputs' paths, sizes and mtimes) and then
memory-mapped, so no corpus is ever held whole in memory. The splits are views: a batch
gathers only its own windows from the mapped file. Batches are a pure function of
(seed, learner, step), so every run, engine and process sees the same data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.config import DataConfig, RunConfig

log = logging.getLogger("diloco.data")

_TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".toml", ".cfg", ".json", ".html", ".c", ".h"}
_TOKEN_DTYPES = {"u16": np.dtype("<u2"), "u32": np.dtype("<u4")}
_AUTO_FORMATS = {".jsonl": "jsonl", ".bin": "u16", ".u16": "u16", ".u32": "u32"}
CACHE_ENV = "DILOCO_DATA_CACHE"
_CACHE_VERSION = 1  # bump when the bytes a cache holds for the same inputs change
_READ_CHUNK = 1 << 20


_SKIP_DIRS = ("site-packages", "__pycache__")


def _text_files(root: Path) -> list[Path]:
    """The text files under `root` (not inside site-packages or __pycache__, symbolic links to
    folders not followed), in the order of their relative paths. Those folders are not walked
    at all: a stdlib tree's site-packages can hold tens of thousands of files, and every
    process that loads the corpus lists the tree to check its cache."""
    if root.is_file():
        return [root]
    files = []
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        if any(part in _SKIP_DIRS for part in here.parts):
            dirs.clear()
            continue
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        files.extend(here / n for n in names
                     if os.path.splitext(n)[1] in _TEXT_SUFFIXES and (here / n).is_file())
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def data_format(cfg: DataConfig) -> str:
    """The format `cfg.source` is read as: ``cfg.format``, or by suffix when it is ``auto``."""
    if cfg.format != "auto":
        return cfg.format
    if cfg.source == "stdlib":
        return "text"
    return _AUTO_FORMATS.get(Path(cfg.source).suffix.lower(), "text")


_cache_root: Path | None = None


def set_cache_dir(path: str | Path | None) -> None:
    """Cache text and JSONL corpora under `path` (None: the default). The processes call it
    with ``$DILOCO_DATA_CACHE`` (`workers.common.apply_environment`); pipeline/ reads no
    environment itself."""
    global _cache_root
    _cache_root = Path(path).expanduser() if path else None


def cache_dir() -> Path:
    """Where text and JSONL corpora are cached as bytes: the folder `set_cache_dir` chose, or
    ``~/.cache/diloco/data``."""
    return _cache_root or Path.home() / ".cache" / "diloco" / "data"


def load_tokens(cfg: DataConfig) -> np.ndarray:
    """The corpus as a 1-D token array, memory-mapped where it can be (uint8 for text and
    JSONL, uint16 / uint32 for token files); at most ``cfg.max_bytes`` bytes of tokens."""
    fmt = data_format(cfg)
    if cfg.source == "stdlib":
        if fmt != "text":
            raise ValueError(f"data.source: stdlib is text, not data.format {fmt!r}")
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [p for p in _text_files(root) if p.suffix == ".py" and "test" not in p.parts]
    else:
        root = Path(cfg.source).expanduser()
        if not root.exists():
            raise FileNotFoundError(f"data.source: {cfg.source} does not exist")
        if fmt in _TOKEN_DTYPES:
            return _token_file(root, cfg, _TOKEN_DTYPES[fmt])
        if fmt == "jsonl":
            if not root.is_file():
                raise ValueError(f"data.source: {cfg.source} is not a file (data.format jsonl)")
            files = [root]
        else:
            files = _text_files(root)
    if not files:
        raise ValueError(f"data.source: no text files found under {cfg.source}")
    if fmt == "jsonl":
        def chunks() -> Iterator[bytes]:
            return _jsonl_chunks(files[0], cfg)
    else:
        def chunks() -> Iterator[bytes]:
            return _text_chunks(files, cfg)
    return _cached(_cache_key(fmt, root, files, cfg), chunks, cfg.source)


def _token_file(path: Path, cfg: DataConfig, dtype: np.dtype) -> np.ndarray:
    if not path.is_file():
        raise ValueError(f"data.source: {cfg.source} is not a file of tokens")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(f"data.source: {cfg.source} is {size} bytes, not a whole number of "
                         f"{dtype.itemsize}-byte tokens (is data.format right?)")
    count = min(size, cfg.max_bytes) // dtype.itemsize
    if count == 0:
        raise ValueError(f"data.source: {cfg.source} holds no tokens")
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def _capped(parts: Iterator[bytes], limit: int) -> Iterator[bytes]:
    """`parts` cut off after `limit` bytes in all."""
    left = limit
    for part in parts:
        if len(part) >= left:
            if left:
                yield part[:left]
            return
        if part:
            yield part
            left -= len(part)


def _text_chunks(files: list[Path], cfg: DataConfig) -> Iterator[bytes]:
    def parts() -> Iterator[bytes]:
        for i, p in enumerate(files):
            if i:
                yield b"\n"
            with open(p, "rb") as f:
                while chunk := f.read(_READ_CHUNK):
                    yield chunk
    return _capped(parts(), cfg.max_bytes)


def _jsonl_chunks(path: Path, cfg: DataConfig) -> Iterator[bytes]:
    stats = {"docs": 0, "bad": 0, "first_bad": 0}

    def parts() -> Iterator[bytes]:
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:  # bad JSON or bad UTF-8
                    obj = None
                doc = obj.get(cfg.text_field) if isinstance(obj, dict) else None
                if not isinstance(doc, str):
                    stats["bad"] += 1
                    stats["first_bad"] = stats["first_bad"] or number
                    continue
                if not doc:
                    continue
                if stats["docs"]:
                    yield b"\n"
                stats["docs"] += 1
                yield doc.encode("utf-8", "replace")  # "replace": lone surrogates

    yield from _capped(parts(), cfg.max_bytes)
    if stats["bad"]:
        log.warning("data.source %s: skipped %d line(s) that are not a JSON object with a "
                    "string %r (first at line %d)", cfg.source, stats["bad"], cfg.text_field,
                    stats["first_bad"])
    if not stats["docs"]:
        raise ValueError(f"data.source: no documents in {cfg.source} (JSON objects with a "
                         f"non-empty string field {cfg.text_field!r}, one per line)")


def _cache_key(fmt: str, root: Path, files: list[Path], cfg: DataConfig) -> str:
    base = root if root.is_dir() else root.parent
    h = hashlib.sha256()
    h.update(json.dumps([_CACHE_VERSION, fmt, str(root.resolve()), cfg.text_field,
                         cfg.max_bytes]).encode())
    for p in files:
        st = p.stat()
        h.update(json.dumps([p.relative_to(base).as_posix(), st.st_size,
                             st.st_mtime_ns]).encode())
    return f"{fmt}-{h.hexdigest()}"


class _CacheError(Exception):
    """Writing the cache failed (not reading the source): build in memory instead."""


def _io(fn, *args):
    try:
        return fn(*args)
    except OSError as e:
        raise _CacheError(e) from e


def _cached(key: str, chunks: Callable[[], Iterator[bytes]], source: str) -> np.ndarray:
    """The bytes `chunks` streams, as a read-only memory map of the cache file `key`
    (built once, atomically), or built in memory when the cache cannot be written."""
    folder = cache_dir()
    path = folder / f"{key}.u8"
    if path.is_file() and path.stat().st_size:
        return np.memmap(path, dtype=np.uint8, mode="r")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key}.", suffix=".tmp")
    except OSError as e:
        return _in_memory(chunks, e, source)
    f = os.fdopen(fd, "wb")
    try:
        size = 0
        for chunk in chunks():  # an error reading the source propagates
            _io(f.write, chunk)
            size += len(chunk)
        if not size:
            raise ValueError(f"data.source: {source} is empty")
        _io(f.flush)
        _io(os.fsync, f.fileno())
        _io(f.close)
        _io(os.chmod, tmp, 0o644)
        _io(os.replace, tmp, path)  # several processes may build it at once: the last wins
    except _CacheError as e:
        _discard(f, tmp)
        if path.is_file() and path.stat().st_size:  # another process built it
            return np.memmap(path, dtype=np.uint8, mode="r")
        return _in_memory(chunks, e.args[0], source)
    except BaseException:
        _discard(f, tmp)
        raise
    return np.memmap(path, dtype=np.uint8, mode="r")


def _discard(f, tmp: str) -> None:
    try:
        f.close()
    except OSError:
        pass
    try:
        os.unlink(tmp)
    except OSError:
        pass


def _in_memory(chunks: Callable[[], Iterator[bytes]], err: OSError, source: str) -> np.ndarray:
    log.warning("data cache %s cannot be written (%s); building the corpus in memory "
                "(set %s to a writable folder)", cache_dir(), err, CACHE_ENV)
    buf = bytearray()
    for chunk in chunks():
        buf += chunk
    if not buf:
        raise ValueError(f"data.source: {source} is empty")
    return np.frombuffer(buf, dtype=np.uint8)


class Split:
    """Pieces of a token array, in order, seen as one sequence without copying them.

    ``len()``, an int, a slice or an integer index array read it like an array; `take`
    gathers positions (any shape) and `positions` maps them to positions in the corpus."""

    def __init__(self, tokens: np.ndarray, starts: list[int], lengths: list[int]):
        self.tokens = tokens
        self._bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        self._shift = np.asarray(starts, dtype=np.int64) - self._bounds[:-1]
        self._pieces = [(int(s), int(n)) for s, n in zip(starts, lengths, strict=True)]

    def __len__(self) -> int:
        return int(self._bounds[-1])

    @property
    def dtype(self) -> np.dtype:
        return self.tokens.dtype

    def positions(self, pos: np.ndarray) -> np.ndarray:
        """Corpus positions of split positions `pos` (0 <= pos < len)."""
        pos = np.asarray(pos, dtype=np.int64)
        piece = np.searchsorted(self._bounds, pos, side="right") - 1
        return pos + self._shift[piece]

    def take(self, pos: np.ndarray) -> np.ndarray:
        """The tokens at split positions `pos` (an ndarray of `pos`'s shape)."""
        pos = np.asarray(pos, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= len(self)):
            raise IndexError(f"split positions out of range [0, {len(self)})")
        return np.asarray(self.tokens[self.positions(pos)])

    def __getitem__(self, key):
        if isinstance(key, slice):
            lo, hi, step = key.indices(len(self))
            if step != 1:
                return self.take(np.arange(lo, hi, step, dtype=np.int64))
            parts = [self.tokens[max(lo, b) - b + s:min(hi, b + n) - b + s]
                     for (s, n), b in zip(self._pieces, self._bounds[:-1].tolist(), strict=True)
                     if max(lo, b) < min(hi, b + n)]
            if not parts:
                return np.empty(0, dtype=self.dtype)
            return np.array(parts[0]) if len(parts) == 1 else np.concatenate(parts)
        if isinstance(key, (int, np.integer)):
            i = int(key) + len(self) if key < 0 else int(key)
            if not 0 <= i < len(self):
                raise IndexError(f"split index {key} out of range")
            return self.tokens[int(self.positions(np.int64(i)))]
        return self.take(key)

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)


@dataclass(frozen=True)
class Corpus:
    """Train shards (one per learner, disjoint, contiguous) and an evaluation split, both
    views of one token array."""

    train: Split
    eval: Split
    shards: tuple[tuple[int, int], ...]  # [start, end) into train, per learner
    seq_len: int
    seed: int

    def batch(self, learner: int, step: int, batch_size: int) -> np.ndarray:
        """The ``[batch_size, seq_len+1]`` int32 window batch of `learner` at inner `step`
        (read from its own shard's windows only)."""
        start, end = self.shards[learner]
        rng = np.random.default_rng([self.seed, learner, step])
        offs = start + rng.integers(0, end - start - self.seq_len - 1, size=batch_size)
        idx = offs[:, None] + np.arange(self.seq_len + 1)[None, :]
        return self.train.take(idx).astype(np.int32)

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
        idx = pick[:, None] * w + np.arange(w)[None, :]
        windows = self.eval.take(idx).astype(np.int32)
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
    measure the part nearest the last learner's shard.) Nothing is copied: both splits are
    views of `tokens` (which may be a memory map) and reads go to the windows a batch needs.
    """
    w = seq_len + 1
    n = len(tokens)
    n_eval = max(w, int(n * eval_fraction))
    pieces = max(1, min(EVAL_PIECES, n_eval // w))
    block = n // pieces
    take = max(1, (n_eval // pieces) // w) * w  # tokens held out per block, whole windows
    if take >= block:
        raise ValueError(f"data: {n} tokens are too few to hold out "
                         f"eval_fraction {eval_fraction}; raise data.max_bytes")
    los = [i * block for i in range(pieces)]
    his = [n if i == pieces - 1 else lo + block for i, lo in enumerate(los)]
    train = Split(tokens, los, [hi - take - lo for lo, hi in zip(los, his, strict=True)])
    ev = Split(tokens, [hi - take for hi in his], [take] * pieces)
    per = len(train) // learners
    if per < 2 * w:
        raise ValueError(f"data: {len(train)} training tokens are too few for {learners} "
                         f"learners at seq_len {seq_len}; raise data.max_bytes")
    shards = tuple((m * per, (m + 1) * per) for m in range(learners))
    return Corpus(train=train, eval=ev, shards=shards, seq_len=seq_len, seed=seed)


_SCAN_BYTES = 64 << 20  # a token file is scanned in pieces of this many bytes


def largest_token(tokens: np.ndarray) -> int:
    """The largest id in `tokens`, read in bounded pieces (a memory-mapped file of any size);
    for a token file, remembered in the data cache by the file's path, size and time, so a
    learner's restart does not read it again."""
    if tokens.dtype == np.uint8:
        return 255 if tokens.size else 0  # bytes: every model's vocabulary holds them
    key = None
    if isinstance(tokens, np.memmap) and tokens.filename:
        st = os.stat(tokens.filename)
        key = hashlib.sha256(json.dumps([str(tokens.filename), st.st_size, st.st_mtime_ns,
                                         tokens.size, tokens.dtype.str]).encode()).hexdigest()
        memo = cache_dir() / f"largest-token-{key}"
        try:
            return int(memo.read_text())
        except (OSError, ValueError):
            pass
    step = max(1, _SCAN_BYTES // tokens.dtype.itemsize)
    top = max((int(tokens[i:i + step].max()) for i in range(0, tokens.size, step)), default=0)
    if key is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=memo.parent, prefix=".largest-token.")
            with os.fdopen(fd, "w") as f:
                f.write(str(top))
            os.replace(tmp, memo)
        except OSError:
            pass  # a read-only cache: scanned again next time
    return top


def run_corpus(cfg: RunConfig, vocab: int | None = None) -> Corpus:
    """The corpus of a run: its tokens split for its learners (what every process of the run
    builds, so the shards and the evaluation split agree everywhere).

    Args:
        vocab: The model's vocabulary size, where the task knows it: a token id at or above
            it is refused here (the embedding lookup would read out of range in silence).

    Raises:
        ValueError: a token id is outside the vocabulary (naming the file and both numbers).
    """
    tokens = load_tokens(cfg.data)
    if vocab is not None:
        top = largest_token(tokens)
        if top >= vocab:
            raise ValueError(f"data.source: {cfg.data.source} holds token id {top}, outside "
                             f"the model's vocabulary of {vocab} (model.vocab_size): tokenised "
                             f"for another model, or the wrong data.format")
    return make_corpus(tokens, cfg.learners, cfg.model.seq_len, cfg.data.eval_fraction,
                       cfg.seed)
