"""Quality as served: each prompt run the way the app and ``generate`` run it, scored per prompt.

The app and the CLI serve one prompt at a time, so the importance ranking that
decides which layers a step skips comes from that prompt alone. A batched
evaluation ranks the layers on the whole batch and can flatter (or hurt) a
prompt. Here every prompt is teacher-forced through the engine's own cached
decode at ``batch`` prompts per call (1 = as served), its full-model
continuation forced token by token, and the figures are means over prompts with
95% bootstrap intervals (resampling prompts, so a few easy prompts cannot
narrow the interval).

Perplexity is ``exp`` of the mean NLL over every forced token; next-token
accuracy the share of positions where the config's own argmax is the forced
token (no drift after a first mismatch).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Sequence

from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.core.trace import Trace

BOOTSTRAP_RESAMPLES = 2000


@dataclass(frozen=True)
class PromptScore:
    """One prompt under one config: summed NLL and hits over its ``count`` forced tokens."""

    nll: float
    hits: int
    count: int


def chunks(items: Sequence, size: int) -> list[Sequence]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def full_continuations(loaded, prompts: Sequence[str], max_new_tokens: int, batch: int) -> list[list[int]]:
    """The full model's greedy continuation of each prompt, ``max_new_tokens`` long (EOS ignored)."""
    settings = GenerationSettings(max_new_tokens=max_new_tokens, ignore_eos=True)
    out: list[list[int]] = []
    for group in chunks(list(prompts), batch):
        trace = Trace.collect(Engine(loaded), list(group), settings)
        out += [trace.tokens(r) for r in range(len(group))]
    return out


def prompt_scores(engine: Engine, prompts: Sequence[str], continuations: Sequence[Sequence[int]],
                  batch: int) -> list[PromptScore]:
    """Each prompt's forced continuation through ``engine``, ``batch`` prompts per decode."""
    scores: list[PromptScore] = []
    for group, forced in zip(chunks(list(prompts), batch), chunks(list(continuations), batch)):
        nll, hits, count = [0.0] * len(group), [0] * len(group), [0] * len(group)
        for event in engine.generate(list(group), forced=[list(f) for f in forced]):
            for r, (logprob, greedy, token) in enumerate(zip(event.logprobs, event.greedy, event.tokens)):
                nll[r] -= logprob
                hits[r] += greedy == token
                count[r] += 1
        scores += [PromptScore(n, h, c) for n, h, c in zip(nll, hits, count)]
    return scores


def accuracy(scores: Sequence[PromptScore]) -> float:
    return sum(s.hits for s in scores) / sum(s.count for s in scores)


def perplexity(scores: Sequence[PromptScore]) -> float:
    return math.exp(sum(s.nll for s in scores) / sum(s.count for s in scores))


def bootstrap_interval(scores: Sequence, statistic: Callable[[Sequence], float],
                       resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of ``statistic`` over prompts resampled with replacement (``scores``:
    one item per prompt, a ``PromptScore`` or a number)."""
    rng = random.Random(seed)
    values = sorted(statistic(rng.choices(scores, k=len(scores))) for _ in range(resamples))
    return values[int(0.025 * (resamples - 1))], values[int(round(0.975 * (resamples - 1)))]


def summary(scores: Sequence[PromptScore]) -> dict:
    """Accuracy and perplexity with their 95% intervals over prompts."""
    return dict(prompts=len(scores), tokens=sum(s.count for s in scores),
                next_token_accuracy=accuracy(scores),
                next_token_accuracy_ci95=bootstrap_interval(scores, accuracy),
                ppl_of_full_continuations=perplexity(scores),
                ppl_of_full_continuations_ci95=bootstrap_interval(scores, perplexity))


def served_quality(loaded, configs: Sequence[tuple[str, object, object]], prompt_sets: dict[str, Sequence[str]],
                   max_new_tokens: int, batches: Sequence[int], log=print) -> list[dict]:
    """One row per (prompt set, batch, config): ``configs`` are ``(label, model, skip)``; ``prompt_sets`` maps a
    split's name to its prompts. The full model's continuations are made once per set (batched: the engine
    gives each row what it gets alone)."""
    rows = []
    for split, prompts in prompt_sets.items():
        refs = full_continuations(loaded, prompts, max_new_tokens, max(batches))
        log(f"{split}: {len(prompts)} full continuations of {max_new_tokens} tokens")
        for batch in batches:
            for label, model, skip in configs:
                scores = prompt_scores(Engine(model, skip=skip), prompts, refs, batch)
                row = dict(split=split, batch=batch, config=label, **summary(scores),
                           per_prompt=[[s.nll, s.hits, s.count] for s in scores])
                rows.append(row)
                log(f"  {split} batch {batch} {label}: accuracy {row['next_token_accuracy']:.3f} "
                    f"{_ci(row['next_token_accuracy_ci95'], 3)}, PPL {row['ppl_of_full_continuations']:.2f} "
                    f"{_ci(row['ppl_of_full_continuations_ci95'], 2)}")
    return rows


def _ci(interval, digits: int) -> str:
    return f"[{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"
