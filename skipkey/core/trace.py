"""A recorded run: the engine's events plus what is needed to interpret them.

Figures (``skipkey.quality.figures``) and metrics (``skipkey.quality.metrics``) are pure
functions of a ``Trace``; nothing downstream reaches into the engine.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from skipkey.core.engine import Engine, StepEvent


@dataclass
class Trace:
    """Events of one ``Engine.generate`` call, in order."""

    num_layers: int
    layer_cost: float  # parameters per decoder layer (mean): compute per token per layer
    head_cost: float  # LM-head parameters: compute per token that never skips
    label: str = ""
    bytes_per_param: float = 0.0  # of the weights, for the bytes a step reads (0: unknown)
    events: list[StepEvent] = field(default_factory=list)
    stopped: bool = False
    # Under a device map that offloads weights: the bytes one run of each decoder layer moves onto its
    # compute device, and those of everything a step runs whatever it skips (embedding, norm, LM head).
    layer_transfer_bytes: tuple[int, ...] = ()
    fixed_transfer_bytes: int = 0

    @classmethod
    def for_engine(cls, engine: Engine, label: str = "") -> "Trace":
        arch = engine.arch
        layer_cost = sum(arch.layer_params(i) for i in range(arch.num_layers)) / arch.num_layers
        return cls(num_layers=arch.num_layers, layer_cost=float(layer_cost),
                   head_cost=float(arch.lm_head_params), label=label,
                   bytes_per_param=float(next(engine.model.parameters()).element_size()),
                   layer_transfer_bytes=tuple(arch.layer_transfer_bytes(i) for i in range(arch.num_layers)),
                   fixed_transfer_bytes=arch.fixed_transfer_bytes())

    @classmethod
    def collect(cls, engine: Engine, prompts, settings=None, *, stop: threading.Event | None = None,
                record: bool = False, label: str = "", prompt_pass=None) -> "Trace":
        """Run ``engine`` on ``prompts``; ``prompt_pass``: start from that recorded pass (``Engine.prompt_pass``)."""
        trace = cls.for_engine(engine, label)
        for event in engine.generate(prompts, settings, stop=stop, record=record, prompt_pass=prompt_pass):
            trace.add(event)
        trace.stopped = stop is not None and stop.is_set()
        return trace

    def add(self, event: StepEvent) -> None:
        self.events.append(event)

    # -- views ----------------------------------------------------------------
    @property
    def rows(self) -> int:
        return len(self.events[0].tokens) if self.events else 0

    @property
    def prompt_lengths(self) -> tuple[int, ...]:
        return self.events[0].prompt_lengths if self.events else ()

    def tokens(self, row: int = 0) -> list[int]:
        """Generated ids of ``row``, up to and including its EOS."""
        out = []
        for event in self.events:
            out.append(event.tokens[row])
            if event.finished[row]:
                break
        return out

    def text(self, row: int = 0) -> str:
        return "".join(event.texts[row] for event in self.events)

    def token_texts(self, tokenizer, row: int = 0) -> list[str]:
        return [tokenizer.decode([t]) for t in self.tokens(row)]

    @property
    def layer_sets(self) -> list[tuple[int, ...]]:
        """Layers run to produce each token (all for token 0)."""
        return [event.layers for event in self.events]

    @property
    def decode_events(self) -> list[StepEvent]:
        return self.events[1:]


def lockstep(streams: Sequence[Iterator[StepEvent]], traces: Sequence[Trace], first_round: int = 0
             ) -> Iterator[None]:
    """Step two engines' event streams in turns, one event each per round, adding each event to its trace.

    The fairest comparison two runs can have on one machine: whatever the machine is
    doing, it does it to both, a step apart, and each side's timings are its own steps
    only (``StepEvent.seconds`` does not count the time a stream waits at its yield).
    Which stream steps first changes from round to round (``step_order``), so work that
    lands right after a round falls on both alike. Yields after every round that added
    an event; a stream that ends drops out. Closing the streams is the caller's.
    ``first_round`` offsets the sequence: repeated comparisons that start from
    successive offsets also alternate who runs the first step (the prompt pass).
    """
    live = [True] * len(streams)
    for round_ in itertools.count(first_round):
        added = False
        for side in step_order(round_):
            if live[side]:
                event = next(streams[side], None)
                if event is None:
                    live[side] = False
                else:
                    traces[side].add(event)
                    added = True
        if not added:
            return
        yield


def run_lockstep(streams: Sequence[Iterator[StepEvent]], traces: Sequence[Trace], first_round: int = 0) -> None:
    """``lockstep`` to the end, then close the streams (also when a step raises)."""
    try:
        for _ in lockstep(streams, traces, first_round):
            pass
    finally:
        for stream in streams:
            stream.close()


def step_order(round_: int) -> tuple[int, int]:
    """Which of two streams (0 or 1) steps first in round ``round_``.

    A plain alternation hands every redraw to the same side whenever the page
    redraws every even number of rounds. The golden-ratio (Weyl) sequence instead
    is equidistributed along every arithmetic progression of rounds, so whatever
    the redraw cadence, the round after each redraw starts with either side half
    of the time.
    """
    return (1, 0) if (round_ * _GOLDEN) % 1.0 >= 0.5 else (0, 1)


_GOLDEN = (5 ** 0.5 - 1) / 2
