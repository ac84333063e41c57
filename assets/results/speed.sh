#!/usr/bin/env bash
# The speed figures quoted in the README, every one against the full model in the same interleaved run.
# Run from the repository root on a quiet machine: bash assets/results/speed.sh
set -euo pipefail
out=assets/results
py=".venv/bin/python -m skipkey bench"

# Engine full mode vs model.generate, embedded model, batch 1 (issue: engine >= 0.95x generate).
$py --model embedded --prompt-tokens 128 --max-new-tokens 64 --batch 1 --repeats 5 \
    --output $out/bench_engine.json

# SkipDecode at nominal 1.5x, 2x, 3x, 5x, batch 1 and 8: embedded model, and random OPT-1.3B shape.
$py --model embedded --prompt-tokens 64 --max-new-tokens 32 --batch 1 8 --repeats 2 \
    --compare-targets 1.5 2 3 5 --output $out/bench_skip_embedded.json
$py --model random:opt-1.3b --prompt-tokens 64 --max-new-tokens 24 --batch 1 8 --repeats 2 \
    --compare-targets 1.5 2 3 5 --output $out/bench_skip_opt1.3b.json
# Batch 1 on the OPT-1.3B shape again, longer (the README's batch-1 rows; step-cost fit per variant).
$py --model random:opt-1.3b --prompt-tokens 64 --max-new-tokens 64 --batch 1 --repeats 5 \
    --compare-targets 1.5 2 3 5 --output $out/bench_skip_opt1.3b_b1.json

# Tuned (SkipDecode LoRA merged) against untuned at the same schedules: equal speed expected.
$py --model embedded --prompt-tokens 64 --max-new-tokens 64 --batch 1 --repeats 5 --compare-targets 2 3 \
    --adapter assets/skipdecode-lora --output $out/bench_tuned.json

# KV policies at 50% of the prompt, prompts of 1k, 2k and 4k tokens: embedded model, and a multi-head Llama
# shape whose attention over the cache is a real share of each step.
$py --model embedded --prompt-tokens 1024 2048 4096 --max-new-tokens 32 --repeats 2 \
    --no-generate --compare-kv keyformer window --kv-budget 0.5 --output $out/bench_kv_embedded.json
$py --model random:llama-mha-350m --prompt-tokens 1024 2048 4096 --max-new-tokens 32 \
    --warmup 0 --repeats 1 --no-generate --compare-kv keyformer window --kv-budget 0.5 --output $out/bench_kv_llama350m.json

# SkipDecode under disk offload (issue 14): the embedded model with layers 1-17 on the disk, both sides under the
# same map; the transfer ratio beside the compute ratio.
$py --model embedded --dtype float32 --device-map auto --max-memory cpu:700MiB --offload-dir /tmp/skipkey-offload \
    --prompt-tokens 64 --max-new-tokens 32 --batch 1 --repeats 2 --no-generate --compare-targets 1.5 2 3 \
    --output $out/bench_offload_embedded.json
