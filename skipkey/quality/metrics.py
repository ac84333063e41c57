"""Metrics: pure functions of recorded traces (and of token lists and texts)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np

from skipkey.skipdecode.rankings import compute_ratio, nominal_speedup
from skipkey.core.trace import Trace


def percentile(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


@dataclass(frozen=True)
class Speed:
    """Timings of one run: the one record of them (the CLI, ``bench`` and the app all report these).

    Decode figures exclude the prompt pass (token 0).
    """

    ttft_s: float
    decode_tokens: int
    decode_s: float
    tokens_per_s: float  # generated tokens per second over all rows, decode steps only
    ms_per_token_p50: float  # per decode step
    ms_per_token_p90: float

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_steps(cls, ttft_s: float, step_seconds: Sequence[float], rows: int) -> "Speed":
        """From the time to the first token and each decode step's seconds (``rows`` tokens a step)."""
        decode_s = float(sum(step_seconds))
        tokens = len(step_seconds) * rows
        return cls(
            ttft_s=ttft_s,
            decode_tokens=tokens,
            decode_s=decode_s,
            tokens_per_s=tokens / decode_s if decode_s > 0 else float("nan"),
            ms_per_token_p50=percentile(step_seconds, 50) * 1e3,
            ms_per_token_p90=percentile(step_seconds, 90) * 1e3,
        )


def speed(trace: Trace) -> Speed:
    return Speed.from_steps(trace.events[0].seconds if trace.events else float("nan"),
                            [e.seconds for e in trace.decode_events], trace.rows)


@dataclass(frozen=True)
class Compute:
    """Executed layers and what they save, from the decode steps' layer sets."""

    mean_layers: float  # decoder layers per decode step
    nominal_speedup: float  # L * n / sum |E(t)|: the layer stack alone
    compute_ratio: float  # the same, counting the LM head (and embedding), which never skip

    def as_dict(self) -> dict:
        return asdict(self)


def compute(trace: Trace) -> Compute:
    sets = [e.layers for e in trace.decode_events]
    if not sets:
        return Compute(float(trace.num_layers), 1.0, 1.0)
    L = trace.num_layers
    return Compute(mean_layers=sum(len(s) for s in sets) / len(sets),
                   nominal_speedup=nominal_speedup(sets, L),
                   compute_ratio=compute_ratio(sets, L, trace.layer_cost, trace.head_cost))


@dataclass(frozen=True)
class Transfer:
    """Weight bytes moved onto the compute devices per decode step, where a device map offloads weights.

    accelerate loads an offloaded module's weights before each of its forwards; a
    layer SkipDecode skips is never called, so it moves nothing. ``transfer_ratio``
    is full depth over this run: what the skip saves when moving weights dominates.
    """

    bytes_per_step: float  # mean over the decode steps
    full_bytes_per_step: float  # every layer, plus the parts that never skip
    transfer_ratio: float

    def as_dict(self) -> dict:
        return asdict(self)


def transfer(trace: Trace) -> Transfer | None:
    """The weight traffic of the decode steps, or None when nothing is offloaded."""
    per_layer, fixed = trace.layer_transfer_bytes, trace.fixed_transfer_bytes
    full = sum(per_layer) + fixed
    if not full:
        return None
    moved = [sum(per_layer[i] for i in e.layers) + fixed for e in trace.decode_events] or [full]
    mean = sum(moved) / len(moved)
    return Transfer(bytes_per_step=mean, full_bytes_per_step=float(full), transfer_ratio=full / mean)


@dataclass(frozen=True)
class StepCost:
    """Decode step time fitted as ``fixed + layers * per_layer`` (least squares over the steps).

    Where the compute ratio counts parameters, this measures: ``fixed_ms`` is what a
    step costs whatever it skips (LM head, sampling, the loop), ``ms_per_layer`` one
    decoder layer. Needs steps with different layer counts (a skipping schedule).
    """

    ms_per_layer: float
    fixed_ms: float

    def as_dict(self) -> dict:
        return asdict(self)


def step_cost(trace: Trace) -> StepCost | None:
    """The fitted step cost, or None when every decode step ran the same number of layers."""
    events = trace.decode_events
    layers = np.array([len(e.layers) for e in events], dtype=float)
    if len(events) < 2 or np.ptp(layers) == 0:
        return None
    seconds = np.array([e.seconds for e in events], dtype=float)
    slope, intercept = np.polyfit(layers, seconds, 1)
    return StepCost(ms_per_layer=float(slope) * 1e3, fixed_ms=float(intercept) * 1e3)


