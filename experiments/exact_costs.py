"""What exact mode's measured pace sees on this machine: the seconds of a plain step, of a verify forward per token
count and of a draft step per depth, and how often drafts and lookup proposals were accepted, after exact runs of
Spec-Bench validation prompts; each prompt's time beside the full model's.

    python -m experiments.exact_costs --prompts ../shared/data/spec_bench/question.jsonl \
        --categories writing coding translation --output assets/results/exact_costs.json

A timing measurement: run it on a quiet machine. It explains an exact-mode speedup: a drafted token pays only when
its chance of acceptance times a plain step exceeds a draft step plus what one more token adds to a verify.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.core.trace import Trace
from skipkey.models import load
from skipkey.provenance import machine_description
from skipkey.quality.prompt_file import check_lengths, read_prompts
from skipkey.skipdecode.adapter import adapter_schedule, read_metadata
from skipkey.skipdecode.exact import ExactDecoding, engine_experience
from skipkey.skipdecode.plan import SkipDecodeSpec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", required=True)
    p.add_argument("--categories", nargs="+", default=["writing", "coding", "translation"])
    p.add_argument("--adapter", default="assets/skipdecode-lora")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--output")
    args = p.parse_args(argv)
    prompts = read_prompts(args.prompts)
    used = prompts.select("validation", 1, tuple(args.categories))
    tuned = load("embedded", None, None, args.adapter)
    ids = check_lengths(prompts, used, tuned.tokenizer, tuned.context_length, args.max_new_tokens)
    policy, shapes = adapter_schedule(read_metadata(args.adapter))
    skip = SkipDecodeSpec(target=2.0, policy=policy, shapes=shapes).build(tuned.num_layers, args.max_new_tokens - 1)
    exact, full = Engine(tuned, skip=skip, exact=ExactDecoding()), Engine(tuned)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    warm = GenerationSettings(max_new_tokens=8, ignore_eos=True)
    for engine in (exact, full):  # untimed: kernels, the draft head, the head's product measured
        Trace.collect(engine, [ids[0][:16]], warm)
    rows = []
    for record, prompt_ids in zip(used, ids):
        seconds = {}
        for name, engine in (("full", full), ("exact", exact)):
            start = time.perf_counter()
            trace = Trace.collect(engine, [prompt_ids], settings)
            seconds[name] = time.perf_counter() - start
        cycles = collections.Counter(
            f"{e.draft_source or 'plain'}: {e.drafted} proposed, {e.accepted[0]} accepted"
            for e in trace.events if e.accepted is not None)
        rows.append({"id": record.id, "category": record.category, "seconds": seconds,
                     "exact_vs_full": seconds["full"] / seconds["exact"], "cycles": dict(cycles)})
        print(f"{record.id} {record.category}: full {seconds['full']:.2f} s, exact {seconds['exact']:.2f} s "
              f"({rows[-1]['exact_vs_full']:.2f}x)", flush=True)
    seen = engine_experience(exact)
    result = {
        "plain_step_ms": 1e3 * seen.costs.verify.get(1, float("nan")),
        "verify_ms": {q: 1e3 * s for q, s in sorted(seen.costs.verify.items())},
        "draft_step_ms": {d: 1e3 * s for d, s in sorted(seen.costs.draft.items())},
        "draft_accepted": {"first": seen.draft.first.value, "later": seen.draft.later.value},
        "lookup_accepted": {n: {"first": a.first.value, "later": a.later.value} for n, a in sorted(seen.lookups.items())},
        "prompts": rows, "model": "embedded", "dtype": str(tuned.dtype), "machine": machine_description(torch.device("cpu")),
        "date": time.strftime("%Y-%m-%d"), "command": "python -m experiments.exact_costs " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(json.dumps({k: result[k] for k in ("plain_step_ms", "verify_ms", "draft_step_ms", "draft_accepted",
                                             "lookup_accepted")}, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
