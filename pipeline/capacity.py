"""The largest value each fragment puts on a path, against the limits of that path — checked
before a run starts, so a model too large for its settings is refused in one line that names
the setting that fixes it (not a broken pipe when the syncer writes version 0).

Every value is carried whole today, one per Redis key or ZeroMQ message, so per fragment of n
values (`value_bytes`):

* a push's payload: `codec_up` bytes (int4: n/2 + 4 bytes per block of `quant_block`);
* a published merged value: `codec_down` bytes; with `down_delta` the first one, and every
  snapshot a joining learner reads (`:global`, `:sent:<v>`), is the exact reference in fp32;
* the syncer's checkpointed state (`:state`): Θ and the outer momentum in fp32, 8n bytes.

The decoders bound a payload and a snapshot by `broker.max_payload_bytes`, a state by 4× that;
Redis refuses a single value over its `proto-max-bulk-len` (512 MB unless configured).
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
MAX_FRAGMENTS = 1024  # the most fragments `sync.fragments` accepts


@dataclass(frozen=True)
class Limits:
    """The limits on the paths: ours (`broker.max_payload_bytes`) and Redis's value size,
    with where that figure came from (said in the refusal)."""

    max_payload_bytes: int
    redis_bulk_bytes: int = REDIS_BULK_DEFAULT
    redis_source: str = "Redis's default proto-max-bulk-len"


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


def _problems(cfg: RunConfig, n: int, limits: Limits) -> list[tuple[str, int, int, str]]:
    """(what, bytes, limit, the limit's name) of each value of a fragment of `n` values that
    is over a limit."""
    v = value_bytes(cfg, n)
    ours = limits.max_payload_bytes
    out = []
    for what, size, limit, name in (
            ("push payload", v["push"], ours, "broker.max_payload_bytes"),
            ("published value", v["publish"], ours, "broker.max_payload_bytes"),
            ("snapshot", v["snapshot"], min(ours, limits.redis_bulk_bytes),
             "broker.max_payload_bytes" if ours <= limits.redis_bulk_bytes
             else limits.redis_source),
            ("checkpointed state (Θ and outer momentum, fp32)", v["state"],
             min(4 * ours, limits.redis_bulk_bytes),
             "4 × broker.max_payload_bytes" if 4 * ours <= limits.redis_bulk_bytes
             else limits.redis_source)):
        if size + HEADROOM > limit:
            out.append((what, size, limit, name))
    return out


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


def check(cfg: RunConfig, shapes: Mapping[str, tuple[int, ...]],
          is_embedding: Callable[[str], bool], limits: Limits) -> str | None:
    """None if every fragment's values fit their paths; else one line: which value of which
    fragment is over which limit, and the setting that fixes it."""
    fragments = cfg.effective_sync().fragments
    largest = _largest(cfg, shapes, is_embedding, fragments)
    if largest is None:
        return None  # partition's own refusal names sync.fragments
    p, n = largest
    over = _problems(cfg, n, limits)
    if not over:
        return None
    what, size, limit, name = over[0]
    head = (f"fragment {p} holds {n:,} values: its {what} is {_mb(size)}, over {name} "
            f"({_mb(limit)})")
    for more in range(fragments + 1, MAX_FRAGMENTS + 1):
        found = _largest(cfg, shapes, is_embedding, more)
        if found is None:
            break
        if not _problems(cfg, found[1], limits):
            return (f"{head}: set sync.fragments to at least {more} (the largest fragment then "
                    f"holds {found[1]:,} values)")
    biggest = max(shapes, key=lambda k: math.prod(shapes[k]))
    setting = ("broker.max_payload_bytes" if "max_payload_bytes" in name
               else "proto-max-bulk-len in redis.conf")
    return (f"{head}, and no number of fragments fits it (the tensor {biggest!r} alone holds "
            f"{math.prod(shapes[biggest]):,} values): raise {setting} (values are not carried "
            f"in pieces yet)")
