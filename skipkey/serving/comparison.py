"""The comparison: the full model and SkipKey interleaved step by step, and the text under each column.

* ``compare`` runs the full model and SkipKey interleaved step by step on one
  device, each side timed by its own steps only, and yields both traces.
* ``side_metrics`` / ``agreement_summary`` turn traces into the text under each column.
* ``thin_history`` / ``recorded_step``: what a finished run keeps for the step slider.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass
from typing import Iterator

from skipkey.core.engine import Engine
from skipkey.core.loading import LoadedModel
from skipkey.core.trace import Trace, lockstep
from skipkey.errors import InputError
from skipkey.quality.metrics import (Acceptance, Compute, Speed, Transfer, acceptance, agreement, compute, kv_share,
                                     memory, rouge_l, speed, traffic, transfer)
from skipkey.serving.request import ComparisonRequest, fmt
from skipkey.skipdecode.exact import TIE_TOLERANCE

def prompt_token_texts(loaded: LoadedModel, prompt: str) -> list[str]:
    """Each prompt token as text, as the engine encodes the prompt (the retention heatmap's labels)."""
    ids = loaded.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    return [loaded.tokenizer.decode([i]) for i in ids]


FULL_LABEL, SKIPKEY_LABEL = "Full model", "SkipKey"


def compare(loaded: LoadedModel, request: ComparisonRequest, stop: threading.Event | None = None,
            tuned: LoadedModel | None = None) -> Iterator[tuple[Trace, Trace]]:
    """Full model and SkipKey, interleaved one step each on the same device.

    The full side always runs ``loaded``; SkipKey's side runs ``tuned`` (the
    same model with its SkipDecode adapter merged) when the request asks for it.

    Alternating ``next()`` on the two generators keeps both under the same machine
    load, and each side's timings are its own steps only (``StepEvent.seconds``).
    Which side steps first changes from round to round (``trace.step_order``): work
    that lands right after an update (the browser redrawing the page on this
    machine) then falls on both sides alike.
    Yields the two (growing) traces after every pair of steps. ``stop`` ends both;
    closing this generator closes both engine loops, which frees their caches.
    """
    if request.tuned and tuned is None:
        raise InputError("this request asks for the tuned weights: pass the tuned model")
    full = Engine(loaded)
    accelerated = Engine(tuned if request.tuned else loaded, skip=request.skip, kv=request.kv, exact=request.exact)
    traces = (Trace.for_engine(full, FULL_LABEL), Trace.for_engine(accelerated, SKIPKEY_LABEL))
    # Only SkipKey's kept positions are drawn; the full model's would cost memory for nothing.
    streams = [full.generate([request.prompt], request.settings, stop=stop, record=False),
               accelerated.generate([request.prompt], request.settings, stop=stop, record=True)]
    try:
        for _ in lockstep(streams, traces):
            yield traces
        for trace in traces:
            trace.stopped = stop is not None and stop.is_set()
        yield traces
    finally:
        for stream in streams:
            stream.close()


HISTORY_STEPS = 128  # steps whose kept positions a finished run holds for the step slider


def thin_history(trace: Trace, steps: int = HISTORY_STEPS) -> Trace:
    """A copy of ``trace`` holding kept positions for at most ``steps`` evenly spaced steps and the last.

    What a session keeps after its run, for the retention slider: bounded whatever the run's length.
    """
    n = len(trace.events)
    stride = max(1, math.ceil(n / steps))
    keep = set(range(0, n, stride)) | {n - 1}
    events = [e if i in keep or e.kept is None else dataclasses.replace(e, kept=None)
              for i, e in enumerate(trace.events)]
    return dataclasses.replace(trace, events=events)


def recorded_step(trace: Trace, step: int) -> int:
    """The latest step at or before ``step`` (clamped to the run) whose kept positions are held."""
    step = min(max(0, step), len(trace.events) - 1)
    while step > 0 and trace.events[step].kept is None:
        step -= 1
    return step


@dataclass(frozen=True)
class SideMetrics:
    """The numbers under one column: the metrics' records, plus the KV share and the measured speedup."""

    speed: Speed
    kv_mb: float
    kv_percent: float
    compute: Compute | None = None  # SkipKey's side only
    measured_speedup: float | None = None
    traffic_ratio: float | None = None  # the full model's bytes read per step over SkipKey's
    moved: Transfer | None = None  # where a device map offloads weights
    verified: Acceptance | None = None  # exact mode: the drafts' acceptance and tokens per verify step
    full_ttft_s: float | None = None  # SkipKey's side: the full model's prompt pass, beside its own

    @property
    def prompt_ratio(self) -> float | None:
        """SkipKey's prompt pass over the full model's: what scoring the prompt for eviction costs."""
        if self.full_ttft_s is None or not self.full_ttft_s > 0:
            return None
        return self.speed.ttft_s / self.full_ttft_s

    def markdown(self) -> str:
        s = self.speed
        first = f"first token **{fmt(s.ttft_s, '{:.2f}')}** s"
        if self.full_ttft_s is not None:
            first += (f" (full model **{fmt(self.full_ttft_s, '{:.2f}')}** s: "
                      f"**{fmt(self.prompt_ratio, '{:.2f}')}x**)")
        lines = [
            f"**{fmt(s.tokens_per_s, '{:.1f}')}** tokens/s · **{fmt(s.ms_per_token_p50, '{:.0f}')}** ms/token "
            f"· {first}",
            f"KV cache **{fmt(self.kv_mb, '{:.2f}')}** MB ({fmt(self.kv_percent, '{:.0f}')}% of full)",
        ]
        if self.compute is not None:
            lines.append(f"**{fmt(self.compute.mean_layers, '{:.1f}')}** layers/token · nominal speedup "
                         f"**{fmt(self.compute.nominal_speedup, '{:.2f}')}x** · compute ratio "
                         f"**{fmt(self.compute.compute_ratio, '{:.2f}')}x** · bytes per step "
                         f"**{fmt(self.traffic_ratio, '{:.2f}')}x** · measured "
                         f"**{fmt(self.measured_speedup, '{:.2f}')}x**")
        if self.moved is not None:
            lines.append(f"weights moved **{fmt(self.moved.bytes_per_step / 2**20, '{:.0f}')}** MiB/token"
                         + (f" · transfer ratio **{fmt(self.moved.transfer_ratio, '{:.2f}')}x**"
                            if self.compute is not None else ""))
        if self.verified is not None:
            lines.append(f"exact: **{fmt(self.verified.tokens_per_verify_step, '{:.2f}')}** tokens per verify step "
                         f"· acceptance **{fmt(self.verified.acceptance, '{:.0%}')}** of "
                         f"{self.verified.drafted} drafted tokens")
        return "  \n".join(lines)


def side_metrics(trace: Trace, reference: Trace | None = None) -> SideMetrics:
    """``reference`` (the full model's trace) makes this the SkipKey side: shares and speedups."""
    timing = speed(trace)
    held = memory(trace).kv_bytes_final
    if reference is None:
        return SideMetrics(timing, held / 1e6, 100.0 if trace.events else float("nan"), moved=transfer(trace))
    ref_timing = speed(reference)
    verified = acceptance(trace)
    # A step's time per token (the median, robust to a stray pause); exact mode shares a verify step's time among
    # its tokens, so there the decode throughput is the fair ratio.
    measured = float("nan")
    if timing.decode_tokens and ref_timing.decode_tokens:
        measured = (timing.tokens_per_s / ref_timing.tokens_per_s if verified is not None
                    else ref_timing.ms_per_token_p50 / timing.ms_per_token_p50)
    ours, theirs = traffic(trace), traffic(reference)
    return SideMetrics(timing, held / 1e6, 100.0 * kv_share(trace, reference), compute=compute(trace),
                       measured_speedup=measured, moved=transfer(trace), verified=verified,
                       traffic_ratio=theirs.total / ours.total if ours and theirs else None,
                       full_ttft_s=ref_timing.ttft_s)


def agreement_summary(full: Trace, accelerated: Trace, tokenizer=None, final: bool = False) -> str:
    """Token agreement and the first divergence (over the tokens both sides have while streaming);
    ROUGE-L of the texts once both are done."""
    reference, candidate = full.tokens(), accelerated.tokens()
    if not final:
        shared = min(len(reference), len(candidate))
        reference, candidate = reference[:shared], candidate[:shared]
    match = agreement(reference, candidate)
    text = f"**Agreement:** {match.matching:.0%} of {max(len(reference), len(candidate))} tokens match"
    i = match.first_divergence
    if i is None:
        text += " · no divergence"
    else:
        text += f" · first divergence at token {i}"
        if tokenizer is not None and i < min(len(reference), len(candidate)):
            text += f" ({tokenizer.decode([reference[i]])!r} vs {tokenizer.decode([candidate[i]])!r})"
        margin = accelerated.events[i].margin if i < len(accelerated.events) else None
        if margin is not None and margin[0] <= TIE_TOLERANCE:
            text += (f": a numerical tie, not a difference (the full model's two best logits there are "
                     f"{margin[0]:.3f} apart, within rounding of {TIE_TOLERANCE:g}; a verify forward rounds "
                     "several positions at once)")
    if final:
        text += f" · ROUGE-L **{rouge_l(full.text(), accelerated.text()):.2f}**"
    return text
