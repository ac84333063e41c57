"""The README's headline table: each method at its recommended setting, its measured speedup against the full model
in the same run, and its quality against the full model, read from the JSON in ``assets/results``.

    python -m experiments.headline

prints the markdown table; ``tests/test_repo.py`` fails when the README's copy differs. A new row is one more entry
in ``ROWS``: e.g. the validation figures, ``ServedRow("SkipDecode 1.5x, validation", 1.5, split="validation")``;
another method, a small class with a ``label``, the ``files`` it reads and ``cells()``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "assets" / "results"
MODEL_NAMES = {"embedded": "Gemma 3 270M (embedded)"}
HEADER = ("method, setting", "speedup vs full (same run)", "quality vs full", "quality prompts",
          "model, machine, date", "data")


def read(name: str):
    return json.loads((RESULTS / name).read_text())


def where(run: dict) -> str:
    """``AMD EPYC, 2 cores, 2026-12-04``: the machine without its software versions, and the date."""
    return f"{run['machine'].split(', torch')[0]}, {run['date']}"


def bench_row(runs: list[dict], variant: str, prompt_tokens: int | None = None) -> tuple[dict, dict]:
    """The bench run and row of ``variant`` (at ``prompt_tokens``, where a file holds several lengths)."""
    for run in runs:
        if prompt_tokens is None or run["prompt_tokens"] == [prompt_tokens]:
            for row in run["rows"]:
                if row["variant"] == variant:
                    return run, row
    raise KeyError(f"no bench row {variant!r} at {prompt_tokens} tokens")


@dataclass(frozen=True)
class ServedRow:
    """SkipDecode with the committed adapter as the app serves it (one prompt at a time): speed from the frontier
    bench, quality on the test prompts with 95% bootstrap intervals (``python -m experiments.served_quality``)."""
    label: str
    target: float
    policy: str = "importance"
    bench: str = "bench_skip_frontier_importance.json"
    evaluation: str = "served_quality.json"
    split: str = "test"
    batch: int = 1

    @property
    def files(self) -> tuple[str, ...]:
        return self.bench, self.evaluation

    def cells(self) -> tuple[str, ...]:
        run, row = bench_row(read(self.bench), f"skip {self.policy} {self.target:.1f}x (tuned)")
        evaluated = read(self.evaluation)
        served = next(r for r in evaluated["rows"] if r["split"] == self.split and r["batch"] == self.batch
                      and r["config"] == f"tuned {self.target:g}x")
        acc, ppl = served["next_token_accuracy_ci95"], served["ppl_of_full_continuations_ci95"]
        quality = (f"next-token accuracy {served['next_token_accuracy']:.3f} [{acc[0]:.3f}, {acc[1]:.3f}], "
                   f"PPL {served['ppl_of_full_continuations']:.2f} [{ppl[0]:.2f}, {ppl[1]:.2f}]")
        prompts = (f"{self.split} (no setting chosen on them), one prompt at a time: {served['prompts']} prompts, "
                   f"{evaluated['max_new_tokens']} tokens, 95% intervals")
        date = evaluated["started"].split()[0]
        places = f"speed {where(run)}; quality {evaluated['machine'].split(', torch')[0]}, {date}"
        return (self.label, f"{row['speedup_vs_full']:.2f}x", quality, prompts,
                f"{MODEL_NAMES.get(run['model'], run['model'])}, {places}", f"`{self.bench}`, `{self.evaluation}`")


@dataclass(frozen=True)
class ExactRow:
    """Exact SkipDecode (the tuned SkipDecode model drafts, the full model verifies) on real prompts: speed from
    ``bench --prompts --exact`` (every contender interleaved with ``model.generate`` per prompt), the geometric mean
    over the prompts against the full model, with ``generate`` and transformers' prompt lookup beside it; quality is
    the full model's by construction, checked token for token against ``generate``."""
    label: str
    column: str  # the contender's column, ``ExactDecoding.label()``
    bench: str = "exact_specbench_test.json"
    peer: str = "generate + lookup 3"

    @property
    def files(self) -> tuple[str, ...]:
        return (self.bench,)

    def cells(self) -> tuple[str, ...]:
        run = read(self.bench)
        overall = run["overall"]["contenders"]
        ours = overall[self.column]
        slowest = min(run["categories"], key=lambda row: row["contenders"][self.column]["vs_full"])
        peer = overall.get(self.peer)
        speed = (f"{ours['vs_full']:.2f}x ({ours['vs_generate']:.2f}x `model.generate`"
                 + (f"; transformers' prompt lookup {peer['vs_generate']:.2f}x" if peer else "")
                 + f"; slowest category {slowest['category']} {slowest['contenders'][self.column]['vs_full']:.2f}x)")
        prompts = run["overall"]["prompts"]
        quality = (f"output = `generate`'s on {ours['identical']} of {prompts} prompts "
                   f"({run['dtype'].replace('torch.', '')}; the full model's by construction)")
        where_ = f"{where(run)}, {run['dtype'].replace('torch.', '')}"
        return (self.label, speed, quality,
                f"Spec-Bench {run['part']} half (settings chosen on the validation half): {prompts} prompts, "
                f"{len(run['categories'])} categories, {run['max_new_tokens']} tokens, {ours['tokens_per_verify_step']:.2f} "
                f"tokens per verify step",
                f"{MODEL_NAMES.get(run['model'], run['model'])}, {where_}", f"`{self.bench}`")


