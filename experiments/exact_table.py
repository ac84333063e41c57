"""The tables of docs/results/exact.md, from the JSON that ``bash experiments/speed.sh exact`` and
``bench --exact --acceptance-prompts 48`` write; with file names, the per-category tables of ``bench --prompts``
runs (Spec-Bench's validation or test half) instead.

    python -m experiments.exact_table
    python -m experiments.exact_table exact_specbench_test.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from skipkey.quality.prompt_bench import format_tables

RESULTS = Path(__file__).resolve().parents[1] / "assets" / "results"
SPEED_FILES = ("exact_b1.json", "exact_b1_heads.json", "exact_b1_draft1.5.json", "exact_b1_constant10.json",
               "exact_b4.json")
PREDICTION_FILES = ("exact_predict_opt-1.3b.json", "exact_predict_llama-mha-350m.json", "exact_predict_llama-7b.json")


def _num(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def acceptance_table(name: str = "exact_acceptance.json") -> str:
    record = json.loads((RESULTS / name).read_text())
    words = record["command"].split()
    start = words.index("--compare-targets") + 1
    targets = [w for w in words[start:] if not w.startswith("--")][: len(record["rows"]) // 2]
    lines = ["| draft depth (nominal) | draft schedule (importance layers, the adapter's serving shapes) | weights | "
             "mean draft layers | acceptance | agreement |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(record["rows"]):
        schedule, _, _ = r["variant"].partition(": exact")
        tuned = "tuned" if "(tuned)" in schedule else "untuned"
        lines.append(f"| {targets[i // 2]}x | {schedule.replace(' (tuned)', '')} | {tuned} | "
                     f"{r['mean_draft_layers']:.1f} | {r['acceptance']:.3f} | {r['agreement']:.3f} |")
    return "\n".join(lines)


def speed_table(files=SPEED_FILES, predicted: bool = False) -> str:
    lines = ["| run | batch | exact setting | measured vs full | identical | acceptance | agreement | tokens per "
             "verify step | draft step | verify | byte model | measured / byte model |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in files:
        path = RESULTS / name
        if not path.exists():
            continue
        for run in json.loads(path.read_text()):
            for r in run["exact"]:
                draft = r["variant"].split(": exact")[0]
                measured = "(prediction)" if predicted else f"{r['speedup_vs_full']:.2f}x"
                lines.append(
                    f"| `{name}`: {draft} | {run['batch']} | {r['exact']} | {measured} | "
                    f"{'yes' if r['identical'] else 'NO'} | {_num(r['acceptance'], '.2f')} | "
                    f"{_num(r['agreement'], '.2f')} | {_num(r['tokens_per_verify_step'], '.2f')} | "
                    f"{_num(r['draft_step_cost'], '.2f')} | {_num(r['verify_cost'], '.2f')} | "
                    f"{_num(r['predicted_speedup'], '.2f')}x (a = {r['prediction_acceptance']:.3f}) | "
                    f"{'–' if predicted else _num(r['measured_over_predicted'], '.2f')} |")
    return "\n".join(lines)


def prompt_bench_tables(name: str) -> str:
    """The per-category tables ``bench --prompts`` printed, with the run's command, dtype, machine and date."""
    record = json.loads((RESULTS / name).read_text())
    head = (f"`{record['command']}`\n\n{record['model']}, {record['dtype'].replace('torch.', '')}, "
            f"{record['machine']}, {record['date']}; {record['part']} half, {len(record['prompts'])} prompts, "
            f"{record['max_new_tokens']} new tokens, median of {record['repeats']} interleaved runs.")
    return head + "\n\n" + format_tables(record, list(record["contenders"]))


if __name__ == "__main__":
    if sys.argv[1:]:
        print("\n\n".join(prompt_bench_tables(name) for name in sys.argv[1:]))
        raise SystemExit(0)
    print(acceptance_table(), end="\n\n")
    print(speed_table(), end="\n\n")
    print(speed_table(PREDICTION_FILES, predicted=True))
