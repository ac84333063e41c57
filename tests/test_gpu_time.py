"""The GPU time a comparison asks ZeroGPU for: sized from its settings, within the stated bounds."""

from __future__ import annotations

import dataclasses

from skipkey.serving.gpu_time import GPU_SECONDS_MAX, GPU_SECONDS_MIN, gpu_seconds
from skipkey.serving.request import Controls

EMBEDDED = dict(num_layers=18, weight_bytes=536_000_000, prompt_tokens=12)  # Gemma 3 270M in bfloat16


def seconds(model=EMBEDDED, **changes) -> int:
    return gpu_seconds(dataclasses.replace(Controls(), **changes), **model)


def test_the_default_run_asks_for_less_than_zerogpus_default_and_more_than_the_floor():
    assert GPU_SECONDS_MIN <= seconds() < 60


def test_more_work_never_asks_for_less():
    base = seconds(max_new_tokens=128)
    assert seconds(max_new_tokens=256) > base
    assert seconds(max_new_tokens=128, kv_on=True) > base
    assert seconds(max_new_tokens=128, exact=True, draft_k=2) > base
    assert seconds(max_new_tokens=128, exact=True, draft_k=4) > seconds(max_new_tokens=128, exact=True, draft_k=2)
    assert seconds(dict(EMBEDDED, prompt_tokens=8000), max_new_tokens=128) > base
    assert seconds(dict(EMBEDDED, num_layers=32), max_new_tokens=128) > base
    # A model whose weights bound each step (30B in bfloat16) asks for more than its layer count alone would.
    assert seconds(dict(num_layers=32, weight_bytes=60_000_000_000, prompt_tokens=12), max_new_tokens=32) > \
        seconds(dict(num_layers=32, weight_bytes=0, prompt_tokens=12), max_new_tokens=32)


def test_the_bounds_hold():
    assert seconds(max_new_tokens=512, exact=True, draft_k=4) == GPU_SECONDS_MAX
    assert seconds(dict(num_layers=80, weight_bytes=140_000_000_000, prompt_tokens=8192), max_new_tokens=512) \
        == GPU_SECONDS_MAX
    assert seconds(max_new_tokens=1) >= GPU_SECONDS_MIN


def test_a_request_the_edge_refuses_asks_for_the_least():
    assert seconds(max_new_tokens=100_000) == GPU_SECONDS_MIN
    assert seconds(schedule="cubic") == GPU_SECONDS_MIN
