"""What the measured results say, for the page: presets, the examples' settings, cost lines, the quality limit.

* ``PRESETS``: named settings of the controls, each with the measured rows its
  expected-cost line quotes (``preset_cost``; the exact preset quotes the exact bench).
* ``EXAMPLE_SETTINGS``: the example prompts and the controls each sets.
* ``quality_limit`` / ``target_note``: where the tuned model stops meeting its goals.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from skipkey.kv.policies import RECOMMENDED_OPTIONS
from skipkey.serving.request import (DEFAULT_DRAFT_HEAD, DEFAULT_DRAFT_K, DEFAULT_NEW_TOKENS, DEFAULT_PROMPT,
                                     DEFAULT_TARGET, DRAFT_HEADS, as_number, fmt)
from skipkey.skipdecode.exact import DEFAULT_DRAFT_VOCAB, ExactDecoding

RESULTS_DIR = Path(__file__).resolve().parents[2] / "assets" / "results"
SKIP_QUALITY_FILE = "eval_tuned.json"  # the tuned adapter on held-out prompts (README, "SkipDecode fine-tuning")
KV_QUALITY_FILE = "eval_kv_quality_query_aware.json"  # Keyformer at 50%, as the paper and query-aware
EXACT_BENCH_FILE = "exact_specbench_test.json"  # exact mode on Spec-Bench's test half (bench --prompts --exact)
# The SkipDecode quality goals at each target (README, "Against the goals"): measure -> (at least?, bound).
QUALITY_GOALS: Mapping[float, Mapping[str, tuple[bool, float]]] = MappingProxyType({
    1.5: MappingProxyType(dict(next_token_accuracy=(True, 0.75), ppl_of_full_continuations=(False, 3.0),
                               rouge_l=(True, 0.55), first_divergence_median=(True, 12))),
    2.0: MappingProxyType(dict(next_token_accuracy=(True, 0.60), ppl_of_full_continuations=(False, 5.0),
                               rouge_l=(True, 0.45), first_divergence_median=(True, 8))),
})
MEASURE_NAMES = dict(next_token_accuracy="next-token accuracy", ppl_of_full_continuations="PPL",
                     rouge_l="ROUGE-L", first_divergence_median="first divergence")


def read_results(name: str, results_dir: Path | None = None) -> dict | None:
    """A results file of ``assets/results`` (None where it is missing or unreadable: the page says so)."""
    path = (RESULTS_DIR if results_dir is None else results_dir) / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tuned_rows(results: dict) -> list[dict]:
    """The tuned adapter's rows at each target, in the layer policy it was trained with, lowest target first."""
    policy = results.get("adapter", {}).get("schedule", {}).get("policy")
    rows = [row for row in results.get("tuned", ()) if row.get("target") is not None
            and row.get("policy") == policy and row.get("label", "").endswith("tuned")]
    return sorted(rows, key=lambda row: row["target"])


def goal_misses(row: dict) -> list[str]:
    """The goals ``row`` misses, as text: the goals of the highest goal target at or below its target
    (below every goal target: the lowest's)."""
    at = max((t for t in QUALITY_GOALS if t <= row["target"]), default=min(QUALITY_GOALS))
    misses = []
    for measure, (at_least, bound) in QUALITY_GOALS[at].items():
        value = row.get(measure)
        if value is None or (value < bound if at_least else value > bound):
            misses.append(f"{MEASURE_NAMES[measure]} {fmt(value, '{:.3g}')} {'<' if at_least else '>'} {bound:g}")
    return misses


@dataclass(frozen=True)
class QualityLimit:
    """The highest measured target up to which the tuned model meets its quality goals, and the first one past it."""

    target: float
    past: float | None  # the first measured target that misses a goal (None: none measured misses)
    misses: tuple[str, ...]  # what it misses
    source: str  # the results file


def quality_limit(results_dir: Path | None = None, name: str = SKIP_QUALITY_FILE) -> QualityLimit | None:
    """Where the SkipDecode quality table stops meeting its goals (None: no table to read)."""
    results = read_results(name, results_dir)
    rows = tuned_rows(results) if results else []
    if not rows:
        return None
    limit = None
    for row in rows:
        misses = goal_misses(row)
        if misses:
            return QualityLimit(limit if limit is not None else 1.0, row["target"], tuple(misses), name)
        limit = row["target"]
    return QualityLimit(limit, None, (), name)


def target_note(target, limit: QualityLimit | None) -> str:
    """The line under the target-speedup slider: a warning past the measured quality limit."""
    if limit is None:
        return ""
    value = as_number(target)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return ""
    if limit.past is not None and value > limit.target:
        return (f"⚠ Past **{limit.target:g}x** the tuned model falls below its quality goals (at {limit.past:g}x: "
                f"{'; '.join(limit.misses)}; `{limit.source}`).")
    return f"Up to **{limit.target:g}x** the tuned model meets its quality goals (`{limit.source}`)."