@dataclass(frozen=True)
class Traffic:
    """Bytes a decode step reads, on average: the weights of the layers it runs (and the LM head), plus
    the KV cache those layers hold. Decode is memory-bound, so the ratio of two runs' bytes per step is
    the speedup a machine's memory bandwidth allows: the limit a measured ratio is set against."""

    weight_bytes: float
    kv_bytes: float

    @property
    def total(self) -> float:
        return self.weight_bytes + self.kv_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "bytes_per_step": self.total}


def traffic(trace: Trace) -> Traffic | None:
    """Mean bytes per decode step, or None without decode steps or a known weight size."""
    events = trace.decode_events
    if not events or not trace.bytes_per_param:
        return None
    params = [len(e.layers) * trace.layer_cost + trace.head_cost for e in events]
    return Traffic(weight_bytes=float(np.mean(params)) * trace.bytes_per_param,
                   kv_bytes=float(np.mean([e.kv_bytes for e in events])))


@dataclass(frozen=True)
class Memory:
    kv_bytes_final: int
    kv_bytes_peak: int  # largest cache held after any step

    def as_dict(self) -> dict:
        return asdict(self)


def memory(trace: Trace) -> Memory:
    held = [e.kv_bytes for e in trace.events] or [0]
    return Memory(kv_bytes_final=held[-1], kv_bytes_peak=max(held))


@dataclass(frozen=True)
class Agreement:
    matching: float  # share of positions where both outputs hold the same token
    first_divergence: int | None  # index of the first differing token, None if identical

    def as_dict(self) -> dict:
        return asdict(self)


def agreement(reference: list[int], candidate: list[int]) -> Agreement:
    """Position-wise agreement; a token one side lacks counts as a mismatch."""
    length = max(len(reference), len(candidate))
    if length == 0:
        return Agreement(1.0, None)
    same = [a == b for a, b in zip(reference, candidate)]
    first = next((i for i, s in enumerate(same) if not s), None)
    if first is None and len(reference) != len(candidate):
        first = len(same)
    return Agreement(matching=sum(same) / length, first_divergence=first)


def rouge_l(reference: str, candidate: str) -> float:
    """ROUGE-L F-measure (``rouge-score``, the reference implementation). Two texts with no word ROUGE counts
    (it keeps ASCII letters and digits: an empty text, punctuation) are the same empty sequence: 1, where
    rouge-score says 0, so a text always scores 1 against itself."""
    from rouge_score import rouge_scorer, tokenize

    if not tokenize.tokenize(reference, None) and not tokenize.tokenize(candidate, None):
        return 1.0
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    return float(scorer.score(reference, candidate)["rougeL"].fmeasure)


def kv_share(trace: Trace, reference: Trace) -> float:
    """KV bytes held after the same number of tokens, as a share of the reference run's.

    Compared at the same step: a side that ran longer (the other stopped at EOS) holds
    more tokens, which says nothing about its policy.
    """
    step = min(len(trace.events), len(reference.events)) - 1
    if step < 0 or not reference.events[step].kv_bytes:
        return float("nan")
    return trace.events[step].kv_bytes / reference.events[step].kv_bytes


def jsonable(value):
    """``value`` as JSON takes it: tuples as lists, numpy scalars as numbers, NaN and infinities as None."""
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def trace_record(trace: Trace) -> dict:
    """A trace as JSON-ready data: its constants and every step's event.

    Each event keeps all its fields but ``kept`` (per layer, the positions the cache
    holds: a heatmap's worth of arrays each step); ``kv_bytes`` and ``cache_lengths``
    say how much it held.
    """
    constants = {f.name: jsonable(getattr(trace, f.name)) for f in fields(trace) if f.name != "events"}
    events = [{f.name: jsonable(getattr(event, f.name)) for f in fields(event) if f.name != "kept"}
              for event in trace.events]
    return dict(constants, events=events)


