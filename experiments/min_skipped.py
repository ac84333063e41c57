"""Where a skip-only adapter should start to apply: the tuned `top` policy with the adapter applied only at steps
that skip at least N layers (lighter steps run the original weights), on the held-out prompts, for each N.

    python -m experiments.min_skipped --adapter assets/skipdecode-lora --values 1 2 3 4 5 --targets 1.5 2 \
        --output assets/results/min_skipped.json

A serving-time sweep of one adapter (the one trained with ``--min-skipped`` as its metadata says): the measures
are ``eval --suite tuned``'s, from ``skipkey.quality.evaluate.quality``.
"""

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from skipkey.config import decode_steps
from skipkey.quality.evaluate import QUALITY_COLUMNS, EvalConfig, markdown_table, quality
from skipkey.skipdecode.adapter import adapter_schedule, load_tuned, read_metadata
from skipkey.models import load
from skipkey.quality.prompts import ORDINARY_PROMPTS
from skipkey.provenance import machine_description
from skipkey.skipdecode.plan import make_skipdecode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", default="assets/skipdecode-lora")
    parser.add_argument("--values", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--targets", type=float, nargs="+", default=[1.5, 2.0])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    loaded = load("embedded", dtype="float32")
    tuned = load_tuned(loaded, args.adapter)
    policy, shapes = adapter_schedule(read_metadata(args.adapter))
    configs = []
    for target in args.targets:
        skip = make_skipdecode(loaded.num_layers, decode_steps(args.max_new_tokens), target=target, policy=policy,
                               shapes=shapes)
        for value in args.values:
            configs.append(EvalConfig(f"{policy} {target}x tuned, min skipped {value}", skip=skip, policy=policy,
                                      target=target, model=dataclasses.replace(tuned, min_skipped=value),
                                      options={"min_skipped": value}))
    rows = quality(loaded, configs, ORDINARY_PROMPTS[: args.prompts], args.max_new_tokens,
                   lambda msg: print(msg, file=sys.stderr, flush=True))
    for row, config in zip(rows, configs):
        row["min_skipped"] = config.options["min_skipped"]
    Path(args.output).write_text(json.dumps({
        "command": "python -m experiments.min_skipped " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
        "machine": machine_description(loaded.device), "adapter": args.adapter, "prompts": args.prompts, "rows": rows}, indent=1) + "\n")
    print(markdown_table(rows, ["label", "min_skipped", *QUALITY_COLUMNS]))


if __name__ == "__main__":
    main()
