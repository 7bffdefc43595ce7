"""The largest value each fragment puts on a path, against the limits of that path — checked
before a run starts, so a model too large for its settings is refused in one line that names
the setting that fixes it (not a broken pipe when the syncer writes version 0).

Per fragment of n values (`value_bytes`):

* a push's payload: `codec_up` bytes (int4: n/2 + 4 bytes per block of `quant_block`), in
  the fields of one stream entry;
* a published merged value: `codec_down` bytes; with `down_delta` the first one, and the
  snapshots a reader needs whole (`:global`, the oldest `:sent:<v>`), is the exact reference
  in fp32;
* the syncer's checkpointed state (`:state`): Θ and the outer momentum in fp32, 8n bytes.

Pushes, snapshots and states are carried in pieces of `broker.piece_bytes` (`broker.pieces`,
`broker.entries`): only a piece meets Redis's `proto-max-bulk-len` (512 MB unless configured).
A push's payload, a published value and a snapshot are bounded by `broker.max_payload_bytes`;
a state by what its fragment's values make it (`state_limit`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pipeline import quant
from pipeline.config import RunConfig
from pipeline.fragments import fragment_sizes, partition

REDIS_BULK_DEFAULT = 512 * 2**20  # Redis's proto-max-bulk-len unless redis.conf raises it
HEADROOM = 1 << 20  # msgpack framing, names, scales' headers: far below this per value
STATE_HEADROOM = 64 << 20  # a state's bookkeeping (dedupe keys, merge records: 2**20 rows)
MAX_FRAGMENTS = 1024  # the most fragments `sync.fragments` accepts


@dataclass(frozen=True)
class Limits:
    """The limits on the paths: ours (`broker.max_payload_bytes`) and Redis's value size,
    with where that figure came from (said in the refusal)."""

    max_payload_bytes: int
    redis_bulk_bytes: int = REDIS_BULK_DEFAULT
    redis_source: str = "Redis's default proto-max-bulk-len"
    piece_bytes: int = 64 * 2**20
    redis_maxmemory: int = 0  # Redis's maxmemory (0: none, or not readable here)


def value_bytes(cfg: RunConfig, n: int) -> dict[str, int]:
    """The bytes of each value a fragment of `n` values puts on a path (payloads only):
    ``publish`` is the largest published value (the first, under the delta down link),
    ``publish_steady`` every one after it."""
    s = cfg.effective_sync()

    def coded(codec: str) -> int:
        scales = 4 * quant.num_blocks(n, s.quant_block) if codec in ("int4", "int8") else 0
        return quant.data_nbytes(codec, n) + scales

    snapshot = 4 * n if s.down_delta else coded(s.codec_down)
    return {"push": coded(s.codec_up), "publish": max(coded(s.codec_down), snapshot),
            "publish_steady": coded(s.codec_down), "snapshot": snapshot, "state": 8 * n}


def state_limit(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The largest checkpointed state a decoder accepts of a fragment of these tensors."""
    return 8 * sum(math.prod(s) for s in shapes.values()) + STATE_HEADROOM


def _problems(cfg: RunConfig, n: int, limits: Limits) -> list[tuple[str, int, int, str]]:
    """(what, bytes, limit, the limit's name) of each value of a fragment of `n` values that
    is over a limit."""
    v = value_bytes(cfg, n)
    ours = limits.max_payload_bytes
    out = []
    for what, size, limit, name in (
            ("push payload", v["push"], ours, "broker.max_payload_bytes"),
            ("published value", v["publish"], ours, "broker.max_payload_bytes"),
            ("snapshot", v["snapshot"], ours, "broker.max_payload_bytes")):
        if size + HEADROOM > limit:
            out.append((what, size, limit, name))
    return out


