"""Tuned SkipDecode's quality as served, on validation and test prompts, with 95% intervals.

    python -m experiments.served_quality --output assets/results/served_quality.json
    python -m experiments.served_quality --table assets/results/served_quality.json   # its markdown table

Validation = ``prompts.ORDINARY_PROMPTS`` (the serving shapes were chosen on them);
test = ``splits.test_prompts()`` (never used to choose anything). Batch 1 is how the
app and ``generate`` serve; batch 8 is how ``eval`` used to measure.
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
from skipkey.quality.served import served_quality
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
    p.add_argument("--prompts", type=int, default=0, help="the first N of each split (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--output", default="assets/results/served_quality.json")
    p.add_argument("--table", metavar="JSON", help="print the markdown table of a finished run and stop")
    return p.parse_args(argv)


def table(record: dict) -> str:
    """One line per split, batch and config: accuracy and perplexity with their 95% intervals."""
    lines = ["| prompts | served | config | next-token accuracy [95% CI] | PPL of full continuations [95% CI] |",
             "|---|---|---|---|---|"]
    for r in record["rows"]:
        acc, ppl = r["next_token_accuracy_ci95"], r["ppl_of_full_continuations_ci95"]
        served = "one prompt at a time (as the app)" if r["batch"] == 1 else f"batches of {r['batch']}"
        lines.append(f"| {r['split']} ({r['prompts']}) | {served} | {r['config']} | {r['next_token_accuracy']:.3f} "
                     f"[{acc[0]:.3f}, {acc[1]:.3f}] | {r['ppl_of_full_continuations']:.2f} [{ppl[0]:.2f}, {ppl[1]:.2f}] |")
    return "\n".join(lines)


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
    sets = {name: list(SPLITS[name] or test_prompts()) for name in args.splits}
    if args.prompts:
        sets = {name: prompts[: args.prompts] for name, prompts in sets.items()}
    rows = served_quality(loaded, configs, sets, args.max_new_tokens, args.batches)
    write_json(args.output, dict(
        command=shlex.join(["python", "-m", "experiments.served_quality", *(argv or sys.argv[1:])]),
        started=started, finished=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=machine_description(torch.device("cpu")), torch=torch.__version__, threads=torch.get_num_threads(),
        adapter=args.adapter, layer_policy=policy, dtype=args.dtype, max_new_tokens=args.max_new_tokens,
        splits={name: len(p) for name, p in sets.items()}, rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
