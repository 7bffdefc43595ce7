"""What one learner contributes to one fragment, on both sides of the wire.

:class:`PushHeader` holds the facts of one push; :class:`Push` is what a learner sends (a
header and δ = base − θ, quantised for the up link), :class:`Contribution` what the syncer's
state machine merges (the same header and numbers, as received),
and :class:`Reason` with its :class:`Drop` kind says why a contribution was refused. Pure data:
the wire encoding is `broker.codec`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from typing import NamedTuple

import numpy as np

from pipeline import quant


@dataclass(frozen=True)
class PushHeader:
    """The facts of one push, one type from the learner that makes it, through the stream
    entry that carries it (`broker.entries`), to the syncer that merges it and remembers it
    (`pipeline.syncer.FragmentSyncer.last_merged`): who sent it (its learner, and the epoch its
    process claimed: 0 for none), where (fragment, base version, step), the progress it
    carries (steps, tokens, learner-seconds: goodput's unit), the step of its chain's first
    push (a push that supersedes one not known to be merged carries that one's progress too
    and continues its chain; None: a chain of its own, or an entry of a version before
    chains), and whether it is its learner's last push of the fragment (the end-of-run flush).
    Equality is the push's identity and content: the run's bookkeeping is left out."""

    learner: str
    fragment: int
    base_version: int
    step: int
    steps: int
    tokens: int
    seconds: float = field(default=0.0, compare=False)
    chain: int | None = field(default=None, compare=False)
    final: bool = field(default=False, compare=False)
    epoch: int = field(default=0, compare=False)

    @property
    def key(self) -> tuple[str, int, int]:
        """Identity for deduplication: (learner, base_version, step)."""
        return (self.learner, self.base_version, self.step)

    def header(self) -> PushHeader:
        """The header alone (of a push or a contribution: without its tensors)."""
        return PushHeader(**{f.name: getattr(self, f.name) for f in fields(PushHeader)})


@dataclass(frozen=True)
class Push(PushHeader):
    """A contribution to send: δ = base − θ of one fragment, quantised for the up link."""

    payload: dict[str, quant.QTensor] = field(kw_only=True)

    @property
    def nbytes(self) -> int:
        return sum(quant.payload_nbytes(q) for q in self.payload.values())


class MergeRecord(NamedTuple):
    """A round merged a learner's push (its base version and step) into `version`: what the
    syncer commits for each learner with a round (`broker.records.Merged` is its JSON form),
    publishes with the round's value (`broker.codec.GlobalHeader.merged`), and what tells a
    learner's "rebase" rule which of its pushes a value holds."""

    base_version: int
    step: int
    version: int


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


@dataclass(frozen=True)
class Contribution(PushHeader):
    """One push as the syncer merges it: its header, δ = base − θ as received (quantised or
    fp32, decoded inside the merge), its stream entry id and payload bytes."""

    delta: dict[str, quant.QTensor | np.ndarray] = field(kw_only=True)
    entry_id: str = field(default="", kw_only=True)
    nbytes: int = field(default=0, kw_only=True)

    @classmethod
    def of(cls, head: PushHeader, delta: dict[str, quant.QTensor | np.ndarray], *,
           entry_id: str = "", nbytes: int = 0) -> Contribution:
        """`head`'s contribution with `delta`."""
        return cls(**{f.name: getattr(head, f.name) for f in fields(PushHeader)},
                   delta=delta, entry_id=entry_id, nbytes=nbytes)
