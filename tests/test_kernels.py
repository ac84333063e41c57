"""The fused CPU kernels (``skipkey.core.kernels``) do exactly what the eager code they replace does."""

import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings as hyp_settings, strategies as st

from conftest import PROMPTS
from skipkey.core import kernels
import skipkey.core.attention as attention
import skipkey.kv.scoring as scoring
from skipkey.core.attention import StepState
from skipkey.kv.scoring import ScoreContribution
from skipkey.core.cache import EMPTY, LayerCache
from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.kv.policies import KV_POLICIES, _PROTECTED, make_kv_policy
from skipkey.kv.noise import NOISE_COLS, noise_table, query_starts
from skipkey.core.trace import Trace

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                reason="no C++ compiler: the kernels cannot be built, the eager path serves")
LONG = PROMPTS[2] + " " + PROMPTS[0]


@pytest.fixture
def fused():
    module = kernels.for_tensors(torch.zeros(1))
    assert module is not None, "a C++ compiler is installed, so the kernels must build"
    return module


def test_the_switch_turns_the_kernels_off(monkeypatch, fused):
    monkeypatch.setenv(kernels.SWITCH, "0")
    assert kernels.for_tensors(torch.zeros(1)) is None
    monkeypatch.setenv(kernels.SWITCH, "1")
    assert kernels.for_tensors(torch.zeros(1)) is fused
    assert kernels.for_tensors(torch.zeros(1, dtype=torch.float64)) is None  # other dtypes stay eager


@pytest.mark.parametrize("family", ["llama", "gemma3", "opt"])
@pytest.mark.parametrize("name", [n for n in KV_POLICIES if n != "full"])
def test_fused_decode_keeps_and_says_what_eager_does(tiny_models, monkeypatch, fused, family, name):
    """Same tokens and the same kept positions at every step and layer, batched (padding included)."""
    lm = tiny_models(family)
    used = []
    real = kernels.for_tensors
    monkeypatch.setattr(kernels, "for_tensors", lambda *t: used.append(real(*t)) or used[-1])

    def run(switch):
        monkeypatch.setenv(kernels.SWITCH, switch)
        engine = Engine(lm, kv=make_kv_policy(name, budget=0.4))
        return Trace.collect(engine, [LONG, PROMPTS[0]], GenerationSettings(max_new_tokens=20), record=True)

    fast = run("1")
    assert any(module is fused for module in used)  # the kernels really ran
    slow = run("0")
    assert fast.tokens(0) == slow.tokens(0) and fast.tokens(1) == slow.tokens(1)
    for a, b in zip(fast.events, slow.events):
        for x, y in zip(a.kept, b.kept):
            np.testing.assert_array_equal(x, y)


def _layer(keys, values, positions, scores, window=None):
    layer = LayerCache(window)
    layer.keys, layer.values, layer.positions, layer.scores = keys, values, positions, scores
    layer.used = layer.held = keys.shape[2]
    layer.reuse = layer.settled = True
    layer.dense = bool((positions >= 0).all())
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("contribution", [ScoreContribution(), ScoreContribution(1.7, 5), ScoreContribution(0.6)])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("d", [16, 64])  # 64: bfloat16's paired (AVX512-BF16) path where the CPU has one
def test_attend_score_equals_the_eager_matmul_softmax_matmul(monkeypatch, fused, dtype, groups, contribution,
                                                           window, accumulate, d):
    torch.manual_seed(0)
    b, hkv, slots = 2, 2, 77
    query = torch.randn(b, hkv * groups, 1, d).to(dtype)
    keys, values = torch.randn(b, hkv, slots, d).to(dtype), torch.randn(b, hkv, slots, d).to(dtype)
    positions = torch.stack([torch.randperm(85)[:slots] for _ in range(b * hkv)]).view(b, hkv, slots)
    positions[:, :, ::7] = EMPTY
    qpos = torch.tensor([[95], [88]])
    start = torch.rand(b, hkv, slots)
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv(kernels.SWITCH, switch)
        layer = _layer(keys.clone(), values.clone(), positions.clone(), start.clone(), window)
        state = StepState(cache=None, query_positions=qpos, dense=True, contribution=contribution,
                          accumulate=accumulate, position_limit=96)
        out = contribution.attend_and_score(layer, 3, query, (layer.keys, layer.values, layer.positions), d ** -0.5,
                                            state)
        results.append((out.float(), layer.scores))
    (out, scores), (ref_out, ref_scores) = results
    # The kernel keeps logits and output in float32 where eager rounds them to bfloat16.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(scores, ref_scores, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("window", [None, 40])
