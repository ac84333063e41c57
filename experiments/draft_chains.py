"""What exact mode's drafts would propose at every position of the full model's own output (untimed).

    python -m experiments.draft_chains --prompts ../shared/data/spec_bench/question.jsonl \
        --part validation --per-category 10 --layers 6 8 10 --output runs/draft_chains_val.jsonl

For each prompt the full model's greedy continuation is decoded; then, at every decode step, from
the cache exactly as exact decoding leaves it after the verified tokens, a chain of ``--chain``
draft tokens is drafted at each draft depth (a constant set of the most important layers, the
tuned adapter's weights, the full head) and taken back. Each chain position records the draft's
top-5 tokens and logits (a reduced draft head picks the best of those in its rows), so
``experiments.draft_policy`` can replay any drafting policy offline against measured costs. The
draft vocabulary is not used here.

One JSON object per prompt: id, category, prompt length, the greedy tokens, and per depth the chains.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from skipkey.config import GenerationSettings
from skipkey.core.attention import StepState
from skipkey.core.engine import Engine
from skipkey.core.retention import Appending
from skipkey.core.trace import Trace
from skipkey.models import load
from skipkey.quality.prompt_file import check_lengths, read_prompts
from skipkey.skipdecode.exact import ExactDecoding
from skipkey.skipdecode.plan import SkipDecodeSpec

TOP = 5


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", required=True)
    p.add_argument("--part", default="validation")
    p.add_argument("--per-category", type=int, default=None)
    p.add_argument("--adapter", default="assets/skipdecode-lora")
    p.add_argument("--layers", type=int, nargs="+", default=[6, 8, 10], help="draft depths (constant schedules)")
    p.add_argument("--chain", type=int, default=6, help="draft tokens per position")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default=None)
    p.add_argument("--output", required=True, help="JSONL; prompts already there are skipped (resumable)")
    return p.parse_args(argv)


@torch.inference_mode()
def chains(engines: dict[int, Engine], full: Engine, ids: list[int], greedy: list[int], chain: int) -> dict:
    """Per depth, per decode step: the chain's top-``TOP`` ids and logits from the exact-mode cache there."""
    exact = ExactDecoding(draft_k=chain, draft_vocab=0)
    arch_full = full.full_arch
    windows = [info.sliding_window for info in arch_full.layer_info]
    cache = exact.new_cache(windows)
    retention = Appending(len(greedy) + chain + 1)
    retention.prepare(cache)
    x = torch.tensor([ids], device=full.device)
    pos = torch.arange(len(ids), device=full.device)[None]
    _, importance = full.prefill(x, pos, StepState(cache=cache, query_positions=pos, dense=True), retention, True)
    layer_sets = {depth: engine.skip.plan(arch_full.num_layers, importance).layer_set(0)
                  for depth, engine in engines.items()}
    out = {depth: [] for depth in engines}
    next_pos = torch.tensor([len(ids)], device=full.device)
    for step in range(1, len(greedy)):
        token = torch.tensor([greedy[step - 1]], device=full.device)
        for depth, engine in engines.items():
            out[depth].append(_chain(engine, layer_sets[depth], cache, token, next_pos, chain))
        own = exact.verify(full, cache, token[:, None], next_pos)
        if int(own[0, 0]) != greedy[step]:
            raise RuntimeError(f"the plain step's token {int(own[0, 0])} is not the full model's {greedy[step]}")
        next_pos = next_pos + 1
    return out


def _chain(engine: Engine, layers: tuple[int, ...], cache, token, positions, length: int) -> list:
    arch = engine.arch
    links = []
    for j in range(length):
        pos = (positions + j)[:, None]
        hidden = arch.embed(token[:, None], pos)
        kwargs = arch.position_inputs(hidden, pos)
        state = StepState(cache=cache, query_positions=pos, dense=True)
        for idx in layers:
            hidden = arch.run_layer(idx, hidden, kwargs[idx], state=state)
        logits = arch.head(hidden)[0, -1]
        top = torch.topk(logits, TOP)
        probs = torch.softmax(logits, dim=-1)
        links.append([top.indices.tolist(), [round(v, 4) for v in top.values.tolist()],
                      round(float(probs[top.indices[0]]), 5)])
        token = top.indices[:1]
    for idx in layers:
        cache.layers[idx].rollback(length)
    return links


def main(argv=None) -> int:
    args = parse(argv)
    prompts = read_prompts(args.prompts)
    used = prompts.select(args.part, args.per_category)
    full_model = load("embedded", None, args.dtype)
    tuned = load("embedded", None, args.dtype, args.adapter)
    token_ids = check_lengths(prompts, used, full_model.tokenizer, full_model.context_length, args.max_new_tokens)
    full = Engine(full_model)
    engines = {}
    for depth in args.layers:
        skip = SkipDecodeSpec(kind="constant", layers=depth, policy="importance").build(full_model.num_layers, 63)
        engines[depth] = Engine(tuned, skip=skip)
    done = set()
    path = Path(args.output)
    if path.exists():
        done = {json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()}
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for record, ids in zip(used, token_ids):
        if record.id in done:
            continue
        started = time.time()
        greedy = Trace.collect(full, [ids], settings).tokens()
        row = {"id": record.id, "category": record.category, "prompt_tokens": len(ids), "greedy": greedy,
               "dtype": str(full_model.dtype), "adapter": args.adapter, "file_sha256": prompts.sha256,
               "chains": {str(d): c for d, c in chains(engines, full, ids, greedy, args.chain).items()}}
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{record.id} {record.category} {len(ids)} tokens: {time.time() - started:.0f} s", file=sys.stderr,
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
