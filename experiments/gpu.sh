#!/usr/bin/env bash
# The GPU check, in one call, on one GPU: bash experiments/gpu.sh [--dry-run] [--out DIR]
#
#   tests       the engine-parity and exactness tests on CUDA (SKIPKEY_TEST_DEVICE=cuda): the tiny families,
#               the embedded model, and the offload tests (GPU compute with CPU and disk offload, layers on two
#               devices)
#   skip_*      bench SkipDecode at 1.5/2/3/5x on random:opt-1.3b and random:opt-6.7b, batch 1 and 8 (bf16)
#   kv          bench every KV policy at 50% on random:llama-7b, 4096-token prompt + 256 new tokens, bf16
#   offload     bench SkipDecode at 1.5/2/3x on random:opt-1.3b with 1 GiB of GPU memory, the rest offloaded to
#               the CPU: the transfer ratio against the measured speedup, over PCIe
#   app         one app comparison through gradio_client, the app's model on cuda
#   exact       exact mode on Spec-Bench's test half (two questions a category, SPEC_BENCH or
#               ../shared/data/spec_bench/question.jsonl), beside generate, its prompt lookup and early exit
#
# Results go to DIR (default assets/results) as gpu_*.json, each step's output to gpu_*.log, and
# gpu_summary.json says which steps passed and how long each took. The whole check stays under a time budget
# (SKIPKEY_GPU_BUDGET_S, default 450 s, so it ends within 8 minutes): a step gets at most its own limit and what
# is left of the budget, and a step that no longer fits is recorded as skipped.
#
# --dry-run runs the same steps on the CPU, small and quick (a few tests, random:opt-125m and random:llama-68m
# instead of the big shapes, a tiny model in the app), into a temporary folder unless --out is given. CI runs it
# (tests/test_gpu_check.py), so the script keeps working where no GPU is lent.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
dry=0
out=""
while (( $# )); do
    case $1 in
        --dry-run) dry=1 ;;
        --out) out=$2; shift ;;
        *) echo "usage: bash experiments/gpu.sh [--dry-run] [--out DIR]" >&2; exit 2 ;;
    esac
    shift
done
if [[ -z $out ]]; then
    if (( dry )); then out=$(mktemp -d -t skipkey-gpu-dry-XXXX); else out=assets/results; fi
fi
mkdir -p "$out"
offload=$(mktemp -d -t skipkey-offload-XXXX)
steps=$(mktemp -t skipkey-gpu-steps-XXXX)
trap 'rm -rf "$offload" "$steps"' EXIT
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
budget=${SKIPKEY_GPU_BUDGET_S:-450}
start=$(date +%s)

step() {  # NAME LIMIT_S COMMAND...: run it under what is left of the budget, record passed/failed/timeout/skipped
    local name=$1 limit=$2 left rc status began
    shift 2
    left=$(( budget - ($(date +%s) - start) ))
    if (( left < 20 )); then
        printf '%s\tskipped (budget)\t0\n' "$name" >> "$steps"
        return
    fi
    (( limit > left )) && limit=$left
    began=$(date +%s)
    echo "== $name (at most ${limit} s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$out/gpu_$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=passed ;;
        124|137) status=timeout ;;
        *) status="failed ($rc)" ;;
    esac
    tail -n 3 "$out/gpu_$name.log"
    printf '%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - began ))" >> "$steps"
}

bench="$py -m skipkey bench"
kv_policies=$($py -c "from skipkey.kv.policies import KV_POLICIES; print(' '.join(n for n in KV_POLICIES if n != 'full'))")

