"""Speed on prompts people wrote: every contender on every prompt, whole requests, interleaved, against generate.

Spec-Bench's protocol (greedy, batch 1, one prompt at a time, the whole request timed,
the output checked against plain decoding): each prompt runs every contender in turn,
``repeats`` times with the order rotated, so whatever the machine does lands on all of
them alike. A contender's speedup on a prompt is the median over repeats of
``model.generate``'s seconds over its own, from the same repeat; a category's and the
overall figure are geometric means of those per-prompt speedups. Tokens per verify step
(Spec-Bench's "mean accepted tokens") counts the full model's forwards after the prompt
pass: a hook on the last decoder layer for ``generate``'s own speculative modes (an early
exit draft never reaches it), the trace for SkipKey's.

Contenders: ``model.generate``; its exact speedups (``prompt_lookup_num_tokens``,
``assistant_early_exit``), reported as not supported where the model refuses them; SkipKey's
engines (full, exact or accelerated).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from skipkey.config import GenerationSettings
from skipkey.core.architectures import get_architecture
from skipkey.core.engine import Engine
from skipkey.core.trace import Trace
from skipkey.quality.metrics import acceptance

GENERATE = "generate"


@dataclass
class Contender:
    """One way of answering a prompt: ``model.generate`` with ``options``, or a SkipKey engine."""

    label: str
    engine: Engine | None = None
    options: dict = field(default_factory=dict)
    refused: str | None = None  # why the model cannot run it (then it is reported, never run again)

    def run(self, loaded, ids: list[int], settings: GenerationSettings) -> "Outcome":
        if self.engine is not None:
            return _run_engine(self.engine, ids, settings)
        return _run_generate(loaded, ids, settings, self.options)


@dataclass(frozen=True)
class Outcome:
    """One whole request: the new tokens, its seconds, and the full model's forwards after the prompt pass."""

    tokens: list[int]
    seconds: float
    verify_steps: int


def _run_engine(engine: Engine, ids: list[int], settings: GenerationSettings) -> Outcome:
    start = time.perf_counter()
    trace = Trace.collect(engine, [ids], settings)
    seconds = time.perf_counter() - start
    verified = acceptance(trace)
    steps = verified.verify_steps if verified is not None else len(trace.decode_events)
    return Outcome(trace.tokens(), seconds, steps)


def _run_generate(loaded, ids: list[int], settings: GenerationSettings, options: dict) -> Outcome:
    model = loaded.model
    last = get_architecture(model).layers[-1]
    calls = [0]
    hook = last.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    tensor = torch.tensor([ids], device=loaded.device)
    try:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(tensor, attention_mask=torch.ones_like(tensor), do_sample=False,
                                 max_new_tokens=settings.max_new_tokens,
                                 min_new_tokens=settings.max_new_tokens if settings.ignore_eos else None, **options)
        seconds = time.perf_counter() - start
    finally:
        hook.remove()
    return Outcome(out[0, len(ids):].tolist(), seconds, max(1, calls[0] - 1))


@dataclass
class PromptRun:
    """One prompt's outcomes, per contender, per repeat."""

    record: object  # skipkey.quality.prompt_file.PromptRecord
    token_ids: tuple[int, ...]  # its token ids
    outcomes: dict[str, list[Outcome]] = field(default_factory=dict)
    margins: dict[str, float] = field(default_factory=dict)  # ``divergence_margins``

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)


def run_prompt_bench(loaded, contenders: list[Contender], records, token_ids: list[list[int]],
                     settings: GenerationSettings, repeats: int = 2, log=print) -> list[PromptRun]:
    """Every contender on every prompt, ``repeats`` times, the order rotated each time."""
    _warm_up(loaded, contenders, token_ids[0], log)
    runs = []
    live = [c for c in contenders if c.refused is None]
    for index, (record, ids) in enumerate(zip(records, token_ids)):
        run = PromptRun(record, tuple(ids), {c.label: [] for c in live})
        for r in range(repeats):
            shift = (index + r) % len(live)
            for contender in live[shift:] + live[:shift]:
                gc.collect()
                run.outcomes[contender.label].append(contender.run(loaded, ids, settings))
        runs.append(run)
        base = statistics.median(o.seconds for o in run.outcomes[GENERATE])
        log(f"  {record.id} {record.category} ({len(ids)} tokens): " + "; ".join(
            f"{label} {base / statistics.median(o.seconds for o in outs):.2f}x"
            for label, outs in run.outcomes.items() if label != GENERATE))
    return runs


def _warm_up(loaded, contenders: list[Contender], ids: list[int], log) -> None:
    """A short run of each contender first (thread pools, lazily built tables); a refusal is recorded."""
    short = GenerationSettings(max_new_tokens=4, ignore_eos=True)
    for contender in contenders:
        try:
            contender.run(loaded, ids[:32], short)
        except Exception as error:  # transformers refuses an assistant mode a model lacks in many ways
            if contender.engine is not None:
                raise
            contender.refused = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
            log(f"  {contender.label}: not supported by this model ({contender.refused})")


