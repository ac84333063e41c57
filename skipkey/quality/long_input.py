"""KV policies on long inputs people wrote: summaries of news articles and answers from retrieved passages.

Keyformer (Adnan et al., MLSys 2024, Section 5) measured eviction on summarization of long
articles (CNN/DailyMail, ROUGE). Spec-Bench holds the same task (``summarization``: 80
CNN/DailyMail articles, ``Summarize: <article>``, the highlights as ``reference``) and a second
long-input one (``rag``: 80 Natural Questions, retrieved passages then the question, the answer
spans as ``reference``): ``LONG_INPUT_CATEGORIES``, read from a prompts file
(``skipkey.quality.prompt_file``).

As served: one prompt at a time, greedy, EOS ending a generation as it would for a user (whether it
did is recorded). Each prompt's pass runs once (``Engine.prompt_pass``) and every config, the full
model included, decodes from it. Per prompt and config: the output, its tokens, whether EOS ended it,
the KV bytes at the run's peak, and ROUGE-L against the full model's output and against the reference
where the prompt has one. Rows are per category and config: means with 95% bootstrap intervals over
prompts, the KV held as a share of the full model's.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Sequence

from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.core.trace import Trace
from skipkey.errors import InputError
from skipkey.quality.metrics import memory, rouge_l
from skipkey.quality.prompt_file import PromptFile, PromptRecord
from skipkey.quality.served import bootstrap_interval

LONG_INPUT_CATEGORIES = ("summarization", "rag")  # Spec-Bench's categories with a long input and a reference
FULL = "full"  # the label of the full model's config: what every output is compared with


def long_input_prompts(prompts: PromptFile, part: str, per_category: int | None = None,
                       categories: Sequence[str] | None = None) -> tuple[PromptRecord, ...]:
    """The prompts the suite runs: ``part``'s prompts of ``categories`` (by default those of
    ``LONG_INPUT_CATEGORIES`` the file has), the first ``per_category`` of each; refused if there are none."""
    if categories:
        return prompts.select(part, per_category, tuple(categories))
    present = tuple(c for c in LONG_INPUT_CATEGORIES if c in prompts.categories())
    if not any(r.category in present and part in ("all", r.part) for r in prompts.records):
        raise InputError(f"{prompts.path} has no {' or '.join(LONG_INPUT_CATEGORIES)} prompt in the {part} part "
                         f"(its categories: {', '.join(prompts.categories())}); choose others with --categories")
    return prompts.select(part, per_category, present)


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def decode(loaded, config, prompt_ids: list[int], settings: GenerationSettings, prompt_pass) -> Trace:
    """One config on one prompt from its recorded prompt pass (a tuned copy runs its own prompt)."""
    shared = prompt_pass if config.model is None else None
    engine = Engine(config.model or loaded, skip=config.skip, kv=config.kv)
    return Trace.collect(engine, [prompt_ids], settings, prompt_pass=shared)


def _run_record(trace: Trace, seconds: float) -> dict:
    return dict(output=trace.text(), new_tokens=len(trace.tokens()), eos=bool(trace.events[-1].finished[0]),
                kv_bytes_peak=memory(trace).kv_bytes_peak, seconds=round(seconds, 2))


def _score(record: dict, reference: str | None) -> None:
    """ROUGE-L of each run against the full model's output and, where the prompt has one, the reference."""
    full = record["runs"][FULL]["output"]
    for run in record["runs"].values():
        run.setdefault("rouge_l_full", rouge_l(full, run["output"]))
        if reference is not None:
            run.setdefault("rouge_l_reference", rouge_l(reference, run["output"]))


def run_long_input(loaded, configs: Sequence, prompts: Sequence[PromptRecord], prompt_ids: Sequence[list[int]],
                   settings: GenerationSettings, log, *, done: Sequence[dict] = (), save=None) -> list[dict]:
    """Every config on every prompt, one prompt at a time: one record per prompt (``runs``: per config label).

    ``configs`` hold a label, ``kv``, ``skip`` and ``model`` (``skipkey.quality.evaluate.EvalConfig``), the
    full model's (``FULL``) among them. ``done``: records of an earlier run of the same settings
    (``--resume``); a prompt whose text is unchanged runs only the configs it lacks. ``save(records)`` is
    called after every prompt, so a long run leaves its results behind.
    """
    if FULL not in [c.label for c in configs]:
        raise InputError("the long-input suite compares every output with the full model's: include it")
    earlier = {r["id"]: r for r in done}
    records: list[dict] = []
    started, ran = time.perf_counter(), 0
    for number, (prompt, ids) in enumerate(zip(prompts, prompt_ids), start=1):
        record = earlier.get(prompt.id)
        if record is None or record["prompt_sha1"] != _digest(prompt.text) or \
                record["has_reference"] != (prompt.reference is not None):
            record = dict(id=prompt.id, category=prompt.category, prompt_tokens=len(ids),
                          prompt_sha1=_digest(prompt.text), has_reference=prompt.reference is not None, runs={})
        todo = [c for c in configs if c.label not in record["runs"]]
        if todo:
            prompt_started = time.perf_counter()
            recorded = Engine(loaded).prompt_pass([ids])
            record["prompt_pass_seconds"] = round(time.perf_counter() - prompt_started, 2)
            for config in todo:
                config_started = time.perf_counter()
                trace = decode(loaded, config, ids, settings, recorded)
                record["runs"][config.label] = _run_record(trace, time.perf_counter() - config_started)
            del recorded
            record["seconds"] = round(time.perf_counter() - prompt_started, 1)
            ran += 1
        _score(record, prompt.reference)
        records.append(record)
        left = (time.perf_counter() - started) / ran * (len(prompts) - number) / 60 if ran else 0.0
        log(f"  [{number}/{len(prompts)}] {prompt.category} {prompt.id} ({record['prompt_tokens']} tokens): "
            + ("resumed" if not todo else f"{record['seconds']:.0f} s, about {left:.0f} min left"))
        if save is not None:
            save(records)
    return records


