#!/usr/bin/env bash
# The speed figures quoted in docs/results, every one against the full model in the same interleaved run.
# Run from the repository root on a quiet machine: bash experiments/speed.sh [BLOCK ...]
# Blocks: engine skip frontier kv app offload exact (default: all, in that order).
set -euo pipefail
out=assets/results
py=".venv/bin/python -m skipkey bench"

engine() {

# Engine full mode vs model.generate, embedded model, batch 1 (issue: engine >= 0.95x generate).
$py --model embedded --prompt-tokens 128 --max-new-tokens 64 --batch 1 --repeats 5 \
    --output $out/bench_engine.json
}

skip() {
# SkipDecode at nominal 1.5x, 2x, 3x, 5x, batch 1 and 8: embedded model, and random OPT-1.3B shape.
$py --model embedded --prompt-tokens 64 --max-new-tokens 32 --batch 1 8 --repeats 2 \
    --compare-targets 1.5 2 3 5 --output $out/bench_skip_embedded.json
$py --model random:opt-1.3b --prompt-tokens 64 --max-new-tokens 24 --batch 1 8 --repeats 2 \
    --compare-targets 1.5 2 3 5 --output $out/bench_skip_opt1.3b.json
# Batch 1 on the OPT-1.3B shape again, longer (docs/results/skipdecode.md's batch-1 rows; step-cost fit per variant).
$py --model random:opt-1.3b --prompt-tokens 64 --max-new-tokens 64 --batch 1 --repeats 5 \
    --compare-targets 1.5 2 3 5 --output $out/bench_skip_opt1.3b_b1.json

# Tuned (SkipDecode LoRA merged) against untuned at the same schedules: equal speed expected.
$py --model embedded --prompt-tokens 64 --max-new-tokens 64 --batch 1 --repeats 5 --compare-targets 2 3 \
    --adapter assets/skipdecode-lora --output $out/bench_tuned.json
}

frontier() {
# The SkipDecode frontier (issue 13): each layer policy at the tuned evaluation's targets with the measured-best
# shapes, untuned and tuned (the committed adapter), batch 1, 64 tokens; python -m experiments.frontier joins these to
# the tuned evaluation's accuracy.
for policy in top importance; do
  $py --model embedded --prompt-tokens 64 --max-new-tokens 64 --batch 1 --repeats 3 --skip-policy $policy \
      --compare-targets 1.25 1.5 2 3 --adapter assets/skipdecode-lora --output $out/bench_skip_frontier_$policy.json
done
}

