"""Where SkipDecode's perplexity is made: the NLL of the full model's continuations, teacher-forced through the
cached skipping decode, split by how many layers each position ran. One table row per (target, shape, depth):
positions, mean NLL, and the share of the config's whole NLL; a config's PPL is exp(its NLL / its positions).

    python -m experiments.nll_by_depth --adapter assets/skipdecode-lora --targets 1.5 2 --prompts 48 \
        --output assets/results/nll_by_depth.json
"""

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

from skipkey.config import GenerationSettings, decode_steps
from skipkey.core.engine import Engine
from skipkey.quality.evaluate import EvalConfig, decode_config, markdown_table
from skipkey.skipdecode.adapter import adapter_schedule, load_tuned, read_metadata
from skipkey.models import load
from skipkey.quality.prompts import ORDINARY_PROMPTS
from skipkey.provenance import machine_description
from skipkey.skipdecode.schedules import PAPER_SHAPE, measured_best_shape
from skipkey.skipdecode.plan import SkipDecode


def nll_by_depth(model, skip, prompts, continuations) -> dict[int, tuple[int, float]]:
    """depth -> (positions, summed NLL) of ``continuations`` teacher-forced through ``model`` with ``skip``."""
    totals = defaultdict(lambda: [0, 0.0])
    for event in Engine(model, skip=skip).generate(prompts, forced=continuations):
        depth = totals[len(event.layers)]
        depth[0] += len(event.logprobs)
        depth[1] -= sum(event.logprobs)
    return {d: tuple(v) for d, v in sorted(totals.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--targets", type=float, nargs="+", default=[1.5, 2.0])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    loaded = load("embedded", None, "float32")
    tuned = load_tuned(loaded, args.adapter)
    policy, table = adapter_schedule(read_metadata(args.adapter))
    prompts = ORDINARY_PROMPTS[: args.prompts]
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    full = decode_config(loaded, EvalConfig("full"), prompts, settings)
    refs = [full.tokens(r) for r in range(len(prompts))]
    steps = decode_steps(args.max_new_tokens)
    rows = []
    for target in args.targets:
        for name, shape in (("served", measured_best_shape(target, policy, table)), ("paper", PAPER_SHAPE)):
            started = time.perf_counter()
            schedule = shape.schedule(target, loaded.num_layers, steps)
            depths = nll_by_depth(tuned, SkipDecode(schedule, policy), prompts, refs)
            positions, nll = sum(n for n, _ in depths.values()), sum(s for _, s in depths.values())
            for depth, (n, s) in depths.items():
                rows.append({"target": target, "shape": name, "schedule": repr(schedule), "depth": depth,
                             "positions": n, "mean_nll": s / n, "share_of_nll": s / nll,
                             "ppl": math.exp(nll / positions)})
            print(f"{target}x {name}: PPL {math.exp(nll / positions):.2f} ({time.perf_counter() - started:.0f} s)",
                  file=sys.stderr)
    print(markdown_table(rows, ["target", "shape", "depth", "positions", "mean_nll", "share_of_nll", "ppl"]))
    if args.output:
        Path(args.output).write_text(json.dumps({
            "command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
            "machine": machine_description(loaded.device), "adapter": args.adapter, "policy": policy,
            "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
