"""Whether a text meets a held-out prompt: a shared run of 12 words, or a short prompt whole.

Texts are compared as their words: lowercase runs of letters and digits (``\\w+``), so case, punctuation and
spacing hide nothing ("Who played Anna in Once Upon a Time?" and "who played anna in once upon a time" are the
same eleven words). A held-out prompt of 12 words or more is met by a text that holds any 12 consecutive words of
it; a shorter one (Spec-Bench's qa questions have 8 to 11) by a text that holds all its words together and in
order, which an exactly equal text does.

One machinery for every check that two prompt sets never mix: ``tests/test_splits.py`` (the project's own test
set against what training draws from) and the check a training prompts file passes before fine-tuning
(``skipkey.training.prompt_source``) against Spec-Bench's test half.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

WINDOW = 12  # words: a run this long shared by two texts is copied, not a common phrase


def words(text: str) -> list[str]:
    """The text's words, lowercase (runs of letters and digits; punctuation and spacing dropped)."""
    return re.findall(r"\w+", text.lower())


def joined(text: str) -> str:
    """The text's words one space apart, with a space at each end, so ``" a b " in joined(t)`` is a word match."""
    return " " + " ".join(words(text)) + " "


def windows(text: str) -> set[str]:
    """Every run of ``WINDOW`` words (the whole text where it is shorter), as ``" w1 w2 ... "``."""
    w = words(text)
    size = min(WINDOW, len(w))
    return {" " + " ".join(w[i:i + size]) + " " for i in range(len(w) - size + 1)} if w else set()


@dataclass(frozen=True)
class Overlap:
    """Where a text meets a held-out prompt: the prompt's id, how (``WINDOW`` words, or the prompt whole), the words."""

    question_id: str
    kind: str
    shared: str

    def describe(self) -> str:
        """What the text shares with the prompt, in words, for a refusal."""
        if self.kind == "window":
            return f"shares the {WINDOW} words \"{self.shared.strip()}\" with question {self.question_id}"
        return f"holds all of question {self.question_id} (\"{self.shared.strip()}\")"


class HeldOut:
    """Held-out prompts (id, text), indexed so any text is checked against all of them in one pass over its words."""

    def __init__(self, prompts: Iterable[tuple[str, str]]):
        self.long: dict[str, str] = {}  # a 12-word window -> the first prompt holding it
        self.short: dict[str, str] = {}  # a prompt of fewer words, whole -> its id
        self.count = 0
        for question_id, text in prompts:
            found = windows(text)
            if not found:
                continue  # no words: nothing a text could copy
            self.count += 1
            target = self.long if len(words(text)) >= WINDOW else self.short
            for window in found:
                target.setdefault(window, question_id)

    def find(self, text: str) -> Overlap | None:
        """The first held-out prompt ``text`` meets, or None."""
        w = words(text)
        for i in range(len(w) - WINDOW + 1):
            window = " " + " ".join(w[i:i + WINDOW]) + " "
            if window in self.long:
                return Overlap(self.long[window], "window", window)
        whole = " " + " ".join(w) + " "
        for prompt, question_id in self.short.items():
            if prompt in whole:
                return Overlap(question_id, "whole", prompt)
        return None


__all__ = ["WINDOW", "HeldOut", "Overlap", "joined", "windows", "words"]
