"""Whether a text meets a held-out prompt: a shared run of 12 words, or a short text whole in the other.

Texts are compared as their words: lowercase runs of letters and digits (``\\w+``), so case, punctuation and
spacing hide nothing ("Who played Anna in Once Upon a Time?" and "who played anna in once upon a time" are the
same eight words). A text meets a held-out prompt where

* it holds 12 consecutive words of the prompt (a copied sentence, a copied passage);
* the prompt has fewer than 12 words and the text holds all of them, together and in order (Spec-Bench's qa
  questions have 8 to 11; an equal text holds them, and so does a longer one that quotes the question);
* the text has fewer than 12 words, at least 6, and the prompt holds all of them: a short text that is a piece of
  a held-out prompt (79 of Spec-Bench's 80 rag prompts end in a Natural Questions question, and a qa training
  prompt asking it would be that question). Under 6 words a text is compared only for equality (the rule above),
  so "Hello there" is not refused for being a common phrase.

One machinery for every check that two prompt sets never mix: ``tests/test_splits.py`` (the project's own test
set against what training draws from) and the check a training prompts file passes before fine-tuning
(``skipkey.training.prompt_source``) against Spec-Bench's test half.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

WINDOW = 12  # words: a run this long shared by two texts is copied, not a common phrase
MIN_PIECE = 6  # words: a shorter text found inside a held-out prompt is a piece of it only from this length


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
    """Where a text meets a held-out prompt: the prompt's id, how (``window``: ``WINDOW`` shared words; ``whole``:
    the whole prompt inside the text; ``piece``: the whole text inside the prompt), and the shared words."""

    question_id: str
    kind: str
    shared: str

    def describe(self) -> str:
        """What the text shares with the prompt, in words, for a refusal."""
        if self.kind == "window":
            return f"shares the {WINDOW} words \"{self.shared.strip()}\" with question {self.question_id}"
        if self.kind == "whole":
            return f"holds all of question {self.question_id} (\"{self.shared.strip()}\")"
        return f"is all inside question {self.question_id} (\"{self.shared.strip()}\")"


class HeldOut:
    """Held-out prompts (id, text), indexed so any text is checked against all of them in one pass over its words."""

    def __init__(self, prompts: Iterable[tuple[str, str]]):
        self.long: dict[str, str] = {}  # a 12-word window -> the first prompt holding it
        self.short: dict[str, str] = {}  # a prompt of fewer words, whole -> its id
        self.texts: list[tuple[str, str]] = []  # (id, the prompt's words joined), for the pieces of a prompt
        for question_id, text in prompts:
            found = windows(text)
            if not found:
                continue  # no words: nothing a text could copy
            self.texts.append((question_id, joined(text)))
            target = self.long if len(words(text)) >= WINDOW else self.short
            for window in found:
                target.setdefault(window, question_id)
        self.every = "\n".join(text for _, text in self.texts)  # one search finds whether any prompt holds a piece

    @property
    def count(self) -> int:
        return len(self.texts)

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
        if MIN_PIECE <= len(w) < WINDOW and whole in self.every:
            return next(Overlap(question_id, "piece", whole) for question_id, held in self.texts if whole in held)
        return None


__all__ = ["MIN_PIECE", "WINDOW", "HeldOut", "Overlap", "joined", "windows", "words"]