def _mean_with_interval(values: Sequence[float]) -> tuple[float | None, tuple[float, float] | None]:
    if not values:
        return None, None
    return statistics.fmean(values), bootstrap_interval(list(values), statistics.fmean)


def long_input_rows(records: Sequence[dict], configs: Sequence) -> list[dict]:
    """Per category and config: ROUGE-L against the full model's output and against the references (means, 95%
    bootstrap intervals over prompts), the full model's own against the same references, the KV bytes held
    (the mean of each run's peak, and its share of the full model's), and how often EOS ended the output."""
    rows = []
    for category in dict.fromkeys(r["category"] for r in records):
        of = [r for r in records if r["category"] == category]
        full_peak = statistics.fmean(r["runs"][FULL]["kv_bytes_peak"] for r in of)
        full_reference = _mean_with_interval([r["runs"][FULL]["rouge_l_reference"] for r in of
                                              if r["has_reference"]])
        for config in configs:
            runs = [r["runs"][config.label] for r in of]
            vs_full = _mean_with_interval([run["rouge_l_full"] for run in runs])
            vs_reference = _mean_with_interval([run["rouge_l_reference"] for run in runs
                                                if "rouge_l_reference" in run])
            peak = statistics.fmean(run["kv_bytes_peak"] for run in runs)
            rows.append(dict(
                category=category, label=config.label, policy=config.policy, spec=config.series,
                options=config.options, budget=config.budget, target=config.target, prompts=len(of),
                references=sum(r["has_reference"] for r in of),
                rouge_l_vs_full=vs_full[0], rouge_l_vs_full_ci95=vs_full[1],
                rouge_l_vs_reference=vs_reference[0], rouge_l_vs_reference_ci95=vs_reference[1],
                full_rouge_l_vs_reference=full_reference[0], full_rouge_l_vs_reference_ci95=full_reference[1],
                kv_bytes_peak_mean=peak, kv_share_of_full=peak / full_peak if full_peak else None,
                ended_at_eos=statistics.fmean(run["eos"] for run in runs),
                new_tokens_mean=statistics.fmean(run["new_tokens"] for run in runs)))
    return rows


def _cell(mean: float | None, interval) -> str:
    return "–" if mean is None else f"{mean:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]"


def long_input_table(rows: Sequence[dict]) -> str:
    """docs/results/kv.md's tables: per category, a line on the full model (ROUGE-L against the references, KV
    held, EOS), then one row per policy and budget: ROUGE-L against the full model's output and against the
    references (mean [95% bootstrap interval]), the KV held (share of the full model's) and the EOS share."""
    out = []
    for category in dict.fromkeys(r["category"] for r in rows):
        at = [r for r in rows if r["category"] == category]
        full = next(r for r in at if r["label"] == FULL)
        against = _cell(full["rouge_l_vs_reference"], full["rouge_l_vs_reference_ci95"])
        out += [f"**{category}**, {full['prompts']} prompts ({full['references']} with a reference): the full "
                f"model's ROUGE-L against the references {against}, KV held {full['kv_bytes_peak_mean'] / 2**20:.1f} "
                f"MiB at its peak, ended at EOS {full['ended_at_eos']:.0%}", "",
                "| policy | budget | ROUGE-L vs full | ROUGE-L vs reference | KV held (of full) | ended at EOS |",
                "|---|---|---|---|---|---|"]
        for row in sorted((r for r in at if r["label"] != FULL), key=lambda r: -(r["budget"] or 0)):
            budget = "" if row["budget"] is None else f"{row['budget']:.0%}"
            out.append(f"| {row['spec']} | {budget} | {_cell(row['rouge_l_vs_full'], row['rouge_l_vs_full_ci95'])} "
                       f"| {_cell(row['rouge_l_vs_reference'], row['rouge_l_vs_reference_ci95'])} | "
                       f"{row['kv_bytes_peak_mean'] / 2**20:.2f} MiB ({row['kv_share_of_full']:.0%}) | "
                       f"{row['ended_at_eos']:.0%} |")
        out.append("")
    return "\n".join(out)


__all__ = ["FULL", "LONG_INPUT_CATEGORIES", "decode", "long_input_prompts", "long_input_rows", "long_input_table",
           "run_long_input"]
