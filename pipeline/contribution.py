"""What one learner contributes to one fragment, on both sides of the wire.

:class:`Push` is what a learner sends (δ = base − θ, quantised for the up link),
:class:`Contribution` what the syncer's state machine merges (the same numbers as received),
and :class:`Reason` with its :class:`Drop` kind says why a contribution was refused. Pure data:
the wire encoding is `broker.codec`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from pipeline import quant


@dataclass
class Push:
    """A contribution to send: δ = base − θ of one fragment, quantised for the up link."""

    fragment: int
    base_version: int
    step: int
    steps: int
    tokens: int
    payload: dict[str, quant.QTensor]
    seconds: float = 0.0  # learner-seconds of the progress it carries (goodput's unit)
    # the step of the first push of its chain: a push that supersedes one not known to be
    # merged carries that one's progress too and continues its chain (the syncer counts a
    # push only by what it adds to its chain's merged push); None: a chain of its own
    chain: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(quant.payload_nbytes(q) for q in self.payload.values())


def poisoned(push: Push, kind: str, scale: float, codec: str, block: int) -> Push:
    """What a poisoned learner sends instead of `push` (the poison guard's benchmarks and
    tests, ``pipeline.config.POISONS``): δ × scale ("norm"), tokens × scale ("tokens"), or −δ
    at its honest norm ("signflip")."""
    if kind == "tokens":
        return replace(push, tokens=int(push.tokens * scale))
    if kind not in ("norm", "signflip"):
        raise ValueError(f"unknown poison {kind!r}")
    factor = np.float32(scale if kind == "norm" else -1.0)
    return replace(push, payload={k: quant.quantize(quant.dequantize(q) * factor, codec, block)
                                  for k, q in push.payload.items()})


class Drop(StrEnum):
    """Why the syncer refused a contribution (the kind; the text says more)."""

    DUPLICATE = "duplicate"        # seen before (a retried XADD): acknowledged, not recorded
    DEFER = "defer"                # its learner is already in the open round: offered again
    STALE = "stale"                # anchored more than max_staleness versions back
    UNANCHORED = "unanchored"      # its base version is no longer held
    AHEAD = "ahead"                # its base version is newer than the global version
    EMPTY = "empty"                # no steps or no tokens
    SHAPE = "shape"                # tensors that do not match the fragment
    NON_FINITE = "non-finite"      # NaN or inf values
    MALFORMED = "malformed"        # an internally inconsistent quantised tensor
    TOKENS = "tokens"              # claims more tokens than its steps can have produced
    NORM = "norm"                  # its norm per step is far above the recent median
    ROUND = "round"                # merged into a round whose value would not be finite
    SUPERSEDED = "superseded"      # a later push of its learner, holding its progress, merged
    FINISHED = "finished"          # its learner's last push of the fragment (`final`) is merged
    OTHER = "other"                # a reason text this version does not know


_DROP_TEXT = (  # how each kind's text begins: reads reasons recorded as text (round records)
    (Drop.DUPLICATE, "duplicate"), (Drop.DEFER, "defer"), (Drop.STALE, "stale"),
    (Drop.UNANCHORED, "base version ", " no longer held"),
    (Drop.AHEAD, "base version ", " is ahead of"), (Drop.EMPTY, "empty contribution"),
    (Drop.SHAPE, "tensors do not match"), (Drop.NON_FINITE, "non-finite"),
    (Drop.MALFORMED, "malformed"), (Drop.TOKENS, "tokens "), (Drop.NORM, "norm "),
    (Drop.ROUND, "round "), (Drop.SUPERSEDED, "superseded"), (Drop.FINISHED, "finished"))


class Reason(str):
    """The text of a refusal, with its :class:`Drop` kind (``reason.kind``). It is a str, so it
    goes into round records and logs as its text."""

    kind: Drop

    def __new__(cls, kind: Drop, text: str = "") -> Reason:
        obj = super().__new__(cls, text or kind.value)
        obj.kind = kind
        return obj

    @classmethod
    def of(cls, text: str) -> Reason:
        """The reason a recorded text stands for (its kind from the text's known form)."""
        for kind, head, *tail in _DROP_TEXT:
            if text.startswith(head) and all(t in text for t in tail):
                return cls(kind, text)
        return cls(Drop.OTHER, text)

    def __reduce__(self):
        return (Reason, (self.kind, str(self)))


@dataclass
class Contribution:
    """One push: δ = base − θ of one fragment from one learner, quantised or fp32."""

    learner: str
    fragment: int
    base_version: int
    step: int
    steps: int
    tokens: int
    delta: dict[str, quant.QTensor | np.ndarray]  # as received (decoded inside the merge)
    entry_id: str = ""
    nbytes: int = 0
    seconds: float = 0.0  # learner-seconds of the progress it carries (goodput's unit)
    epoch: int = 0  # its learner process's epoch (0: none claimed)
    # the step of the first push of its chain (`Push.chain`); None: an entry of a version
    # before chains, which the syncer takes as one chain with its learner's pushes on its base
    chain: int | None = None
    # its learner's last push of the fragment (the end-of-run flush): under
    # sync.final_step = "plain" the round that merges it takes a plain outer step
    final: bool = False

    @property
    def key(self) -> tuple[str, int, int]:
        """Identity for deduplication: (learner, base_version, step)."""
        return (self.learner, self.base_version, self.step)
