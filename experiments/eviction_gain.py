"""Eviction's own decode speedup: each KV policy in lockstep beside the same engine with nothing evicted.

    python -m experiments.eviction_gain --prompt-tokens 2048 --batch 8 \
        --output assets/results/eviction_gain_2k_b8.json

``bench``'s KV rows run beside the full model, whose decode attention is transformers' SDPA (so that it stays
``generate``'s token for token). On CPUs without AMX that SDPA runs several times below memory speed
(``decode_kernels.txt``), so those ratios also hold the fused kernel's gain over it. Here the other side is
``window:budget=1.0``: the same engine and kernel over the whole cache. The ratio is eviction's alone, and is
set against two limits:

* the bytes limit, ``bench``'s: the reference's bytes read per decode step over the policy's (weights + KV);
* the attention-time limit: the reference's step time over what it would be if its attention over the cache
  (``skipkey_attention`` on decode steps, timed in the same run) shrank in proportion to the KV bytes the policy
  keeps, and eviction cost nothing. Where the rest of a step (the weights' products) runs below memory speed,
  this is the lower and the reachable one: halving the cache saves only the time its reads take.

Both sides of a run start from one recorded prompt pass (``Engine.prompt_pass``: the prompt pass does not
depend on the policy), so a run times decode only and costs little more than its decode steps; a scoring
policy still scores the prompt when it replays it. Runs are ``bench``'s: one step each in turn
(``trace.lockstep``), which side steps first alternating between repeats; each ratio is the median of the
runs' own ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import skipkey.core.attention as attention
from skipkey.quality.bench import synthetic_prompt
from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.kv.policies import make_kv_policy, parse_policy_spec
from skipkey.quality.metrics import speed, traffic
from skipkey.models import load
from skipkey.provenance import machine_description
from skipkey.core.trace import Trace, run_lockstep

REFERENCE = "window:budget=1.0"
POLICIES = ["window", "streaming", "h2o", "keyformer", "tova", "snapkv", "keyformer:observe=8,pool=7",
            "keyformer:evict_every=8"]


ATTENTION_SECONDS = [0.0, 0.0]  # per side: time inside the attention function on decode steps
STEPPING: list[int | None] = [None]  # the side whose step is running


def timed_attention(module, query, *args, **kwargs):
    if STEPPING[0] is None or query.shape[2] != 1:
        return attention.skipkey_attention(module, query, *args, **kwargs)
    start = time.perf_counter()
    try:
        return attention.skipkey_attention(module, query, *args, **kwargs)
    finally:
        ATTENTION_SECONDS[STEPPING[0]] += time.perf_counter() - start


def tagged(stream, side: int):
    """``stream``'s events, with ``STEPPING`` naming ``side`` while it steps; closing this closes ``stream``."""
    try:
        while True:
            STEPPING[0] = side
            try:
                event = next(stream, None)
            finally:
                STEPPING[0] = None
            if event is None:
                return
            yield event
    finally:
        stream.close()


def engine_for(lm, spec: str, budget: float) -> Engine:
    name, options = parse_policy_spec(spec)
    return Engine(lm, kv=make_kv_policy(name, options.pop("budget", budget), **options))


def run_beside(reference: Engine, engine: Engine, prompts, settings, prompt_pass, first_round: int):
    """One lockstep run from the recorded prompt pass: (reference trace, policy trace)."""
    traces = (Trace.for_engine(reference), Trace.for_engine(engine))
    ATTENTION_SECONDS[:] = [0.0, 0.0]
    run_lockstep([tagged(e.generate(prompts, settings, prompt_pass=prompt_pass), side)
                  for side, e in enumerate((reference, engine))], traces, first_round)
    return traces