# -- presets --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Preset:
    """A named setting of the controls, and where its expected cost was measured.

    ``changes`` are the controls it sets (every one its method depends on, the other
    method's switch included); ``skip_target`` / ``kv_row`` name the measured rows its
    cost line quotes (a target of the tuned table, a row label of the KV table).
    """

    name: str
    changes: Mapping[str, object]
    skip_target: float | None = None
    kv_row: str | None = None
    exact: ExactDecoding | None = None  # verified: its cost line quotes the exact bench's speed, not quality


_SKIP_ONLY = dict(skip_on=True, set_by="target speedup", tuned=True, kv_on=False, exact=False)
_EXACT = ExactDecoding(DEFAULT_DRAFT_K, draft_vocab=DRAFT_HEADS[DEFAULT_DRAFT_HEAD])
_EXACT_ON = dict(_SKIP_ONLY, target_speedup=2.0, exact=True, decoding="greedy", draft_k=_EXACT.draft_k,
                 draft_head=DEFAULT_DRAFT_HEAD)
_KEYFORMER = dict(kv_on=True, kv_policy="keyformer", kv_budget_pct=50, kv_recent_pct=30)
_QUERY_AWARE = dict(kv_observe=RECOMMENDED_OPTIONS["observe"], kv_pool=RECOMMENDED_OPTIONS["pool"])
_QUERY_AWARE_ROW = "keyformer:" + ",".join(f"{k}={v}" for k, v in RECOMMENDED_OPTIONS.items()) + " 50%"
PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in (
    Preset("SkipDecode 1.5x (tuned)", MappingProxyType(dict(_SKIP_ONLY, target_speedup=1.5)), skip_target=1.5),
    Preset("SkipDecode 2x (tuned)", MappingProxyType(dict(_SKIP_ONLY, target_speedup=2.0)), skip_target=2.0),
    Preset("SkipDecode exact (verified)", MappingProxyType(_EXACT_ON), skip_target=2.0, exact=_EXACT),
    Preset("Keyformer 50% (query-aware)",
           MappingProxyType(dict(_KEYFORMER, **_QUERY_AWARE, skip_on=False, exact=False)), kv_row=_QUERY_AWARE_ROW),
    Preset("Keyformer 50% (paper)",
           MappingProxyType(dict(_KEYFORMER, kv_observe=0, kv_pool=1, skip_on=False, exact=False)),
           kv_row="keyformer 50%"),
    Preset("both", MappingProxyType(dict(_SKIP_ONLY, **_KEYFORMER, **_QUERY_AWARE, target_speedup=1.5)),
           skip_target=1.5, kv_row=_QUERY_AWARE_ROW),
)})


def _quality_text(row: dict, full: dict | None) -> str:
    reference = f" (full {full['ppl_of_full_continuations']:.2f})" if full else ""
    return (f"next-token accuracy {row['next_token_accuracy']:.2f}, PPL {row['ppl_of_full_continuations']:.2f}"
            f"{reference}, ROUGE-L {row['rouge_l']:.2f}")


def exact_cost(exact: ExactDecoding, results_dir: Path | None = None) -> str:
    """What exact mode costs: nothing in quality; its speed quoted from the real-prompt bench's column for
    ``exact`` (``ExactDecoding.label()``): over the full model and ``model.generate``, all prompts and the slowest
    category."""
    results = read_results(EXACT_BENCH_FILE, results_dir) or {}
    text = f"the full model's own tokens (greedy, every draft verified); {exact.describe()}: "
    # The bench's default column drafts with draft_vocab=None, which is DEFAULT_DRAFT_VOCAB rows on the embedded model.
    same = dataclasses.replace(exact, draft_vocab=None) if exact.draft_vocab == DEFAULT_DRAFT_VOCAB else exact
    label = same.label()
    overall = results.get("overall", {}).get("contenders", {}).get(label)
    if overall is None:
        return text + f"speed not measured yet (`{EXACT_BENCH_FILE}`)"
    slowest = min(results["categories"], key=lambda row: row["contenders"][label]["vs_full"] or 0.0)
    dtype = str(results.get("dtype", "")).replace("torch.", "")
    return text + (f"measured **{fmt(overall.get('vs_full'), '{:.2f}')}x** the full model's speed "
                   f"({fmt(overall.get('vs_generate'), '{:.2f}')}x `model.generate`), "
                   f"{fmt(overall.get('tokens_per_verify_step'), '{:.2f}')} tokens per verify step, on "
                   f"{results['overall']['prompts']} Spec-Bench test prompts in {dtype} (slowest category: "
                   f"{slowest['category']}, {fmt(slowest['contenders'][label]['vs_full'], '{:.2f}')}x) "
                   f"(`{EXACT_BENCH_FILE}`)")


