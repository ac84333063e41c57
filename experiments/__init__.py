"""The experiments behind the figures in docs/results. Each module runs from the repository root as
``python -m experiments.NAME`` and writes its data, with its command, date and machine, under ``assets/results``.
They use only SkipKey's public API (``tests/test_repo.py`` checks: no ``sys.path`` edits, no underscore names).

headline          the README's headline table, from the JSON in assets/results
exact_table       the tables of docs/results/exact.md (exact SkipDecode: speed, acceptance, predictions)
frontier          SkipDecode's accuracy against measured speedup (docs/results/skipdecode.md)
shape_check       an adapter's quality at the shapes it is served with (the shape study's quick measure)
served_quality    tuned SkipDecode as served (one prompt at a time) on validation and test, with 95% intervals
min_skipped       from how many skipped layers a skip-only adapter should apply
nll_by_depth      where SkipDecode's perplexity is made, per depth
kv_table          the KV speed tables of docs/results/kv.md
eviction_gain     eviction's own speedup, beside the same engine with nothing evicted
decode_kernels    the KV kernels timed alone, per layer
decode_breakdown  where a decode step's time goes, per KV policy (a profile)
noise_table_ab    what Keyformer's noise table costs in prompt scoring
app_timing        the app's measured speedup with a browser open, against bench
gpu_check         helpers of the GPU check

``bash experiments/speed.sh [BLOCK ...]`` reruns every speed figure; ``bash experiments/gpu.sh [--dry-run]`` is the
GPU check (its dry run is part of the test suite).
"""
