"""Would a tree of draft candidates pay? The draft's second choice where its first was rejected, and the cost.

    python -m experiments.tree_gain --prompts ../shared/data/spec_bench/question.jsonl --per-category 3 \
        --output assets/results/exact_tree_gain.json

Exact mode verifies one chain of drafted tokens. A tree (SpecInfer, Medusa, EAGLE-2) also
verifies other candidates in the same forward: here, the draft's second choice at a
position. It adds one token to the verify forward per extra candidate and, where the
chain's token at that position was rejected and the second choice is the full model's,
one more accepted token (the verify's prediction after it). On the validation half, every
cycle drafts ``--k`` tokens at the 2x schedule (fixed pace, no lookup); this records the
draft's top two at each drafted position and what the full model chose, then sets the
extra tokens a tree would win per cycle against the extra verify cost it adds (the
measured cost of one more token in a verify forward, timed here on ``--repeats`` calls:
a quiet machine is needed for that part).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from skipkey.config import GenerationSettings
from skipkey.core.attention import StepState
from skipkey.core.retention import Appending
from skipkey.core.engine import Engine
from skipkey.core.trace import Trace
from skipkey.models import load
from skipkey.provenance import machine_description
from skipkey.quality.prompt_file import check_lengths, read_prompts
from skipkey.skipdecode import exact as exact_module
from skipkey.skipdecode.adapter import adapter_schedule, read_metadata
from skipkey.skipdecode.exact import DraftHead, ExactDecoding
from skipkey.skipdecode.plan import SkipDecodeSpec


class RecordingHead(DraftHead):
    """The draft head, also keeping its second choice at every call (row 0)."""

    def __init__(self, head: DraftHead):
        super().__init__(head.ids, head.ids.device if head.ids is not None else "cpu")
        self.rows = head.rows
        self.seconds: list[int] = []

    def __call__(self, arch, hidden):
        token, probability = super().__call__(arch, hidden)
        if self.ids is None:
            logits = arch.head(hidden[:, None])[:, -1]
        else:
            weight, bias = self._rows(arch)
            logits = torch.nn.functional.linear(arch.norm(hidden), weight, bias)
        second = logits.topk(2, dim=-1).indices[0, 1]
        self.seconds.append(int(second if self.ids is None else self.ids[second]))
        return token, probability


def cycles(trace: Trace, seconds: list[int]) -> list[tuple[int, int, list[int], list[int]]]:
    """Per layers cycle: tokens drafted, accepted, the draft's second choices, the full model's tokens there."""
    out, used = [], 0
    tokens = trace.tokens()
    for i, event in enumerate(trace.events):
        if event.draft_source != "layers":
            continue
        k = event.drafted
        out.append((k, event.accepted[0], seconds[used: used + k], tokens[i: i + k]))
        used += k
    return out


def verify_slope(engine: Engine, ids: list[int], repeats: int) -> float:
    """Seconds a verify forward adds per token, in plain steps: from q = 1 and q = 9 on the same prefix."""
    exact = ExactDecoding(8, pace="fixed", lookup=False)
    windows = [info.sliding_window for info in engine.full_arch.layer_info]
    cache = exact.new_cache(windows)
    retention = Appending(16)
    retention.prepare(cache)
    x = torch.tensor([ids])
    pos = torch.arange(len(ids))[None]
    with torch.inference_mode():
        engine.prefill(x, pos, StepState(cache=cache, query_positions=pos, dense=True), retention, False)

        def timed(q):
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                ExactDecoding.verify(engine, cache, torch.tensor([ids[:q]]), torch.tensor([len(ids)]))
                samples.append(time.perf_counter() - start)
                exact_module.cache_rollback(cache, q)
            return statistics.median(samples)

        one, nine = timed(1), timed(9)
    return (nine - one) / 8 / one


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", required=True)
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--adapter", default="assets/skipdecode-lora")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--output")
    args = p.parse_args(argv)
    prompts = read_prompts(args.prompts)
    used = prompts.select("validation", args.per_category)
    tuned = load("embedded", None, None, args.adapter)
    ids = check_lengths(prompts, used, tuned.tokenizer, tuned.context_length, 64)
    policy, shapes = adapter_schedule(read_metadata(args.adapter))
    skip = SkipDecodeSpec(target=2.0, policy=policy, shapes=shapes).build(tuned.num_layers, 63)
    engine = Engine(tuned, skip=skip, exact=ExactDecoding(args.k, pace="fixed", lookup=False))
    settings = GenerationSettings(max_new_tokens=64, ignore_eos=True)
    Trace.collect(engine, [ids[0][:16]], GenerationSettings(max_new_tokens=4, ignore_eos=True))  # builds the head
    head = exact_module.wrap_draft_head(engine, RecordingHead)
    all_cycles = []
    for record, prompt_ids in zip(used, ids):
        head.seconds.clear()
        all_cycles += cycles(Trace.collect(engine, [prompt_ids], settings), head.seconds)
        print(f"{record.id} {record.category}: {len(all_cycles)} cycles so far", file=sys.stderr, flush=True)
    n = len(all_cycles)
    first = sum(a == 0 and s[0] == g[0] for k, a, s, g in all_cycles) / n
    anywhere = sum(a < k and s[a] == g[a] for k, a, s, g in all_cycles) / n
    rejected = sum(a < k for k, a, _, _ in all_cycles) / n
    tokens = sum(a + 1 for _, a, _, _ in all_cycles) / n
    slope = verify_slope(engine, ids[0], args.repeats)
    result = {"cycles": n, "k": args.k, "tokens_per_cycle": tokens, "rejected_share": rejected,
              "second_right_at_first_position": first, "second_right_at_rejection": anywhere,
              "verify_cost_per_token": slope,
              "tree_first_position": {"extra_tokens": first, "extra_cost": slope},
              "tree_every_position": {"extra_tokens": anywhere, "extra_cost": slope * args.k},
              "machine": machine_description(torch.device("cpu")), "dtype": str(tuned.dtype),
              "date": time.strftime("%Y-%m-%d"), "prompts_file": prompts.describe(used),
              "command": "python -m experiments.tree_gain " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(json.dumps({k: v for k, v in result.items() if k != "prompts_file"}, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