if (( dry )); then
    step tests 300 env SKIPKEY_TEST_DEVICE=cpu $py -m pytest -q -p no:cacheprovider \
        tests/test_engine.py tests/test_skipdecode_engine.py tests/test_offload.py -m "not embedded" \
        -k "matches_generate and llama or exactly_its_layer_set and Linear and top or never_loaded" \
        --junitxml="$out/gpu_tests.xml"
    step skip_opt1.3b 120 $bench --model random:opt-125m --device cpu --dtype float32 --prompt-tokens 16 \
        --max-new-tokens 4 --batch 1 --repeats 1 --warmup 0 --compare-targets 1.5 2 3 5 \
        --output "$out/gpu_bench_skip_opt1.3b.json"
    step kv 120 $bench --model random:llama-68m --device cpu --dtype bfloat16 --prompt-tokens 32 \
        --max-new-tokens 4 --batch 1 --repeats 1 --warmup 0 --no-generate --compare-kv $kv_policies \
        --kv-budget 0.5 --output "$out/gpu_bench_kv_llama7b.json"
    step offload 120 $bench --model random:opt-125m --dtype float32 --device-map auto --max-memory cpu:350MB \
        --offload-dir "$offload" --prompt-tokens 16 --max-new-tokens 4 --batch 1 --repeats 1 --warmup 0 \
        --no-generate --compare-targets 1.5 2 3 --output "$out/gpu_bench_offload_opt1.3b.json"
    step app 180 $py -m experiments.gpu_check app --device cpu --tiny --output "$out/gpu_app.json"
    step exact 120 $bench --model random:llama-68m --device cpu --dtype float32 --prompts tests/data/questions.jsonl \
        --part test --exact --max-new-tokens 4 --repeats 1 --output "$out/gpu_bench_exact_specbench.json"
else
    # Estimated on an H200 (not yet run on one): tests 150 s (40-90 s of it converting the embedded model on a
    # fresh machine), the OPT benches 40 + 50 s, the app 20 s, offload 50 s, KV 80 s: about 390 s in all.
    step tests 200 env SKIPKEY_TEST_DEVICE=cuda $py -m pytest -q -p no:cacheprovider \
        tests/test_engine.py tests/test_skipdecode_engine.py tests/test_kv_policies.py tests/test_teacher_forced.py \
        tests/test_embedded.py tests/test_offload.py --junitxml="$out/gpu_tests.xml"
    step skip_opt1.3b 75 $bench --model random:opt-1.3b --device cuda --prompt-tokens 128 --max-new-tokens 64 \
        --batch 1 8 --repeats 2 --compare-targets 1.5 2 3 5 --output "$out/gpu_bench_skip_opt1.3b.json"
    step skip_opt6.7b 90 $bench --model random:opt-6.7b --device cuda --prompt-tokens 128 --max-new-tokens 64 \
        --batch 1 8 --repeats 2 --compare-targets 1.5 2 3 5 --output "$out/gpu_bench_skip_opt6.7b.json"
    step app 60 $py -m experiments.gpu_check app --device cuda --output "$out/gpu_app.json"
    step kv 120 $bench --model random:llama-7b --device cuda --dtype bfloat16 --prompt-tokens 4096 \
        --max-new-tokens 256 --batch 1 --repeats 1 --warmup 1 --no-generate --compare-kv $kv_policies \
        --kv-budget 0.5 --output "$out/gpu_bench_kv_llama7b.json"
    step offload 90 $bench --model random:opt-1.3b --device-map auto --max-memory 0:1GiB,cpu:64GiB \
        --prompt-tokens 64 --max-new-tokens 32 --batch 1 --repeats 1 --warmup 1 --no-generate \
        --compare-targets 1.5 2 3 --output "$out/gpu_bench_offload_opt1.3b.json"
    step exact 90 $bench --model embedded --device cuda --adapter assets/skipdecode-lora \
        --prompts "${SPEC_BENCH:-../shared/data/spec_bench/question.jsonl}" --part test --per-category 2 --exact \
        --max-new-tokens 64 --repeats 1 --output "$out/gpu_bench_exact_specbench.json"
fi

[[ -f $out/gpu_tests.xml ]] && $py -m experiments.gpu_check junit "$out/gpu_tests.xml" "$out/gpu_tests.json" \
    && rm -f "$out/gpu_tests.xml"
$py -m experiments.gpu_check summary "$steps" "$out/gpu_summary.json" $( (( dry )) && echo --dry-run )
echo "results in $out ($(( $(date +%s) - start )) s)"
! grep -qv $'\tpassed\t' "$steps"
