"""`diloco data prepare`: text, JSONL or a folder of text files tokenised with a real tokenizer
(a `tokenizers` JSON file: Hugging Face's format) into the token files learners read
(`pipeline.data`: little-endian uint16 ``.bin``/``.u16`` or uint32 ``.u32``).

Streaming and bounded: documents are read one at a time, encoded in batches of about
`batch_bytes` of text, and appended to a temporary file beside the output, renamed over it
once complete (an interrupted run leaves no partial file). Documents are joined by the
`--eos` token when given. The ids' width follows the tokenizer's vocabulary: more than 65,536
ids need a ``.u32`` file, refused up front otherwise.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

TOKENIZERS_EXTRA = ("diloco data prepare needs the tokenizers package: pip install "
                    "'decoupled-diloco[data]' (or pip install tokenizers)")
_U16_SUFFIXES = (".bin", ".u16")


def _tokenizer(path: str | Path):
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ValueError(TOKENIZERS_EXTRA) from e
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises its own exception types for a bad file
        raise ValueError(f"--tokenizer {path}: not a tokenizers JSON file ({str(e)[:200]})") \
            from e


def _file_chunks(path: Path, chunk_bytes: int) -> Iterator[str]:
    """A text file in pieces of about `chunk_bytes`, each ending at a line's end (a line
    longer than that is one piece): never the whole file in memory."""
    held: list[str] = []
    size = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            held.append(line)
            size += len(line)
            if size >= chunk_bytes:
                yield "".join(held)
                held, size = [], 0
    if held:
        yield "".join(held)


def documents(source: Path, text_field: str = "text",
              chunk_bytes: int = 1 << 20) -> Iterator[tuple[bool, str]]:
    """(starts a document, text) of `source`: each line's `text_field` of a ``.jsonl`` file
    (lines that are not such an object are skipped), a text file, or each text file of a
    folder (in the order of their paths); a file in pieces of about `chunk_bytes` split at
    line ends."""
    if source.suffix == ".jsonl" and source.is_file():
        with open(source, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                doc = obj.get(text_field) if isinstance(obj, dict) else None
                if isinstance(doc, str) and doc:
                    yield True, doc
        return
    if source.is_dir():
        from pipeline.data import _text_files  # the files a text run reads, in its order

        files = _text_files(source)
    else:
        files = [source]
    for path in files:
        for i, piece in enumerate(_file_chunks(path, chunk_bytes)):
            yield i == 0, piece


def prepare(tokenizer: str | Path, source: str | Path, out: str | Path, *,
            text_field: str = "text", eos: int | None = None, batch_bytes: int = 4 << 20,
            progress: Callable[[dict], None] | None = None) -> dict:
    """Tokenise `source` into the token file `out`.

    Returns:
        ``{"out", "tokens", "documents", "vocab_size", "dtype", "largest_id", "seconds"}``.

    Raises:
        ValueError: no tokenizers package, a bad tokenizer file, a missing source, an output
            suffix too narrow for the vocabulary (or not a token file's), or no documents.
    """
    tok = _tokenizer(tokenizer)
    vocab = int(tok.get_vocab_size(with_added_tokens=True))
    source, out = Path(source), Path(out)
    if not source.exists():
        raise ValueError(f"--input {source}: no such file or folder")
    if out.suffix not in (*_U16_SUFFIXES, ".u32"):
        raise ValueError(f"--out {out}: name it .bin or .u16 (uint16 ids) or .u32 (uint32 "
                         f"ids), the token files learners read")
    if vocab > 65536 and out.suffix != ".u32":
        raise ValueError(f"--out {out}: the tokenizer has {vocab:,} ids, more than uint16 "
                         f"holds: name the file .u32")
    if eos is not None and not 0 <= eos < vocab:
        raise ValueError(f"--eos {eos}: not an id of the tokenizer's {vocab:,}")
    dtype = np.dtype("<u4" if out.suffix == ".u32" else "<u2")
    total = source.stat().st_size if source.is_file() else 0
    stats = {"documents": 0, "tokens": 0, "largest_id": -1, "bytes_read": 0}
    t0 = last = time.monotonic()
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            def flush(batch: list[tuple[bool, str]]) -> None:
                for (starts, _), enc in zip(batch, tok.encode_batch([t for _, t in batch]),
                                            strict=True):
                    ids = np.asarray(enc.ids, dtype=np.int64)
                    if starts and eos is not None and stats["documents"]:
                        ids = np.concatenate([[eos], ids])
                    stats["documents"] += int(starts)
                    if ids.size:
                        stats["largest_id"] = max(stats["largest_id"], int(ids.max()))
                        stats["tokens"] += int(ids.size)
                        f.write(ids.astype(dtype).tobytes())

            batch, held = [], 0
            for starts, doc in documents(source, text_field):
                batch.append((starts, doc))
                held += len(doc)
                stats["bytes_read"] += len(doc.encode("utf-8", "replace"))
                if held >= batch_bytes:
                    flush(batch)
                    batch, held = [], 0
                if progress is not None and time.monotonic() - last >= 1.0:
                    last = time.monotonic()
                    progress({**stats, "total_bytes": total})
            if batch:
                flush(batch)
            f.flush()
            os.fsync(f.fileno())
        if not stats["tokens"]:
            raise ValueError(f"--input {source}: no text to tokenise")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return {"out": str(out), "tokens": stats["tokens"], "documents": stats["documents"],
            "vocab_size": vocab, "dtype": "u32" if dtype.itemsize == 4 else "u16",
            "largest_id": stats["largest_id"], "seconds": round(time.monotonic() - t0, 3)}
