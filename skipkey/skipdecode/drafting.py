"""What exact decoding drafts, cycle by cycle: nothing, the text's own continuation, or the SkipDecode model.

A verify forward over ``q`` tokens costs a little more than a plain step, and a draft
step a third of one on the embedded model; a draft pays only when enough of it is
accepted. On text people wrote the SkipDecode draft agrees with the full model from
about 0.2 to 1.0 of the time depending on the prompt (``docs/results/exact.md``), so a
fixed draft length loses on some prompts. Three pieces decide instead:

* ``PromptLookup`` (prompt lookup decoding, Saxena 2023; transformers'
  ``prompt_lookup_num_tokens``): the continuation of the latest earlier occurrence of
  the text's last n tokens. It costs nothing to draft, only the verify's extra tokens.
* ``StepCosts``: the seconds of a plain step, of a verify forward per token count and
  of a draft step per depth, measured as the run goes.
* A pace: ``FixedPace`` drafts ``k`` every cycle (the classic speculative loop);
  ``MeasuredPace`` drafts only what it expects to pay, from the measured costs and the
  acceptance measured so far: per drafted token the SkipDecode draft's own probability,
  calibrated online against what the full model accepted, gives the chance the token
  survives; drafting stops when the next token's expected gain (its survival times a
  plain step's time) falls below its cost (a draft step plus a verified token), and a
  cycle drafts nothing, a plain full step, when even the first token does not pay,
  probing again after a doubling wait. Lookup proposals compete on the same scale.

None of this changes the output: every token is still the full model's. It changes
only how many forwards produce it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_WAIT = 16  # plain steps between probes, at most, after drafting stopped paying
SMOOTHING = 0.3  # weight of the newest observation in the running means of costs and agreement
BINS = 10  # calibration bins of the draft's probability
CALIBRATION_MEMORY = 512  # judged tokens a calibration bin weighs at most


@dataclass(frozen=True)
class Cycle:
    """One cycle's plan: ``source`` "layers" (the SkipDecode draft, up to ``count`` tokens; ``tokens``, if any, a
    lookup proposal it may confirm), "lookup" (``tokens``, one list per row) or "plain" (nothing drafted)."""

    source: str
    count: int = 0
    tokens: tuple[tuple[int, ...], ...] = ()
    ngram: int = 0


PLAIN = Cycle("plain")


@dataclass(frozen=True)
class PromptLookup:
    """Prompt lookup decoding: propose what followed the latest earlier occurrence of the last ``n`` tokens,
    trying ``n`` from ``max_ngram`` down to ``min_ngram``."""

    max_ngram: int = 3
    min_ngram: int = 1

    def propose(self, tokens: np.ndarray, count: int) -> tuple[tuple[int, ...], int]:
        """Up to ``count`` proposed ids and the n-gram length that matched (``((), 0)`` when none did)."""
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            tail = tokens[length - n:]
            # Windows of n tokens that start before the tail and are followed by at least one token.
            starts = np.flatnonzero(tokens[: length - n] == tail[0])
            for i in range(1, n):
                starts = starts[tokens[starts + i] == tail[i]]
            if len(starts):
                start = int(starts[-1]) + n
                return tuple(int(t) for t in tokens[start: start + count]), n
        return (), 0


class Rate:
    """A running estimate of a probability: a prior, then exponentially weighted observations."""

    def __init__(self, prior: float):
        self.value = prior

    def observe(self, outcome: float, weight: float = SMOOTHING) -> None:
        self.value += weight * (outcome - self.value)


@dataclass
class StepCosts:
    """Seconds measured so far: a verify forward per token count (1 = a plain step), a draft step per depth."""

    verify: dict[int, float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)
    per_token: float = 0.04  # a verify forward's extra cost per token, in plain steps, until measured

    def observe_verify(self, tokens: int, seconds: float) -> None:
        _smooth(self.verify, tokens, seconds)

    def observe_draft(self, depth: int, seconds: float) -> None:
        _smooth(self.draft, depth, seconds)

    @property
    def known(self) -> bool:
        return bool(self.verify)

    def verify_s(self, tokens: int) -> float:
        """A verify forward over ``tokens``: measured; else, between measured counts, the next larger one's (a
        forward over more tokens costs no less, and the cost need not grow linearly: on a CPU without AVX2 the
        second token costs a full head read more than the first, the ones after little); else extrapolated
        from the two largest measured counts (from a prior slope before a second one)."""
        if tokens in self.verify:
            return self.verify[tokens]
        below = sorted(q for q in self.verify if q < tokens)
        above = [q for q in self.verify if q > tokens]
        if below and above:
            return self.verify[min(above)]
        if not below:
            nearest = min(above)
            plain = self.verify[nearest] / (1 + self.per_token * (nearest - 1))
            return plain * (1 + self.per_token * (tokens - 1))
        top = below[-1]
        if len(below) > 1:
            slope = max(0.0, (self.verify[top] - self.verify[below[-2]]) / (top - below[-2]))
        else:
            slope = self.per_token * self.verify[top] / (1 + self.per_token * (top - 1))
        return self.verify[top] + slope * (tokens - top)

    def draft_s(self, depth: int, layers: int) -> float:
        """A draft step of ``depth`` layers (of ``layers``): measured, else scaled from another depth or, before
        any, from a plain step by the share of layers (the head counted as a third of a step)."""
        if depth in self.draft:
            return self.draft[depth]
        if self.draft:
            nearest = min(self.draft, key=lambda d: abs(d - depth))
            return self.draft[nearest] * (0.3 + 0.7 * depth / max(nearest, 1))
        return self.verify_s(1) * (0.3 + 0.7 * depth / layers)


def _smooth(table: dict[int, float], key: int, seconds: float) -> None:
    """A running estimate of a cost that follows a lower time faster than a higher one: interference only ever
    adds time, so a fast observation is the better evidence (and a cold first call is soon forgotten)."""
    old = table.get(key)
    weight = SMOOTHING if old is None or seconds >= old else 1 - SMOOTHING
    table[key] = seconds if old is None else old + weight * (seconds - old)


class Calibration:
    """The chance the full model agrees with a drafted token, by the draft's own probability for it.

    Starts from "the probability is right" (a Beta prior of weight ``prior_weight`` at each
    bin's middle) and learns from every judged token: one whose earlier tokens in its cycle
    were all accepted.
    """

    def __init__(self, prior_weight: float = 4.0):
        middles = (np.arange(BINS) + 0.5) / BINS
        self.hits = middles * prior_weight
        self.seen = np.full(BINS, prior_weight)

    def chance(self, probability: float) -> float:
        b = min(int(probability * BINS), BINS - 1)
        return float(self.hits[b] / self.seen[b])

    def observe(self, probabilities: list[float], accepted: int) -> None:
        for j, p in enumerate(probabilities[: accepted + 1]):
            b = min(int(p * BINS), BINS - 1)
            if self.seen[b] >= CALIBRATION_MEMORY:  # halve old evidence, so the estimate keeps up with a new text
                self.hits[b], self.seen[b] = self.hits[b] / 2, self.seen[b] / 2
            self.seen[b] += 1
            self.hits[b] += j < accepted


class FixedPace:
    """Draft ``k`` tokens with the SkipDecode model every cycle: the classic speculative loop (with ``lookup``,
    a lookup proposal of every row replaces the draft)."""

    def __init__(self, k: int, lookup: PromptLookup | None, experience: "Experience", layers: int):
        self.k, self.lookup, self.layers = k, lookup, layers
        self.experience = experience
        self.costs = experience.costs

    def choose(self, cap: int, proposals, depth: int) -> Cycle:
        if cap <= 0:
            return PLAIN
        if self.lookup is not None and proposals and all(p for p, _ in proposals):
            return _lookup_cycle(proposals, min(self.k, cap))
        return Cycle("layers", min(self.k, cap))

    def keep_drafting(self, drafted: int, probability: float) -> bool:
        return True

    def observe(self, cycle: Cycle, probabilities: list[float], accepted: int) -> None:
        pass


class Agreement:
    """How often a source's proposals are accepted: its first token, and each later one once those before it were
    (a run of agreement tends to go on: copying from the prompt, or a stretch the draft finds easy)."""

    def __init__(self, first: float, later: float):
        self.first, self.later = Rate(first), Rate(later)

    def expected(self, count: int) -> float:
        """Expected accepted tokens of a proposal of ``count``."""
        f, g = self.first.value, self.later.value
        return sum(f * g ** j for j in range(count))

    def observe(self, proposed: int, accepted: int) -> None:
        self.first.observe(float(accepted > 0))
        for j in range(1, min(accepted + 1, proposed)):  # the later tokens that were judged
            self.later.observe(float(j < accepted))


# Before anything is measured: a SkipDecode draft's first token is accepted about 60% of the time on the validation
# half, later ones 80%; a lookup match of 3 tokens copies reliably, of 1 token rarely.
LOOKUP_PRIORS = {1: 0.2, 2: 0.35, 3: 0.5}


class MeasuredPace(FixedPace):
    """Draft only what is expected to pay, from the measured costs and acceptance (the module's docstring).

    ``k`` caps a SkipDecode draft; a lookup proposal, which costs nothing to draft, may be
    verified up to ``lookup_cap`` tokens, as far as its expected gain pays for them.
    """

    def __init__(self, k: int, lookup: PromptLookup | None, experience: "Experience", layers: int,
                 lookup_cap: int = 8):
        super().__init__(k, lookup, experience, layers)
        self.lookup_cap = lookup_cap
        self.draft, self.calibration, self.lookups = experience.draft, experience.calibration, experience.lookups
        self.wait = 0  # plain (or lookup) cycles left before drafting is probed again
        self.pause = 1  # the wait set after the next layers cycle that accepts nothing
        self.depth = layers
        self.survival = 1.0
        self.since_plain = 0  # cycles since the last plain step

    def choose(self, cap: int, proposals, depth: int) -> Cycle:
        if cap <= 0:
            return PLAIN
        self.depth = depth
        if not self.costs.known:  # the first cycle drafts: it is how the costs and the acceptance are first seen
            return Cycle("layers", min(self.k, cap))
        self.since_plain += 1
        if self.since_plain > MAX_WAIT or 1 not in self.costs.verify:
            # The other probe: a plain step now and then keeps its cost, which every choice is set against,
            # measured (drafting that always pays would otherwise never see it again).
            self.since_plain = 0
            self.wait -= 1
            return PLAIN
        plain_s = self.costs.verify_s(1)
        options = [(1.0 / plain_s, PLAIN)]
        draft_s = self.costs.draft_s(depth, self.layers)
        pays = self._draft_pays()
        if pays or self.wait <= 0:
            # Valued at its best length; how far it really drafts, ``keep_drafting`` decides token by token.
            rate = max(self._per_second(self.draft, count, count * draft_s) for count in range(1, self.k + 1))
            options.append((rate if pays else float("inf"), Cycle("layers", min(self.k, cap))))  # a probe drafts
        proposed = None
        if self.lookup is not None and proposals and all(p for p, _ in proposals):
            proposed = _lookup_cycle(proposals, min(self.lookup_cap, cap))
            options.append(self._lookup_option(proposed))
        choice = max(options, key=lambda option: option[0])[1]
        if choice is PLAIN:
            self.since_plain = 0
        if choice.source != "layers":
            self.wait -= 1
        elif proposed is not None:  # the draft takes the proposal's rest for free where it starts the same way
            choice = Cycle("layers", choice.count, proposed.tokens, proposed.ngram)
        return choice

    def _draft_pays(self) -> bool:
        """Whether one drafted token is expected to gain more than it costs: its chance of acceptance times a
        plain step, against a draft step at the current depth and one more token in the verify forward."""
        plain_s = self.costs.verify_s(1)
        cost = self.costs.draft_s(self.depth, self.layers) + self.costs.verify_s(2) - plain_s
        return self.draft.first.value * plain_s > cost

    def _lookup_source(self, ngram: int) -> Agreement:
        if ngram not in self.lookups:
            self.lookups[ngram] = Agreement(LOOKUP_PRIORS.get(ngram, max(LOOKUP_PRIORS.values())), 0.8)
        return self.lookups[ngram]

    def _lookup_option(self, cycle: Cycle) -> tuple[float, Cycle]:
        """The proposal cut to the length with the best expected tokens per second, and that rate."""
        source = self._lookup_source(cycle.ngram)
        best = max(range(1, cycle.count + 1), key=lambda length: self._per_second(source, length, 0.0))
        tokens = tuple(t[:best] for t in cycle.tokens)
        return self._per_second(source, best, 0.0), Cycle("lookup", best, tokens, cycle.ngram)

    def _per_second(self, source: Agreement, count: int, draft_s: float) -> float:
        """Expected tokens per second of a cycle that proposes ``count`` tokens from ``source``."""
        return (1.0 + source.expected(count)) / (draft_s + self.costs.verify_s(count + 1))

    def keep_drafting(self, drafted: int, probability: float) -> bool:
        """After ``drafted`` tokens, the last with draft probability ``probability``: draft one more?

        The drafted tokens survive with the product of their calibrated chances; the next
        one is then accepted as often as later drafted tokens have been (``Agreement.later``).
        """
        self.survival = (1.0 if drafted == 1 else self.survival) * self.calibration.chance(probability)
        if not self.costs.known:
            return True
        plain_s = self.costs.verify_s(1)
        extra = self.costs.verify_s(drafted + 2) - self.costs.verify_s(drafted + 1)
        gain = self.survival * self.draft.later.value * plain_s
        return gain > self.costs.draft_s(self.depth, self.layers) + extra

    def observe(self, cycle: Cycle, probabilities: list[float], accepted: int) -> None:
        """What the verify accepted of ``cycle`` (for a SkipDecode draft, its tokens' draft probabilities)."""
        if cycle.source == "layers":
            drafted = len(probabilities)  # a confirmed lookup proposal may have added tokens the layers never drafted
            self.calibration.observe(probabilities, min(accepted, drafted))
            self.draft.observe(drafted, min(accepted, drafted))
            # A probe that accepted something but still does not pay (a CPU whose verify forward grows fast with
            # its tokens) waits longer too, as one that accepted nothing does.
            self.pause = 1 if accepted and self._draft_pays() else min(2 * self.pause, MAX_WAIT)
            self.wait = self.pause
        elif cycle.source == "lookup":
            self._lookup_source(cycle.ngram).observe(cycle.count, accepted)


@dataclass
class Experience:
    """What an engine's exact runs have measured so far, kept from request to request (as a server learns): the
    costs, the draft's calibration, and how often each source's proposals are accepted. A run starts from it and
    goes on learning; the running means follow a new text within a few cycles."""

    costs: StepCosts = field(default_factory=StepCosts)
    calibration: Calibration = field(default_factory=Calibration)
    draft: Agreement = field(default_factory=lambda: Agreement(0.6, 0.8))
    lookups: dict[int, Agreement] = field(default_factory=dict)  # per matched n-gram length


def _lookup_cycle(proposals, cap: int) -> Cycle:
    """Every row's proposal, cut to the shortest row's length and ``cap``."""
    count = min(cap, min(len(p) for p, _ in proposals))
    return Cycle("lookup", count, tuple(tuple(p[:count]) for p, _ in proposals), min(n for _, n in proposals))


PACES = {"measured": MeasuredPace, "fixed": FixedPace}


__all__ = ["Agreement", "Calibration", "Cycle", "Experience", "FixedPace", "MeasuredPace", "PACES", "PLAIN",
           "PromptLookup", "StepCosts"]
