"""Exact mode as the page runs it: the exact preset on each of the page's example prompts, beside the full model.

    python -m experiments.exact_page --repeats 3 --output assets/results/exact_page.json

For every example prompt (``skipkey.serving.presets.EXAMPLE_SETTINGS``) the page's own
comparison (``skipkey.serving.comparison.compare``: the full model and SkipKey interleaved
one step each, on the embedded model, in the machine's default dtype) runs with the example's
prompt and token count and the preset "SkipDecode exact (verified)"; the measured speedup is
the one the page shows under SkipKey's column (``side_metrics``). A timing measurement: run it
on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from skipkey.core.loading import load_model
from skipkey.provenance import machine_description
from skipkey.serving.comparison import compare, side_metrics
from skipkey.serving.models import EMBEDDED_ADAPTER
from skipkey.serving.presets import EXAMPLE_SETTINGS, PRESETS
from skipkey.serving.request import Controls, build_request
from skipkey.skipdecode.adapter import adapter_schedule, load_tuned, read_metadata

PRESET = "SkipDecode exact (verified)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default=None, help="default: the machine's (bfloat16 with bf16 instructions)")
    p.add_argument("--output")
    args = p.parse_args(argv)
    loaded = load_model("embedded", dtype=args.dtype)
    tuned = load_tuned(loaded, EMBEDDED_ADAPTER)
    _, shapes = adapter_schedule(read_metadata(EMBEDDED_ADAPTER))
    rows = []
    for name, example in EXAMPLE_SETTINGS.items():
        controls = dataclasses.replace(Controls(), **{**example, **PRESETS[PRESET].changes,
                                                      "max_new_tokens": example["max_new_tokens"]})
        request = build_request(loaded.num_layers, controls, shapes)
        runs = []
        for _ in range(args.repeats):
            *_, (full, exact) = compare(loaded, request, tuned=tuned)
            metrics = side_metrics(exact, full)
            runs.append({"measured_speedup": metrics.measured_speedup,
                         "tokens_per_verify_step": metrics.verified.tokens_per_verify_step,
                         "identical": full.tokens() == exact.tokens(), "tokens": len(exact.tokens())})
        rows.append({"example": name, "max_new_tokens": example["max_new_tokens"], "runs": runs,
                     "measured_speedup": statistics.median(r["measured_speedup"] for r in runs)})
        print(f"{name}: {rows[-1]['measured_speedup']:.2f}x the full model beside it "
              f"({', '.join(format(r['measured_speedup'], '.2f') for r in runs)}), "
              f"{statistics.median(r['tokens_per_verify_step'] for r in runs):.2f} tokens per verify step, "
              f"identical {all(r['identical'] for r in runs)}", file=sys.stderr, flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({
            "preset": PRESET, "exact": request.exact.describe(), "dtype": str(loaded.dtype),
            "machine": machine_description(torch.device("cpu")), "date": time.strftime("%Y-%m-%d"),
            "command": "python -m experiments.exact_page " + " ".join(argv if argv is not None else sys.argv[1:]),
            "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