def preset_cost(preset: Preset, results_dir: Path | None = None) -> str:
    """One line: what the preset is expected to cost in quality, quoted from the measured rows it names."""
    if preset.exact is not None:
        return "Expected cost: " + exact_cost(preset.exact, results_dir) + "."
    parts = []
    if preset.skip_target is not None:
        results = read_results(SKIP_QUALITY_FILE, results_dir)
        rows = [r for r in tuned_rows(results) if r["target"] == preset.skip_target] if results else []
        full = next((r for r in results.get("tuned", ()) if r.get("policy") == "full"), None) if results else None
        target = preset.skip_target
        parts.append(f"SkipDecode at a nominal {target:g}x (layer runs per token cut {target:g}x); "
                     + (f"{_quality_text(rows[0], full)} on {results['prompts']} held-out prompts "
                        f"(`{SKIP_QUALITY_FILE}`)" if rows else f"not measured in `{SKIP_QUALITY_FILE}`"))
    if preset.kv_row is not None:
        results = read_results(KV_QUALITY_FILE, results_dir)
        table = results.get("kv_agreement", ()) if results else ()
        rows = [r for r in table if r.get("label") == preset.kv_row]
        full = next((r for r in table if r.get("policy") == "full"), None)
        parts.append(f"KV cache held to {preset.changes['kv_budget_pct']}% of the prompt; "
                     + (f"{_quality_text(rows[0], full)} on {results['prompts']} prompts of "
                        f"{results['kv_prompt_tokens']} tokens (`{KV_QUALITY_FILE}`)" if rows
                        else f"not measured in `{KV_QUALITY_FILE}`"))
    if preset.skip_target is not None and preset.kv_row is not None:
        parts.append("each measured alone")
    return "Expected cost: " + " · ".join(parts) + "."


# -- the example prompts ----------------------------------------------------------------------
_RETRIEVAL_FILLER = (
    "The town of Ashwick sits in a wide valley where two rivers meet. Its market opens every Thursday, "
    "and farmers bring apples, cheese, wool and honey from the hills around it. The old stone bridge was "
    "rebuilt after the flood of 1887, and the clock on the town hall has run two minutes slow ever since. "
    "Children walk to the school on Mill Lane, and in summer the library moves some of its shelves outside "
    "under the chestnut trees. The bakery on the square is known for its rye bread and its plum cake. "
)
RETRIEVAL_PROMPT = (
    "Read the notes, then answer the question.\n\n"
    "Note 1: The code to open the archive room is 7294.\n\n"
    + "".join(f"Note {i}: {_RETRIEVAL_FILLER}\n\n" for i in range(2, 7))
    + "Question: What is the code to open the archive room?\nAnswer: The code to open the archive room is"
)
# Each example sets every control its method depends on, the other method's switch included, so each shows
# one method at a time. The short prompts run SkipDecode alone at its default target: their KV budget would be
# a few tokens (it is a share of the prompt). In the retrieval prompt the first digit of the code comes from
# the prompt pass; the others need the cache to still hold Note 1. It runs Keyformer alone, with the
# recommended query-aware options (scores from the question's queries, pooled), which keep it; with observe at
# 0 (the paper) it loses all but "7". The tuned weights and the layer policy follow the model, not the example.
_SKIPDECODE_ONLY = dict(max_new_tokens=DEFAULT_NEW_TOKENS, exact=False, skip_on=True, set_by="target speedup",
                        target_speedup=DEFAULT_TARGET, kv_on=False, kv_policy="keyformer", kv_budget_pct=50, kv_recent_pct=30,
                        kv_observe=0, kv_pool=1)
_KEYFORMER_ONLY = dict(max_new_tokens=8, exact=False, skip_on=False, set_by="target speedup", target_speedup=DEFAULT_TARGET,
                       kv_on=True,
                       kv_policy="keyformer", kv_budget_pct=50, kv_recent_pct=10,
                       kv_observe=RECOMMENDED_OPTIONS["observe"], kv_pool=RECOMMENDED_OPTIONS["pool"])
EXAMPLE_SETTINGS: Mapping[str, Mapping[str, object]] = MappingProxyType({
    "Photosynthesis": dict(prompt=DEFAULT_PROMPT, **_SKIPDECODE_ONLY),
    "Story": dict(prompt="Here is a short story about a robot who learns to paint.\n\nOnce upon a time,",
                  **_SKIPDECODE_ONLY),
    "Code": dict(prompt="def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", **_SKIPDECODE_ONLY),
    "Long-context retrieval (eviction matters)": dict(prompt=RETRIEVAL_PROMPT, **_KEYFORMER_ONLY),
})
