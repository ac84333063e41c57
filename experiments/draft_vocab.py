"""The draft head's vocabulary, counted as FR-Spec counts it: on the full model's own greedy generations.

    python -m experiments.draft_vocab --prompts /work/runs/real_prompts.jsonl --count 1500 \
        --output assets/skipdecode-lora/draft_vocab.json

The full model continues ``--count`` prompts of a prompts file (batched: the engine gives each
row what it gets alone) for ``--max-new-tokens`` tokens; every generated token is counted and
the ``--keep`` most frequent are stored with what they were counted on (the file's SHA-256,
the prompts, the tokens). The test half of a benchmark must never be counted: a file whose
prompts carry Spec-Bench-style ids is read for its validation half or, for a training file,
all of it (``--part``).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.core.trace import Trace
from skipkey.errors import InputError
from skipkey.models import load
from skipkey.quality.prompt_file import check_lengths, read_prompts
from skipkey.skipdecode.draft_vocab import write_ranking


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", required=True)
    p.add_argument("--part", choices=["all", "validation"], default="all",
                   help="all (a training file) or validation; never the test half")
    p.add_argument("--count", type=int, default=1500, help="prompts continued (the first of each category in turn)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--keep", type=int, default=65536, help="ids stored, most frequent first")
    p.add_argument("--dtype", default=None)
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    prompts = read_prompts(args.prompts)
    chosen = _interleaved(prompts.select(args.part), args.count)
    loaded = load("embedded", None, args.dtype)
    ids = check_lengths(prompts, chosen, loaded.tokenizer, loaded.context_length, args.max_new_tokens)
    vocab = loaded.model.lm_head.weight.shape[0]
    counts = np.zeros(vocab, dtype=np.int64)
    engine = Engine(loaded)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens)  # EOS ends a row, as a user's run does
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths batch with little padding
    started = time.time()
    for start in range(0, len(order), args.batch):
        rows = order[start: start + args.batch]
        trace = Trace.collect(engine, [ids[i] for i in rows], settings)
        for r in range(len(rows)):
            np.add.at(counts, np.asarray(trace.tokens(r), dtype=np.int64), 1)
        print(f"{start + len(rows)}/{len(order)} prompts, {counts.sum()} tokens, {time.time() - started:.0f} s",
              file=sys.stderr, flush=True)
    record = write_ranking(args.output, loaded.tokenizer, vocab, counts.tolist(), args.keep, counted_on={
        "what": "the full model's greedy generations (FR-Spec)", "model": loaded.name, "dtype": str(loaded.dtype),
        "prompts_file": {"path": prompts.path, "sha256": prompts.sha256}, "prompts": len(chosen),
        "generated_tokens": int(counts.sum()), "distinct_tokens": int((counts > 0).sum()),
        "max_new_tokens": args.max_new_tokens, "date": time.strftime("%Y-%m-%d"),
        "command": "python -m experiments.draft_vocab " + " ".join(argv if argv is not None else sys.argv[1:])})
    print(f"{record['counted_on']['distinct_tokens']} distinct tokens in {record['counted_on']['generated_tokens']}; "
          f"wrote {len(record['ids'])} ids to {args.output}", file=sys.stderr)
    return 0


def _interleaved(records, count: int):
    """Up to ``count`` prompts, the categories taking turns, so no one category fills the count."""
    by_category: dict[str, list] = {}
    for record in records:
        by_category.setdefault(record.category, []).append(record)
    out = []
    while len(out) < count and any(by_category.values()):
        for queue in by_category.values():
            if queue and len(out) < count:
                out.append(queue.pop(0))
    if not out:
        raise InputError("no prompts to count on")
    return tuple(out)


if __name__ == "__main__":
    raise SystemExit(main())