kv() {
# KV policies at 50% of the prompt (issue 11): every policy, the recommended query-aware Keyformer and Keyformer
# evicting every 8 steps, each in lockstep beside the full model. A multi-head Llama shape whose attention over the
# cache is a real share of each step, at batch 1 and 8; the embedded model at batch 1. Batch-1 rows first run every
# pair once untimed at full length (--warmup 1); the batch-8 rows, whose prompt passes take minutes here, only the
# short warm-up. `window:budget=1.0` keeps the whole prompt through the same fused attention kernel the evicting
# layers use: its row is what the attention path alone buys against the full model's SDPA, with nothing evicted.
# These rows are bfloat16, named so that a CPU without AVX512-BF16 (whose default is float32) measures the same.
kv="window:budget=1.0 window streaming h2o keyformer tova snapkv keyformer:observe=8,pool=7 keyformer:evict_every=8"
bf16="--dtype bfloat16"
$py --model random:llama-mha-350m $bf16 --prompt-tokens 2048 --max-new-tokens 24 --batch 1 --warmup 1 --repeats 2 \
    --no-generate --compare-kv $kv --kv-budget 0.5 --output $out/bench_kv_llama350m_2k.json
$py --model random:llama-mha-350m $bf16 --prompt-tokens 4096 --max-new-tokens 24 --batch 1 --warmup 1 --repeats 1 \
    --no-generate --compare-kv $kv --kv-budget 0.5 --output $out/bench_kv_llama350m_4k.json
# Time to first token alone at 4k (the rows above have one or two prompt passes each, and this VM's drift moves a
# single pass by 10-30%): five alternating repeats of the policies that score the prompt.
$py --model random:llama-mha-350m $bf16 --prompt-tokens 4096 --max-new-tokens 2 --batch 1 --warmup 1 --repeats 5 \
    --no-generate --compare-kv h2o keyformer tova snapkv keyformer:observe=8,pool=7 --kv-budget 0.5 \
    --output $out/bench_kv_llama350m_4k_ttft.json
$py --model random:llama-mha-350m $bf16 --prompt-tokens 2048 --max-new-tokens 16 --batch 8 --warmup 0 --repeats 1 \
    --no-generate --compare-kv $kv --kv-budget 0.5 --output $out/bench_kv_llama350m_2k_b8.json
$py --model random:llama-mha-350m $bf16 --prompt-tokens 4096 --max-new-tokens 16 --batch 8 --warmup 0 --repeats 1 \
    --no-generate --compare-kv $kv --kv-budget 0.5 --output $out/bench_kv_llama350m_4k_b8.json
$py --model embedded $bf16 --prompt-tokens 2048 4096 --max-new-tokens 32 --batch 1 --warmup 1 --repeats 2 \
    --no-generate --compare-kv $kv --kv-budget 0.5 --output $out/bench_kv_embedded.json
# The scored prompt pass in both dtypes (issue 44: a float32 Keyformer prompt once took 9.8x the full model's on a
# CPU without AVX-512): time to first token and decode of the policies that score the prompt and the recommended
# query-aware Keyformer, beside the full model, batch 1, at 2k and 4k, float32 and bfloat16 (each JSON names its
# dtype; python -m experiments.kv_table shows them side by side).
scoring="h2o keyformer tova snapkv keyformer:observe=8,pool=7"
# The native build's widest vectors name the file: avx512, avx2 or avx (AVX without AVX2: no 256-bit integers).
isa=avx; grep -qw avx2 /proc/cpuinfo && isa=avx2; grep -qw avx512f /proc/cpuinfo && isa=avx512
for dtype in float32 bfloat16; do
  for model in random:llama-mha-350m embedded; do
    $py --model $model --dtype $dtype --prompt-tokens 2048 4096 --max-new-tokens 16 --batch 1 --warmup 1 \
        --repeats 2 --no-generate --compare-kv $scoring --kv-budget 0.5 \
        --output $out/bench_kv_prompt_${model#random:}_${dtype}_$isa.json
  done
done
# The same in float32 on the two other paths: the kernels built for AVX2 without AVX-512 (the CPU), and the
# eager code (a GPU, no compiler, SKIPKEY_KERNELS=0).
SKIPKEY_KERNELS_MARCH=x86-64-v3 $py --model random:llama-mha-350m --dtype float32 --prompt-tokens 2048 4096 \
    --max-new-tokens 16 --batch 1 --warmup 1 --repeats 2 --no-generate --compare-kv $scoring --kv-budget 0.5 \
    --output $out/bench_kv_prompt_llama-mha-350m_float32_avx2.json
SKIPKEY_KERNELS=0 $py --model random:llama-mha-350m --dtype float32 --prompt-tokens 2048 4096 \
    --max-new-tokens 16 --batch 1 --warmup 1 --repeats 2 --no-generate --compare-kv $scoring --kv-budget 0.5 \
    --output $out/bench_kv_prompt_llama-mha-350m_float32_eager.json
# Eviction's own gain: each policy in lockstep beside `window:budget=1.0` (the same kernel, nothing evicted), both
# from one recorded prompt pass, three runs of 32 decode steps; the ratio-of-ratios above is too noisy at batch 8.
for batch in 1 8; do for tokens in 2048 4096; do
  .venv/bin/python -m experiments.eviction_gain --prompt-tokens $tokens --batch $batch \
      --output $out/eviction_gain_$((tokens / 1024))k_b$batch.json
done; done
}

app() {
# The app's measured speedup with chromium open on this machine, against bench on the same configuration.
.venv/bin/python -m experiments.app_timing --repeats 3
}

offload() {
# SkipDecode under disk offload (issue 14): the embedded model with layers 1-17 on the disk, both sides under the
# same map; the transfer ratio beside the compute ratio.
$py --model embedded --dtype float32 --device-map auto --max-memory cpu:700MiB --offload-dir /tmp/skipkey-offload \
    --prompt-tokens 64 --max-new-tokens 32 --batch 1 --repeats 2 --no-generate --compare-targets 1.5 2 3 \
    --output $out/bench_offload_embedded.json
}

exact() {
# Exact SkipDecode on prompts people wrote (issue 43): Spec-Bench's questions (SPEC_BENCH, default
# ../shared/data/spec_bench/question.jsonl; never copied here), whole requests, batch 1, 64 new tokens, EOS ignored,
# every contender interleaved per prompt with model.generate, generate's prompt lookup and its early exit; the machine's
# default dtype unless said. Settings are chosen on the validation half (odd ids) and only reported on the test half.
spec=${SPEC_BENCH:-../shared/data/spec_bench/question.jsonl}
ex="$py --model embedded --adapter assets/skipdecode-lora --prompts $spec --exact --max-new-tokens 64"
# Validation: the draft length, the pace, prompt lookup (3 questions a category, one repeat).
$ex --part validation --per-category 3 --repeats 1 --peer-lookup 3 10 --peer-early-exit \
    --draft-k 3 4 6 --draft-pace measured --prompt-lookup on --output $out/exact_val_length.json
$ex --part validation --per-category 3 --repeats 1 --peer-lookup --peer-early-exit \
    --draft-k 3 --draft-pace fixed measured --prompt-lookup off --output $out/exact_val_pace.json
# Validation: the draft's depth (a constant set of the most important layers against the 2x schedule) and its head.
for layers in 6 8 10; do
  $ex --part validation --per-category 3 --repeats 1 --peer-lookup --peer-early-exit --skip-schedule constant \
      --skip-layers $layers --output $out/exact_val_layers$layers.json
done
$ex --part validation --per-category 3 --repeats 1 --peer-lookup --peer-early-exit \
    --draft-vocab 16384 32768 65536 --output $out/exact_val_heads.json
# Test: the default and the best validation setting, beside generate's own exact speedups, two repeats.
$ex --part test --per-category 10 --repeats 2 --output $out/exact_specbench_test.json
# float32, the default on a CPU without bf16 instructions (the machine): the same, fewer questions.
$ex --dtype float32 --part test --per-category 3 --repeats 2 --output $out/exact_specbench_test_float32.json
# Exact mode as the page runs it, on the page's own example prompts, beside the full model.
.venv/bin/python -m experiments.exact_page --repeats 3 --output $out/exact_page.json
}

blocks=("$@")
[ ${#blocks[@]} -gt 0 ] || blocks=(engine skip frontier kv app offload exact)
for block in "${blocks[@]}"; do
  case $block in
    engine|skip|frontier|kv|app|offload|exact) "$block" ;;
    *) echo "unknown block $block: choose from engine skip frontier kv app offload exact" >&2; exit 2 ;;
  esac
done