@dataclass(frozen=True)
class KVRow:
    """A KV policy at a budget: decode speed from the KV bench at each prompt length, retrieval accuracy from the
    retrieval benchmark (answers kept out of the full model's, over every length)."""
    label: str
    spec: str
    bench_variant: str
    budget: float = 0.5
    bench: str = "bench_kv_embedded.json"
    evaluation: str = "eval_kv_retrieval_benchmark.json"
    chosen_on: str = "test (options chosen on another task seed)"

    @property
    def files(self) -> tuple[str, ...]:
        return self.bench, self.evaluation

    def cells(self) -> tuple[str, ...]:
        runs = read(self.bench)
        speeds = []
        for run in runs:
            _, row = bench_row([run], self.bench_variant)
            speeds.append(f"{row['speedup_vs_full']:.2f}x at {run['prompt_tokens'][0]} tokens")
        evaluated = read(self.evaluation)
        rows = evaluated["kv_retrieval"]
        ours = [r for r in rows if r["spec"] == self.spec and r["budget"] == self.budget]
        full = [r for r in rows if r["spec"] == "full"]
        lengths = sorted({r["length"] for r in ours})
        quality = (f"retrieval: {sum(r['hits'] for r in ours)} of {sum(r['n'] for r in ours)} answers "
                   f"(full {sum(r['hits'] for r in full)}), {lengths[0]}–{lengths[-1]}-token prompts")
        places = f"speed {where(runs[0])}; quality {where(evaluated)}"
        return (self.label, ", ".join(speeds), quality, self.chosen_on,
                f"{MODEL_NAMES.get(runs[0]['model'], runs[0]['model'])}, {places}",
                f"`{self.bench}`, `{self.evaluation}`")


ROWS = (
    ServedRow("SkipDecode 1.5x, tuned (`importance`, the app's default)", 1.5),
    ServedRow("SkipDecode 2x, tuned (`importance`)", 2.0),
    ExactRow("Exact SkipDecode (2x draft, k <= 3 as it pays, prompt lookup, 32k-token draft head; the app's exact "
             "preset)", "exact k<=3 +lookup"),
    KVRow("Keyformer 50% of the prompt, query-aware (`observe=8,pool=7`)", "keyformer:observe=8,pool=7",
          "keyformer (50% of prompt, recent 30%, observe 8, pool 7)", evaluation="eval_kv_retrieval_test30_table.json"),
)


def table(rows=ROWS) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