def summarise(runs: list[PromptRun], contenders: list[Contender], full: str | None) -> dict:
    """Per prompt, per category and overall: speedups over ``generate`` (and ``full``), tokens per verify
    step, and whether the tokens were ``generate``'s."""
    prompts = [_prompt_row(run, full) for run in runs]
    categories = list(dict.fromkeys(p["category"] for p in prompts))
    rows = [_group_row(c, [p for p in prompts if p["category"] == c], contenders) for c in categories]
    return {"prompts": prompts, "categories": rows, "overall": _group_row("overall", prompts, contenders),
            "refused": {c.label: c.refused for c in contenders if c.refused}}


def _prompt_row(run: PromptRun, full: str | None) -> dict:
    base = run.outcomes[GENERATE]
    reference = base[0].tokens
    row = {"id": run.record.id, "category": run.record.category, "prompt_tokens": run.prompt_tokens, "contenders": {}}
    for label, outcomes in run.outcomes.items():
        tokens = outcomes[0].tokens
        diverge = _first_difference(reference, tokens)
        row["contenders"][label] = {
            "seconds": [o.seconds for o in outcomes],
            "vs_generate": statistics.median(g.seconds / o.seconds for g, o in zip(base, outcomes)),
            "vs_full": (statistics.median(f.seconds / o.seconds for f, o in zip(run.outcomes[full], outcomes))
                        if full in run.outcomes else None),
            "tokens_per_verify_step": (len(tokens) - 1) / outcomes[0].verify_steps,
            "identical": diverge is None, "first_divergence": diverge,
            "margin_at_divergence": run.margins.get(label)}
    return row


def _group_row(name: str, prompts: list[dict], contenders: list[Contender]) -> dict:
    out = {"category": name, "prompts": len(prompts), "contenders": {}}
    for contender in contenders:
        cells = [p["contenders"][contender.label] for p in prompts if contender.label in p["contenders"]]
        if not cells:
            continue
        out["contenders"][contender.label] = {
            "vs_generate": geometric_mean([c["vs_generate"] for c in cells]),
            "vs_full": (geometric_mean([c["vs_full"] for c in cells]) if all(c["vs_full"] for c in cells)
                        else None),
            "lowest_vs_generate": min(c["vs_generate"] for c in cells),
            "tokens_per_verify_step": statistics.fmean(c["tokens_per_verify_step"] for c in cells),
            "identical": sum(c["identical"] for c in cells)}
    return out


def divergence_margins(loaded, runs: list[PromptRun], settings: GenerationSettings) -> None:
    """Where a contender's tokens left ``generate``'s: the gap between ``generate``'s two best logits there, in
    logits, stored in each prompt's row (untimed; one more ``generate`` per prompt that diverged). A gap within
    rounding is a numerical tie: a verify forward over several tokens rounds differently from one at a time."""
    for run in runs:
        diverged = {label: i for label, outcomes in run.outcomes.items()
                    if (i := _first_difference(run.outcomes[GENERATE][0].tokens, outcomes[0].tokens)) is not None}
        if not diverged:
            continue
        ids = torch.tensor([list(run.token_ids)], device=loaded.device)
        with torch.inference_mode():
            out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=settings.max_new_tokens, output_logits=True,
                                        return_dict_in_generate=True,
                                        min_new_tokens=settings.max_new_tokens if settings.ignore_eos else None)
        run.margins = {}
        for label, step in diverged.items():
            if step < len(out.logits):
                top = torch.topk(out.logits[step][0].float(), 2).values
                run.margins[label] = float(top[0] - top[1])


def _first_difference(reference: list[int], tokens: list[int]) -> int | None:
    found = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), None)
    if found is None and len(reference) != len(tokens):
        return min(len(reference), len(tokens))
    return found


def geometric_mean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def format_tables(summary: dict, labels: list[str]) -> str:
    """Markdown: speedup over ``generate`` per category (geometric mean), tokens per verify step, and how many
    prompts' outputs were ``generate``'s."""
    shown = [label for label in labels if label != GENERATE and label not in summary["refused"]]
    rows = summary["categories"] + [summary["overall"]]

    def table(title: str, cell, overall: str) -> list[str]:
        lines = [f"| {title} | prompts | " + " | ".join(shown) + " |", "|---|---|" + "---|" * len(shown)]
        for row in rows:
            name = f"**{overall}**" if row is summary["overall"] else row["category"]
            lines.append(f"| {name} | {row['prompts']} | "
                         + " | ".join(cell(row, row["contenders"][label]) for label in shown) + " |")
        return lines

    out = table("speedup over generate", lambda row, c: f"{c['vs_generate']:.2f}x", "all (geometric mean)")
    out += [""] + table("tokens per verify step", lambda row, c: f"{c['tokens_per_verify_step']:.2f}", "all (mean)")
    out += [""] + table("output = generate's", lambda row, c: f"{c['identical']}/{row['prompts']}", "all")
    for label, why in summary["refused"].items():
        out.append(f"\n{label}: not supported by this model ({why})")
    return "\n".join(out)


__all__ = ["GENERATE", "Contender", "Outcome", "PromptRun", "divergence_margins", "format_tables", "geometric_mean",
           "run_prompt_bench", "summarise"]