def attention_time_limit(ref_trace: Trace, trace: Trace, ref_attention_s: float) -> float:
    """The reference's mean step over itself with its decode attention scaled by the policy's share of the KV."""
    ref, own = traffic(ref_trace), traffic(trace)
    step = speed(ref_trace).decode_s / len(ref_trace.decode_events)
    attention_s = ref_attention_s / len(ref_trace.decode_events)
    return step / (step - attention_s * (1 - own.kv_bytes / ref.kv_bytes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-mha-350m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-budget", type=float, default=0.5)
    parser.add_argument("--policies", nargs="+", default=POLICIES)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    lm = load(args.model, dtype=args.dtype)
    from transformers import AttentionInterface
    AttentionInterface.register(attention.ATTENTION_NAME, timed_attention)  # after ``load`` registered it
    prompts = [synthetic_prompt(lm.tokenizer, args.prompt_tokens, salt=row) for row in range(args.batch)]
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    reference = engine_for(lm, REFERENCE, args.kv_budget)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    prompt_pass = reference.prompt_pass(prompts)
    engines = {spec: engine_for(lm, spec, args.kv_budget) for spec in args.policies}
    # A short run of each first: the first call pays for thread pools and lazily built tables.
    short = GenerationSettings(max_new_tokens=3, ignore_eos=True)
    for engine in engines.values():
        run_beside(reference, engine, prompts, short, prompt_pass, 0)
    runs: dict[str, list[dict]] = {spec: [] for spec in engines}
    for repeat in range(args.repeats):
        for spec, engine in engines.items():
            ref_trace, trace = run_beside(reference, engine, prompts, settings, prompt_pass, repeat)
            ref_speed, own_speed = speed(ref_trace), speed(trace)
            runs[spec].append({
                "ratio": own_speed.tokens_per_s / ref_speed.tokens_per_s,
                "limit": traffic(ref_trace).total / traffic(trace).total,
                "time_limit": attention_time_limit(ref_trace, trace, ATTENTION_SECONDS[0]),
                "reference_attention_share": ATTENTION_SECONDS[0] / ref_speed.decode_s,
                "reference_ms_per_step": ref_speed.ms_per_token_p50,
                "ms_per_step": own_speed.ms_per_token_p50,
                "kv_bytes": trace.events[-1].kv_bytes, "reference_kv_bytes": ref_trace.events[-1].kv_bytes})
        print(f"# repeat {repeat + 1}/{args.repeats}: " + ", ".join(
            f"{spec} {runs[spec][-1]['ratio']:.2f}x" for spec in engines), file=sys.stderr, flush=True)

    rows = []
    for spec, samples in runs.items():
        ratios = [s["ratio"] for s in samples]
        ratio, limit = statistics.median(ratios), statistics.median(s["limit"] for s in samples)
        time_limit = statistics.median(s["time_limit"] for s in samples)
        rows.append({"policy": spec, "speedup_vs_reference": ratio, "range": [min(ratios), max(ratios)],
                     "bytes_limit": limit, "of_limit": ratio / limit,
                     "attention_time_limit": time_limit, "of_time_limit": ratio / time_limit,
                     "reference_attention_share": statistics.median(s["reference_attention_share"] for s in samples),
                     "reference_ms_per_step": statistics.median(s["reference_ms_per_step"] for s in samples),
                     "ms_per_step": statistics.median(s["ms_per_step"] for s in samples), "runs": samples})
    result = {"command": " ".join(["python", *sys.argv]), "date": started, "machine": machine_description(lm.device),
              "model": args.model, "dtype": args.dtype, "prompt_tokens": args.prompt_tokens, "batch": args.batch,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "kv_budget": args.kv_budget,
              "reference": REFERENCE, "rows": rows}
    print(f"# {result['command']}\n# {started}, {result['machine']}; {args.model} {args.dtype}, batch {args.batch}, "
          f"prompt {args.prompt_tokens}, {args.max_new_tokens} new tokens, median of {args.repeats} lockstep runs "
          f"beside {REFERENCE}")
    print("| policy | vs window 100% (runs' range) | bytes limit | of it | attention-time limit | of it "
          "| reference's attention share | ms/step (reference) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['speedup_vs_reference']:.2f}x ({r['range'][0]:.2f}–{r['range'][1]:.2f}) | "
              f"{r['bytes_limit']:.2f}x | {r['of_limit']:.2f} | {r['attention_time_limit']:.2f}x | "
              f"{r['of_time_limit']:.2f} | {r['reference_attention_share']:.0%} | {r['ms_per_step']:.1f} "
              f"({r['reference_ms_per_step']:.1f}) |")
    if args.output:
        args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
