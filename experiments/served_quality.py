"""Tuned SkipDecode's quality as served, on validation and test prompts, with 95% intervals.

    python -m experiments.served_quality --prompts ../shared/data/spec_bench/question.jsonl --splits test \
        --batches 1 --output assets/results/served_quality_specbench.json
    python -m experiments.served_quality --table assets/results/served_quality_specbench.json   # markdown

With ``--prompts FILE`` (Spec-Bench's questions): its validation half (odd ids; settings are
chosen there) and test half (even ids; only reported), scored per category too. Without it,
the project's own template sets: validation = ``prompts.ORDINARY_PROMPTS``, test =
``splits.test_prompts()`` (generated here: a secondary row only). Batch 1 is how the app and
``generate`` serve; batch 8 is how ``eval`` used to measure.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

import torch

from skipkey.config import decode_steps
from skipkey.models import load
from skipkey.provenance import machine_description
from skipkey.quality.evaluate import write_json
from skipkey.quality.prompts import ORDINARY_PROMPTS
from skipkey.quality.prompt_file import read_prompts
from skipkey.quality.served import PromptScore, served_quality, summary
from skipkey.quality.splits import test_prompts
from skipkey.skipdecode.adapter import adapter_schedule, load_tuned, read_metadata
from skipkey.skipdecode.plan import make_skipdecode

SPLITS = {"validation": ORDINARY_PROMPTS, "test": None}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--adapter", default="assets/skipdecode-lora")
    p.add_argument("--targets", type=float, nargs="+", default=[1.5, 2.0])
    p.add_argument("--splits", nargs="+", choices=list(SPLITS), default=list(SPLITS))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="a prompts file (Spec-Bench JSONL): --splits then name its halves")
    p.add_argument("--per-category", type=int, default=None, help="with --prompts: the first N of each category")
    p.add_argument("--first", type=int, default=0, help="the first N of each split (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--output", default="assets/results/served_quality.json")
    p.add_argument("--table", metavar="JSON", help="print the markdown table of a finished run and stop")
    return p.parse_args(argv)


def table(record: dict) -> str:
    """One line per split, batch and config: accuracy and perplexity with their 95% intervals; then, for a
    prompts file, one table per split and batch with a line per category."""
    lines = ["| prompts | served | config | next-token accuracy [95% CI] | PPL of full continuations [95% CI] |",
             "|---|---|---|---|---|"]
    for r in record["rows"]:
        lines.append(f"| {r['split']} ({r['prompts']}) | {_served(r)} | {r['config']} | {_cell(r)} |")
    groups = {}
    for r in record["rows"]:
        if r.get("by_category"):
            groups.setdefault((r["split"], r["batch"]), []).append(r)
    for (split, batch), rows in groups.items():
        lines += ["", f"{split}, {_served(rows[0])}: next-token accuracy / PPL of the full continuations [95% CI]",
                  "", "| category | prompts | " + " | ".join(r["config"] for r in rows) + " |",
                  "|---|---|" + "---|" * len(rows)]
        for category, first in rows[0]["by_category"].items():
            lines.append(f"| {category} | {first['prompts']} | "
                         + " | ".join(_cell(r["by_category"][category]).replace(" | ", " / ") for r in rows) + " |")
    return "\n".join(lines)


def _served(row: dict) -> str:
    return "one prompt at a time (as the app)" if row["batch"] == 1 else f"batches of {row['batch']}"


def _cell(r: dict) -> str:
    acc, ppl = r["next_token_accuracy_ci95"], r["ppl_of_full_continuations_ci95"]
    return (f"{r['next_token_accuracy']:.3f} [{acc[0]:.3f}, {acc[1]:.3f}] | "
            f"{r['ppl_of_full_continuations']:.2f} [{ppl[0]:.2f}, {ppl[1]:.2f}]")


def main(argv=None) -> int:
    args = parse(argv)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return 0
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    loaded = load(args.model, dtype=args.dtype)
    tuned = load_tuned(loaded, args.adapter)
    policy, shapes = adapter_schedule(read_metadata(args.adapter))
    steps = decode_steps(args.max_new_tokens)
    configs = [(f"tuned {t:g}x", tuned, make_skipdecode(loaded.num_layers, steps, target=t, policy=policy,
                                                        shapes=shapes)) for t in args.targets]
    sets, categories, described = prompt_sets(args)
    rows = served_quality(loaded, configs, sets, args.max_new_tokens, args.batches)
    for row in rows:
        row["by_category"] = by_category(row, categories.get(row["split"]))
    write_json(args.output, dict(
        command=shlex.join(["python", "-m", "experiments.served_quality", *(argv or sys.argv[1:])]),
        started=started, finished=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=machine_description(torch.device("cpu")), torch=torch.__version__, threads=torch.get_num_threads(),
        adapter=args.adapter, layer_policy=policy, dtype=args.dtype, max_new_tokens=args.max_new_tokens,
        splits={name: len(p) for name, p in sets.items()}, prompts_file=described, rows=rows))
    return 0


def prompt_sets(args) -> tuple[dict, dict, dict | None]:
    """The prompts of each split, each prompt's category (a prompts file's), and what identifies the file."""
    if args.prompts is None:
        sets = {name: list(SPLITS[name] or test_prompts()) for name in args.splits}
        return {name: p[: args.first or None] for name, p in sets.items()}, {}, None
    prompts = read_prompts(args.prompts)
    chosen = {name: prompts.select(name, args.per_category) for name in args.splits}
    chosen = {name: records[: args.first or None] for name, records in chosen.items()}
    return ({name: [r.text for r in records] for name, records in chosen.items()},
            {name: [r.category for r in records] for name, records in chosen.items()},
            {name: prompts.describe(records) for name, records in chosen.items()})


def by_category(row: dict, categories: list[str] | None) -> dict:
    """The row's per-prompt scores summarised per category (with 95% intervals)."""
    if not categories:
        return {}
    scores = [PromptScore(*s) for s in row["per_prompt"]]
    return {c: summary([s for s, k in zip(scores, categories) if k == c]) for c in dict.fromkeys(categories)}


if __name__ == "__main__":
    raise SystemExit(main())
