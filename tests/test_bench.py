"""bench: accelerated engines run in lockstep beside the full model, and their ratios are per-run ratios."""

from __future__ import annotations

import statistics

import pytest

from skipkey.quality.bench import run_bench, synthetic_prompt
from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.kv.policies import make_kv_policy
from skipkey.core.trace import Trace, lockstep, run_lockstep, step_order


def test_lockstep_takes_turns_in_step_order_and_lets_a_finished_stream_drop_out():
    log = []

    def stream(side, n):
        for i in range(n):
            log.append(side)
            yield (side, i)

    traces = [Trace(num_layers=1, layer_cost=1.0, head_cost=1.0) for _ in range(2)]
    rounds = sum(1 for _ in lockstep([stream(0, 3), stream(1, 5)], traces))
    assert rounds == 5
    assert traces[0].events == [(0, i) for i in range(3)] and traces[1].events == [(1, i) for i in range(5)]
    assert log[:6] == [side for r in range(3) for side in step_order(r)]  # both live: turns in step_order
    assert log[6:] == [1, 1]  # stream 0 has ended
    log.clear()
    traces = [Trace(num_layers=1, layer_cost=1.0, head_cost=1.0) for _ in range(2)]
    assert sum(1 for _ in lockstep([stream(0, 2), stream(1, 2)], traces, first_round=1)) == 2
    assert log == [side for r in (1, 2) for side in step_order(r)] and step_order(0) != step_order(1)


def test_run_lockstep_closes_both_streams_when_one_raises():
    closed = []

    def stream(side, fail_at):
        try:
            for i in range(5):
                if i == fail_at:
                    raise RuntimeError("out of memory")
                yield (side, i)
        finally:
            closed.append(side)

    traces = [Trace(num_layers=1, layer_cost=1.0, head_cost=1.0) for _ in range(2)]
    with pytest.raises(RuntimeError, match="out of memory"):
        run_lockstep([stream(0, None), stream(1, 2)], traces)
    assert sorted(closed) == [0, 1]  # the raising one ended; the other was closed mid-run
    assert len(traces[0].events) in (2, 3) and len(traces[1].events) == 2


def test_bench_ratios_are_the_medians_of_each_lockstep_runs_own_ratio(tiny_models):
    lm = tiny_models("llama")
    prompts = [synthetic_prompt(lm.tokenizer, 40, salt=i) for i in range(2)]
    variants = [("generate", None), ("full", Engine(lm)),
                ("window", Engine(lm, kv=make_kv_policy("window", budget=0.5)))]
    result = run_bench(lm, variants, prompts, GenerationSettings(max_new_tokens=5, ignore_eos=True),
                       repeats=3, warmup=0, log=lambda msg: None)
    rows = {row["variant"]: row for row in result["rows"]}
    full, window, generate = rows["full"]["samples"], rows["window"]["samples"], rows["generate"]["samples"]
    assert len(full) == len(window) == len(generate) == 3  # full ran once beside window per repeat, not alone
    speed = [w["tokens_per_s"] / f["tokens_per_s"] for f, w in zip(full, window)]
    ttft = [w["ttft_s"] / f["ttft_s"] for f, w in zip(full, window)]
    assert rows["window"]["speedup_vs_full"] == pytest.approx(statistics.median(speed))
    assert rows["window"]["ttft_vs_full"] == pytest.approx(statistics.median(ttft))
    assert rows["window"]["speedup_range"] == pytest.approx([min(speed), max(speed)])
    assert rows["window"]["measured_over_ideal"] == pytest.approx(
        rows["window"]["speedup_vs_full"] / rows["window"]["ideal_ratio"])
    assert rows["full"]["speedup_vs_full"] == pytest.approx(1.0) and rows["full"]["speedup_range"] is None
    # model.generate runs alone: its ratio is between medians.
    gen_tps = statistics.median(g["tokens_per_s"] for g in generate)
    full_tps = statistics.median(f["tokens_per_s"] for f in full)
    assert rows["generate"]["speedup_vs_full"] == pytest.approx(gen_tps / full_tps)
    assert all(s["new_tokens"] == 5 for s in full + window)


def test_bench_runs_the_full_model_alone_when_nothing_runs_beside_it(tiny_models):
    lm = tiny_models("llama")
    prompts = [synthetic_prompt(lm.tokenizer, 24)]
    result = run_bench(lm, [("generate", None), ("full", Engine(lm))], prompts,
                       GenerationSettings(max_new_tokens=4, ignore_eos=True), repeats=2, warmup=0,
                       log=lambda msg: None)
    assert [len(row["samples"]) for row in result["rows"]] == [2, 2]