def redis_minimum(cfg: RunConfig, fragment_values: list[int]) -> int:
    """The least Redis must hold for a run: per fragment a checkpoint, the latest snapshot
    (twice: ``:global`` and ``:sent:<v>``) and one push per learner."""
    return sum(8 * n + 2 * value_bytes(cfg, n)["snapshot"] + cfg.learners * value_bytes(
        cfg, n)["push"] for n in fragment_values)


def _largest(cfg: RunConfig, shapes: Mapping[str, tuple[int, ...]],
             is_embedding: Callable[[str], bool], fragments: int) -> tuple[int, int] | None:
    """(index, values) of the largest fragment with `fragments` fragments (None: the model
    cannot be split so)."""
    try:
        sizes = fragment_sizes(shapes, partition(shapes, fragments, is_embedding))
    except ValueError:
        return None
    i = max(range(len(sizes)), key=sizes.__getitem__)
    return i, sizes[i]


def _mb(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _memory(cfg: RunConfig, shapes: Mapping[str, tuple[int, ...]],
            is_embedding: Callable[[str], bool], fragments: int, limits: Limits) -> str | None:
    if not limits.redis_maxmemory:
        return None
    need = redis_minimum(cfg, fragment_sizes(shapes, partition(shapes, fragments,
                                                               is_embedding)))
    if need <= limits.redis_maxmemory:
        return None
    return (f"Redis's maxmemory ({_mb(limits.redis_maxmemory)}) cannot hold what this run "
            f"needs at the least ({_mb(need)}: per fragment a checkpoint, the latest snapshot "
            f"twice and one push per learner): raise maxmemory in redis.conf (REDIS.md §3 "
            f"sizes it; `diloco plan` prints the run's steady state)")


def fragments_needed(cfg: RunConfig, shapes: Mapping[str, tuple[int, ...]],
                     is_embedding: Callable[[str], bool], limits: Limits) -> int | None:
    """The least number of fragments, at least `sync.fragments`, whose every value fits its
    paths (None: none does — a tensor alone is too large, or the model cannot be split)."""
    for p in range(cfg.effective_sync().fragments, MAX_FRAGMENTS + 1):
        found = _largest(cfg, shapes, is_embedding, p)
        if found is None:
            return None
        if not _problems(cfg, found[1], limits):
            return p
    return None


def check(cfg: RunConfig, shapes: Mapping[str, tuple[int, ...]],
          is_embedding: Callable[[str], bool], limits: Limits) -> str | None:
    """None if every fragment's values fit their paths; else one line: which value of which
    fragment is over which limit, and the setting that fixes it."""
    if limits.piece_bytes > limits.redis_bulk_bytes:  # a piece is raw bytes: no framing
        return (f"broker.piece_bytes ({_mb(limits.piece_bytes)}) does not fit one Redis value "
                f"({limits.redis_source}: {_mb(limits.redis_bulk_bytes)}): lower "
                f"broker.piece_bytes")
    fragments = cfg.effective_sync().fragments
    largest = _largest(cfg, shapes, is_embedding, fragments)
    if largest is None:
        return None  # partition's own refusal names sync.fragments
    p, n = largest
    over = _problems(cfg, n, limits)
    if not over:
        return _memory(cfg, shapes, is_embedding, fragments, limits)
    what, size, limit, name = over[0]
    head = (f"fragment {p} holds {n:,} values: its {what} is {_mb(size)}, over {name} "
            f"({_mb(limit)})")
    more = fragments_needed(cfg, shapes, is_embedding, limits)
    if more is not None:
        return (f"{head}: set sync.fragments to at least {more} (the largest fragment then "
                f"holds {_largest(cfg, shapes, is_embedding, more)[1]:,} values)")
    biggest = max(shapes, key=lambda k: math.prod(shapes[k]))
    setting = ("broker.max_payload_bytes" if "max_payload_bytes" in name
               else "proto-max-bulk-len in redis.conf")
    return (f"{head}, and no number of fragments fits it (the tensor {biggest!r} alone holds "
            f"{math.prod(shapes[biggest]):,} values): raise {setting}")
