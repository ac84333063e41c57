"""Metrics are pure functions of a recorded trace: checked on traces built by hand."""

import dataclasses

import pytest

from skipkey.core.engine import StepEvent
from skipkey.quality.metrics import compute, rouge_l, speed, step_cost, transfer
from skipkey.core.trace import Trace


def trace_of(layer_counts, seconds, num_layers=8):
    trace = Trace(num_layers=num_layers, layer_cost=100.0, head_cost=200.0)
    for step, (count, s) in enumerate(zip(layer_counts, seconds)):
        trace.add(StepEvent(step=step, tokens=(1,), texts=("a",), finished=(False,), layers=tuple(range(count)),
                            seconds=s, kv_bytes=0, cache_lengths=(0,)))
    return trace


def test_step_cost_recovers_the_fixed_and_per_layer_time():
    counts = [8, 8, 7, 6, 5, 4, 3, 3]
    trace = trace_of(counts, [0.5] + [0.004 + 0.002 * c for c in counts[1:]])  # token 0 (the prompt) is excluded
    cost = step_cost(trace)
    assert cost.ms_per_layer == pytest.approx(2.0) and cost.fixed_ms == pytest.approx(4.0)
    assert speed(trace).decode_tokens == 7 and speed(trace).ttft_s == 0.5


def test_step_cost_needs_steps_of_different_depth():
    assert step_cost(trace_of([8, 8, 8, 8], [0.1, 0.02, 0.02, 0.02])) is None
    assert step_cost(trace_of([8, 4], [0.1, 0.02])) is None  # one decode step


def test_compute_ratio_counts_the_head_that_never_skips():
    trace = trace_of([8, 4, 4], [0.1, 0.01, 0.01])
    c = compute(trace)
    assert c.nominal_speedup == pytest.approx(2.0)
    assert c.compute_ratio == pytest.approx((8 * 100 + 200) / (4 * 100 + 200))


def test_transfer_ratio_counts_the_weight_bytes_each_step_moves():
    # Layers 0-1 stay on the compute device, 2-7 are offloaded (10 bytes each); the head moves 20 a step.
    trace = dataclasses.replace(trace_of([8, 4, 8, 3], [0.1, 0.01, 0.01, 0.01]),
                                layer_transfer_bytes=(0, 0, 10, 10, 10, 10, 10, 10), fixed_transfer_bytes=20)
    moved = transfer(trace)
    steps = [20 + 20, 20 + 60, 20 + 10]  # layers 0-3, 0-7 and 0-2 of the decode steps
    assert moved.full_bytes_per_step == 80
    assert moved.bytes_per_step == pytest.approx(sum(steps) / 3)
    assert moved.transfer_ratio == pytest.approx(80 / (sum(steps) / 3))


def test_no_transfer_ratio_without_offloaded_weights():
    assert transfer(trace_of([8, 4], [0.1, 0.01])) is None


def test_rouge_l_of_a_text_against_itself_is_one_even_without_a_word_it_counts():
    assert rouge_l("The ferry stops for two months.", "The ferry stops for two months.") == 1.0
    assert rouge_l("...", "...") == rouge_l("", "  ") == rouge_l("你好", "你好") == 1.0  # rouge-score alone: 0
    assert rouge_l("...", "The ferry") == rouge_l("The ferry", "") == 0.0
    assert 0.0 < rouge_l("The ferry stops for two months.", "The ferry stops.") < 1.0
