"""What a learner core asks its driver, and the answers: was a push in flight merged though its
value never came? The core never reads anything itself: a fragment whose push is due over one
whose value is H steps late waits (`waiting`) until its driver answers, from the syncer's merge
records read off the training thread."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

DEFER = "defer"  # an answer when the driver cannot tell now: push at the fragment's next turn
# a driver's answer: (version, value) if a round merged the push (the value of that version or
# a later one), None if none did, DEFER if it cannot tell now
Found = tuple[int, Mapping[str, np.ndarray]] | str | None
Key = tuple[int, int]  # a push: (base version, step)


class MergeQuestions:
    """One core's questions (fragment → the key of its push in flight) and their answers.
    `on`: whether the driver answers; one that does not gets no question, and its core sends
    superseding pushes without asking (they then repeat any merged progress)."""

    def __init__(self) -> None:
        self.on = False
        self.asked: dict[int, Key] = {}  # asked since the driver last took them (`take`)
        self.answers: dict[int, tuple[Key, Found]] = {}
        self.waiting: set[int] = set()  # fragments whose push waits for an answer
        self._open: dict[int, Key] = {}  # asked and not answered yet
        # (fragment, version, value) of each answer the core applied since the driver last
        # took them (`take_used`): the driver's own record of the fragment moves with it
        self.used: list[tuple[int, int, Mapping[str, np.ndarray]]] = []

    def take(self) -> dict[int, Key]:
        """The questions asked since the last call, for the driver to answer."""
        out, self.asked = self.asked, {}
        return out

    def answer(self, p: int, key: Key, found: Found) -> None:
        """The driver's answer about fragment p's push `key`; one about a question no longer
        open (another push, or one whose turn came without it) is dropped."""
        if self._open.get(p) == key:
            self.answers[p] = (key, found)

    def drop(self, p: int) -> None:
        """Fragment p's turn needs no answer (its value came, or nothing is in flight): an
        open question's answer, when it comes, is dropped."""
        self._open.pop(p, None)
        self.answers.pop(p, None)
        self.waiting.discard(p)

    def take_used(self) -> list[tuple[int, int, Mapping[str, np.ndarray]]]:
        """The answers the core applied since the last call: (fragment, version, value)."""
        out, self.used = self.used, []
        return out

    def answered(self, p: int, key: Key) -> tuple[bool, Found]:
        """(whether fragment p's push `key` is answered, the answer); unanswered, it is asked
        (once) and the fragment waits."""
        got, found = self.answers.pop(p, (None, None))
        if got == key:
            self._open.pop(p, None)
            self.waiting.discard(p)
            return True, found
        if self._open.get(p) != key:
            self.asked[p] = self._open[p] = key
        self.waiting.add(p)
        return False, None