def test_attention_alone_is_the_eager_attention_over_the_same_slots(monkeypatch, fused, dtype, groups, window):
    """An evicting layer that is not scored (window, streaming) takes ``attend_score`` without scores: the
    output of the eager path over the same out-of-order slots, holes and window included."""
    torch.manual_seed(2)
    b, hkv, slots, d = 2, 2, 77, 64
    query = torch.randn(b, hkv * groups, 1, d).to(dtype)
    keys, values = torch.randn(b, hkv, slots, d).to(dtype), torch.randn(b, hkv, slots, d).to(dtype)
    positions = torch.stack([torch.randperm(85)[:slots] for _ in range(b * hkv)]).view(b, hkv, slots)
    positions[:, :, ::7] = EMPTY
    qpos = torch.tensor([[95], [88]])
    layer = _layer(keys, values, positions, None, window)
    state = StepState(cache=None, query_positions=qpos, dense=True, contribution=ScoreContribution(),
                      accumulate=False, position_limit=96)
    alone = attention.attend_fused(fused, layer, query, (keys, values, positions), d ** -0.5, state)
    assert layer.scores is None  # nothing scored, nothing allocated for it
    monkeypatch.setenv(kernels.SWITCH, "0")
    layer.scores = torch.zeros(b, hkv, slots)
    reference = state.contribution.attend_and_score(layer, 3, query, (keys, values, positions), d ** -0.5, state)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(alone.float(), reference.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("contribution", [ScoreContribution(), ScoreContribution(1.3, 4)])
@pytest.mark.parametrize("observe", [0, 5])
@pytest.mark.parametrize("d", [8, 64])  # 64: bfloat16's AMX tiles where the CPU has them (whole and padded tiles)
def test_prompt_scores_equal_the_eager_ones(monkeypatch, fused, dtype, window, contribution, observe, d):
    """Prompt scoring (``score_prompt``) in chunks, with padding, a window, GQA, noise and an observation window."""
    fast, eager = _prompt_scores(monkeypatch, dtype, window, contribution, observe, d)
    assert fast.abs().sum() > 0
    # The kernel keeps the logits in float32 where eager rounds them to bfloat16.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast, eager, rtol=tol, atol=tol)


def _prompt_scores(monkeypatch, dtype, window, contribution, observe, d, s=70) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's prompt scores with the kernels and without: two rows (one left-padded), GQA, chunks of 16."""
    torch.manual_seed(0)
    b, hkv, groups = 2, 2, 2
    query, key = torch.randn(b, hkv * groups, s, d).to(dtype), torch.randn(b, hkv, s, d).to(dtype)
    pad = 9  # the second row is left-padded
    qpos = torch.stack([torch.arange(s), torch.arange(s) - pad]).clamp(min=-1)
    monkeypatch.setattr(scoring, "SCORE_CHUNK", 16)
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv(kernels.SWITCH, switch)
        layer = LayerCache(window)
        layer.write(key, key, qpos, dense=False)
        scoring.accumulate_scores(layer, 3, query, key, d ** -0.5, StepState(
            cache=None, query_positions=qpos, contribution=contribution, observe=observe, position_limit=s))
        results.append(layer.scores)
    return results[0], results[1]


@pytest.fixture(scope="module")
def built_for_avx2():
    """The kernels as built for a CPU with AVX2 and FMA but no AVX-512 (``-march=x86-64-v3``): their prompt
    scoring takes the portable path. A float32 prompt pass there once took ten times the full model's (#44)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU cannot run AVX2 code")
    from torch.utils.cpp_extension import load
    flags = ["-march=x86-64-v3" if flag == "-march=native" else flag for flag in kernels._FLAGS]
    return load(name="skipkey_decode_step_test_x86_64_v3", sources=[str(kernels.SOURCE)], extra_cflags=flags,
                extra_ldflags=["-fopenmp"], verbose=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("contribution", [ScoreContribution(), ScoreContribution(1.3, 4)])
def test_prompt_scores_without_avx512_equal_the_eager_ones(monkeypatch, fused, built_for_avx2, dtype, window,
                                                          contribution):
    """The portable path (blocks of 16 keys and a zero-padded last block: 75 slots leave 11) scores as eager
    does, and in float32 as the AVX-512 build does (the same fused multiply-adds in the same order)."""
    native, _ = _prompt_scores(monkeypatch, dtype, window, contribution, 0, 64, s=75)
    monkeypatch.setattr(kernels, "_built", lambda: built_for_avx2)
    monkeypatch.setenv(kernels.SWITCH, "1")
    assert kernels.for_tensors(torch.zeros(1)) is built_for_avx2 and not built_for_avx2.bf16_pairs()
    portable, eager = _prompt_scores(monkeypatch, dtype, window, contribution, 0, 64, s=75)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(portable, eager, rtol=tol, atol=tol)
    if dtype == torch.float32:
        torch.testing.assert_close(portable, native, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_queries_past_the_noise_row_take_the_general_path_beside_the_fast_one(monkeypatch, fused, dtype):
    """A query seeing more keys than a noise row holds takes the general path (noise gathered key by key), the
    queries before it the fast one (one contiguous run): with 32-column rows, a 40-token prompt mixes both in
    one block of queries."""
    import skipkey.kv.noise as noise
    cols = 32
    for module in (noise, scoring):
        monkeypatch.setattr(module, "NOISE_COLS", cols)
    for cached in (noise.noise_table, noise._query_table):
        cached.cache_clear()
    monkeypatch.setattr(noise, "NOISE_ROWS", 16)
    torch.manual_seed(3)
    b, h, s, d = 1, 2, 40, 64
    query, key = torch.randn(b, h, s, d).to(dtype), torch.randn(b, h, s, d).to(dtype)
    qpos = torch.arange(s)[None]
    results = []
    try:
        for switch in ("1", "0"):
            monkeypatch.setenv(kernels.SWITCH, switch)
            layer = LayerCache(None)
            layer.write(key, key, qpos, dense=False)
            scoring.accumulate_scores(layer, 3, query, key, d ** -0.5, StepState(
                cache=None, query_positions=qpos, contribution=ScoreContribution(1.0, 5), position_limit=s))
            results.append(layer.scores)
    finally:
        for cached in (noise.noise_table, noise._query_table):
            cached.cache_clear()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(results[0], results[1], rtol=tol, atol=tol)


def test_attend_score_draws_the_noise_gumbel_noise_draws(fused):
    """The kernel's noise index (start + key position mod the table width) is ``gumbel_noise``'s."""
    torch.manual_seed(1)
    b, h, slots, d, seed = 1, 2, 50, 8, 9
    query = torch.randn(b, h, 1, d)
    keys, values = torch.randn(b, h, slots, d), torch.randn(b, h, slots, d)
    positions = torch.randperm(20000)[:slots].view(1, 1, slots).expand(b, h, slots).contiguous()  # past NOISE_COLS
    qpos = torch.tensor([20000])
    starts = query_starts(seed, 2, h, 1, torch.device("cpu"), qpos[:, None], None).reshape(b, h, 1).contiguous()
    scores = torch.zeros(b, h, slots)
    fused.attend_score(query, 1.0, keys, values, positions, qpos, 0, False, scores, True,
                       noise_table(seed, "cpu").view(-1), starts, NOISE_COLS, 1.0)
    from skipkey.kv.scoring import NoiseIndex
    logits = torch.einsum("bhd,bhsd->bhs", query[:, :, 0], keys)[:, :, None, None, :]
    expected = ScoreContribution(1.0, seed)(logits, NoiseIndex(2, qpos[:, None], positions))[:, :, 0, 0]
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)


@hyp_settings(max_examples=60, deadline=None)
@given(heads=st.sampled_from([(1, 1), (1, 3), (3, 1), (3, 3)]), slots=st.integers(1, 70), levels=st.integers(1, 6),
       seed=st.integers(0, 2**31))
def test_lowest_unprotected_is_the_masked_minimum(heads, slots, levels, seed):
    fused = kernels.for_tensors(torch.zeros(1))
    generator = torch.Generator().manual_seed(seed)
    prio_heads, pos_heads = heads
    priority = torch.randint(0, levels, (2, prio_heads, slots), generator=generator).float()  # many ties
    priority[0, 0, 0] = float("inf")  # an attention sink
    positions = torch.randint(-1, 60, (2, pos_heads, slots), generator=generator)
    next_positions, recent = torch.tensor([50, 40]), torch.tensor([10, 3])
    protected = positions >= (next_positions - recent)[:, None, None]
    expected = priority.masked_fill(protected, _PROTECTED).min(dim=-1, keepdim=True).indices
    assert torch.equal(fused.lowest_unprotected(priority, positions, next_positions, recent), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pos_heads", [1, 3])
@pytest.mark.parametrize("started", [False, True])  # new tokens' scores: 0, or a policy's start score (SnapKV)
def test_write_slot_writes_what_index_put_writes(fused, dtype, pos_heads, started):
    torch.manual_seed(2)
    b, h, capacity, d = 2, 3, 9, 4
    storage = [torch.randn(b, h, capacity, d).to(dtype) for _ in range(2)]
    positions = torch.randint(0, 50, (b, pos_heads, capacity))
    scores = torch.rand(b, pos_heads, capacity)
    slot = torch.randint(0, capacity, (b, pos_heads, 1))
    new_keys, new_values = torch.randn(b, h, 1, d).to(dtype), torch.randn(b, h, 1, d).to(dtype)
    new_positions = torch.tensor([[60], [61]])
    eager = _layer(storage[0].clone(), storage[1].clone(), positions.clone(), scores.clone())
    start = torch.tensor([-0.25, -0.5]) if started else None
    eager._write_slot(slot, new_keys, new_values, new_positions, start)
    fast = _layer(storage[0].clone(), storage[1].clone(), positions.clone(), scores.clone())
    fused.write_slot(fast.keys, fast.values, fast.positions, fast.scores, slot, new_keys, new_values,
                     new_positions.reshape(-1), start if started else torch.empty(0))
    for name in ("keys", "values", "positions", "scores"):
        assert torch.equal(getattr(fast, name), getattr(eager, name)), name


def test_bad_inputs_are_refused_not_written(fused):
    keys = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        fused.write_slot(keys, keys.clone(), torch.zeros(1, 1, 4, dtype=torch.long), torch.empty(0),
                         torch.tensor([[[4]]]), torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8), torch.tensor([5]),
                         torch.empty(0))
    with pytest.raises(RuntimeError, match="one dtype"):
        fused.attend_score(torch.zeros(1, 2, 1, 8, dtype=torch.bfloat16), 1.0, keys, keys, torch.zeros(1, 1, 4, dtype=torch.long),
                           torch.tensor([3]), 0, False, torch.zeros(1, 2, 4), True, torch.empty(0),
                           torch.empty(0, dtype=torch.long), NOISE_COLS, 1.0)
