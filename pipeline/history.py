"""The recent values a syncer published, kept as compactly as they can be rebuilt exactly.

A syncer anchors a stale contribution at the value its learner started from, R(v): the last
``max_staleness + 1`` versions. In fp32 that is 4 bytes per value per version; but every
learner rebuilt R(v) from what went over the wire, and so can the syncer:

* under the delta down link (`sync.down_delta`) a version published as a delta against the one
  before is kept as that delta — the wire's bytes, an int4 delta 0.56 bytes per value — and
  rebuilt as learners rebuild it (`pipeline.downlink.apply_delta`, fp32, elementwise: bit for
  bit); the oldest version is kept whole, as the chain's start;
* a value sent whole in a codec (bf16, int8, int4) is kept as that message and decoded again
  (`pipeline.quant.dequantize`: what learners decoded);
* fp32, a key frame, and values restored from a checkpoint are kept whole.

The newest value is also kept whole: each round's delta is taken against it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from pipeline import quant
from pipeline.downlink import apply_delta

Values = dict[str, np.ndarray]


class History:
    """version → the fp32 value learners hold for it, oldest first (a read-only mapping that
    rebuilds what it keeps coded)."""

    def __init__(self, version: int, values: Mapping[str, np.ndarray]):
        # version → ("whole", values) | ("coded", message) | ("delta", message): a delta is
        # against the version before it
        self._kept: dict[int, tuple[str, Mapping]] = {version: ("whole", dict(values))}
        self._newest: tuple[int, Values] = (version, dict(values))

    @classmethod
    def from_values(cls, items: Mapping[int, Mapping[str, np.ndarray]]) -> History:
        """A history of whole values (restored from a checkpoint)."""
        versions = sorted(items)
        h = cls(versions[0], items[versions[0]])
        for v in versions[1:]:
            h._kept[v] = ("whole", dict(items[v]))
        h._newest = (versions[-1], dict(items[versions[-1]]))
        return h

    def add(self, version: int, values: Mapping[str, np.ndarray],
            sent: Mapping[str, quant.QTensor], base: int) -> None:
        """The value `version` (`values`, fp32) that went out as `sent`: a delta against
        version `base`, or the whole value when `base` is -1."""
        codec = next(iter(sent.values())).codec if sent else "fp32"
        newest, _ = self._newest
        if base >= 0 and base == newest and base in self._kept:
            self._kept[version] = ("delta", dict(sent))
        elif base < 0 and codec != "fp32":
            self._kept[version] = ("coded", dict(sent))
        else:
            self._kept[version] = ("whole", dict(values))
        self._newest = (version, dict(values))

    def keep_last(self, n: int) -> None:
        """Drop all but the newest `n` versions (the oldest kept is made whole)."""
        while len(self._kept) > n:
            oldest = next(iter(self._kept))
            nxt = sorted(self._kept)[1]
            if self._kept[nxt][0] == "delta":
                self._kept[nxt] = ("whole", self[nxt])
            del self._kept[oldest]

    def delta(self, version: int) -> Mapping[str, quant.QTensor] | None:
        """The delta against the version before that `version` went out as, when it is kept
        so (None: it is kept whole or coded)."""
        kind, kept = self._kept[version]
        return kept if kind == "delta" else None

    def __getitem__(self, version: int) -> Values:
        if version == self._newest[0]:
            return self._newest[1]
        kind, kept = self._kept[version]
        if kind == "whole":
            return dict(kept)
        if kind == "coded":
            return {k: quant.dequantize(q) for k, q in kept.items()}
        return apply_delta(self[version - 1], kept)

    def __contains__(self, version: object) -> bool:
        return version in self._kept

    def __len__(self) -> int:
        return len(self._kept)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._kept))

    def items(self) -> Iterator[tuple[int, Values]]:
        """(version, value), oldest first: each rebuilt from the one before."""
        prev: Values | None = None
        for v in list(self._kept):
            kind, kept = self._kept[v]
            if v == self._newest[0]:
                prev = self._newest[1]
            elif kind == "delta" and prev is not None:
                prev = apply_delta(prev, kept)
            else:
                prev = self[v]
            yield v, prev

    def nbytes(self) -> int:
        """Bytes held: the kept values and messages, and the newest value."""
        def size(kind: str, kept: Mapping) -> int:
            if kind == "whole":
                return sum(a.nbytes for a in kept.values())
            return sum(q.data.nbytes + (0 if q.scales is None else q.scales.nbytes)
                       for q in kept.values())
        newest_v, newest = self._newest
        extra = 0 if self._kept[newest_v][0] == "whole" else sum(a.nbytes for a in newest.values())
        return sum(size(*kv) for kv in self._kept.values()) + extra