@dataclass(frozen=True)
class Acceptance:
    """How exact decoding's drafts fared (``skipkey.skipdecode.exact``), over the rows still generating."""

    verify_steps: int
    drafted: int  # drafted tokens, summed over verify steps and rows
    accepted: int  # of those, the ones the full model agreed with (each row's own leading run)
    rejected: int  # verify steps and rows where a drafted token was rejected
    acceptance: float  # accepted / drafted (nan when nothing was drafted)
    # accepted / (accepted + rejected): the chance the full model agrees with a drafted token once it agreed
    # with every one before it. The byte model's ``a`` (drafts after a rejection are never judged, so
    # ``acceptance`` understates it for k > 1).
    agreement: float
    tokens_per_verify_step: float  # decode tokens per row and verify step
    mean_draft_length: float
    # Where the drafts came from: verify steps drafted by prompt lookup, and plain steps (nothing drafted).
    lookup_steps: int = 0
    plain_steps: int = 0
    lookup_accepted: int = 0  # of ``accepted``, the tokens prompt lookup proposed

    def as_dict(self) -> dict:
        return asdict(self)


def acceptance(trace: Trace) -> Acceptance | None:
    """The drafts' acceptance and tokens per verify step of an exact run, or None for any other run."""
    events = trace.events
    steps = [i for i, e in enumerate(events) if e.drafted is not None]
    if not steps:
        return None
    drafted = accepted = rejected = from_lookup = 0
    for i in steps:
        generating = [not done for done in events[i - 1].finished]
        drafted += events[i].drafted * sum(generating)
        got = sum(a for a, live in zip(events[i].accepted, generating) if live)
        accepted += got
        from_lookup += got if events[i].draft_source == "lookup" else 0
        rejected += sum(a < events[i].drafted for a, live in zip(events[i].accepted, generating) if live)
    return Acceptance(verify_steps=len(steps), drafted=drafted, accepted=accepted, rejected=rejected,
                      acceptance=accepted / drafted if drafted else float("nan"),
                      agreement=accepted / (accepted + rejected) if accepted + rejected else float("nan"),
                      tokens_per_verify_step=len(trace.decode_events) / len(steps),
                      mean_draft_length=float(np.mean([events[i].drafted for i in steps])),
                      lookup_steps=sum(events[i].draft_source == "lookup" for i in steps),
                      plain_steps=sum(events[i].drafted == 0 for i in steps), lookup_accepted=from_lookup)


def speculative_speedup(acceptance_rate: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """The byte model's speedup of drafting ``k`` and verifying them, against plain full decode steps.

    Costs are in full decode steps: ``draft_cost`` one draft step, ``verify_cost`` one
    forward over ``k + 1`` tokens. With acceptance ``a`` per drafted token a cycle
    yields ``(1 - a^(k+1)) / (1 - a)`` tokens and costs ``k * draft + verify``.
    """
    a = acceptance_rate
    tokens = k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
    return tokens / (k * draft_cost + verify_cost)


@dataclass(frozen=True)
class VerifyCosts:
    """Measured costs of exact decoding's parts, in seconds: one draft step, and one verify forward over
    ``verified`` tokens (the most any verify step of the run fed: ``k + 1`` for a fixed ``k``)."""

    draft_s: float
    verify_s: float
    verified: int

    def as_dict(self) -> dict:
        return asdict(self)


def verify_costs(trace: Trace, drafted: int | None = None) -> VerifyCosts | None:
    """From an exact run's verify steps: the SkipDecode model's drafting time per token it drafted, and the
    verify forward's time (a step's time less its drafting) over the steps that drafted ``drafted`` tokens
    (default, or where none did: the most any step drafted). None for other runs, or when the SkipDecode model
    drafted nothing."""
    events = trace.events
    steps = [i for i, e in enumerate(events) if e.drafted is not None] + [len(events)]
    cycles = [(events[a].drafted, events[a].draft_seconds, sum(e.seconds for e in events[a:b]))
              for a, b in zip(steps, steps[1:])]
    # The layers' own draft steps (a confirmed lookup proposal adds tokens no layer drafted).
    by_layers = [(len(events[a].draft_layers), events[a].draft_seconds) for a in steps[:-1]
                 if events[a].draft_source == "layers"]
    layer_steps = sum(d for d, _ in by_layers)
    if not layer_steps:
        return None
    counts = {d for d, _, _ in cycles}
    most = drafted if drafted in counts else max(counts)
    return VerifyCosts(draft_s=sum(s for _, s in by_layers) / layer_steps,
                       verify_s=float(np.median([t - s for d, s, t in cycles if d == most])), verified=most + 1)
