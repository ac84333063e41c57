"""KV policies: budgets hold exactly, the methods keep what they claim, eviction is exact."""

import numpy as np
import pytest
import torch

from conftest import PROMPTS, record_logits
from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.core.tiny import FAMILIES
from skipkey.errors import InputError
from skipkey.kv.policies import KV_POLICIES as POLICIES, KeyformerPolicy, make_kv_policy, parse_budget
from skipkey.skipdecode.schedules import LinearSchedule
from skipkey.skipdecode.plan import SkipDecode
from skipkey.quality.teacher_forced import teacher_forced_logits
from skipkey.core.trace import Trace

LONG = PROMPTS[2] + " " + PROMPTS[0]
EVICTING = [name for name in POLICIES if name != "full"]


def valid_counts(kept_layer):
    return (kept_layer >= 0).sum(-1)  # [B, Hp]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", EVICTING)
def test_cache_holds_exactly_the_budget(tiny_models, name, family):
    lm = tiny_models(family)
    policy = make_kv_policy(name, budget=0.5)
    engine = Engine(lm, kv=policy)
    prompt_len = len(lm.tokenizer(LONG)["input_ids"])
    budget = policy.budget_tokens(prompt_len)
    for event in engine.generate([LONG], GenerationSettings(max_new_tokens=10), record=True):
        for idx, kept in enumerate(event.kept):
            window = engine.arch.layer_info[idx].sliding_window  # a sliding layer holds its window if smaller
            k = min(window - 1, budget) if window else budget
            assert kept.shape[-1] == k
            assert (valid_counts(kept) == k).all()
            # Every kept position is a real token seen so far, no duplicates per head.
            for head in kept[0]:
                assert len(set(head.tolist())) == k and head.max() < prompt_len + event.step


def test_sliding_layers_hold_the_smaller_of_window_and_budget(tiny_models):
    lm = tiny_models("gemma3")  # window 8
    engine = Engine(lm, kv=make_kv_policy("keyformer", budget=20))
    for event in engine.generate([LONG], GenerationSettings(max_new_tokens=8), record=True):
        for idx, kept in enumerate(event.kept):
            window = engine.arch.layer_info[idx].sliding_window
            expected = min(window - 1, 20) if window else 20
            assert (valid_counts(kept) == expected).all()
            assert kept.shape[-1] == expected  # physically shrunk, not padded with empty slots
            if window:
                assert kept[kept >= 0].min() > event.step + event.prompt_lengths[0] - window \
                    if event.prompt_lengths else True


def test_h2o_equals_keyformer_without_noise(tiny_models):
    lm = tiny_models("llama")
    settings = GenerationSettings(max_new_tokens=16)
    h2o = Trace.collect(Engine(lm, kv=make_kv_policy("h2o", budget=0.4)), [LONG], settings, record=True)
    kf = KeyformerPolicy(budget=0.4, tau_init=1.0, tau_end=1.0, noise=False)
    plain = Trace.collect(Engine(lm, kv=kf), [LONG], settings, record=True)
    assert plain.tokens() == h2o.tokens()
    for a, b in zip(h2o.events, plain.events):
        for x, y in zip(a.kept, b.kept):
            np.testing.assert_array_equal(x, y)


def test_streaming_keeps_sinks_and_the_most_recent(tiny_models):
    lm = tiny_models("llama")
    k = 12
    for event in Engine(lm, kv=make_kv_policy("streaming", budget=k)).generate(
            [LONG], GenerationSettings(max_new_tokens=6), record=True):
        latest = event.prompt_lengths[0] - 1 if event.step == 0 else None
        for kept in event.kept:
            positions = kept[0, 0].tolist()
            assert positions[:4] == [0, 1, 2, 3]
            assert positions[4:] == list(range(positions[-1] - (k - 5), positions[-1] + 1))
            if latest is not None:
                assert positions[-1] == latest


def test_window_keeps_the_last_k(tiny_models):
    lm = tiny_models("opt")
    event = next(Engine(lm, kv=make_kv_policy("window", budget=10)).generate([LONG], record=True))
    n = event.prompt_lengths[0]
    assert event.kept[0][0, 0].tolist() == list(range(n - 10, n))


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("family", FAMILIES)
def test_budget_above_final_length_is_full_mode(tiny_models, name, family):
    lm = tiny_models(family)
    settings = GenerationSettings(max_new_tokens=12)
    full = Trace.collect(Engine(lm), [LONG], settings)
    policy = make_kv_policy(name, budget=400)
    assert Trace.collect(Engine(lm, kv=policy), [LONG], settings).tokens() == full.tokens()


def test_seed_decides_keyformer_choice(tiny_models):
    lm = tiny_models("llama")
    settings = GenerationSettings(max_new_tokens=8)

    def kept_sets(seed):
        trace = Trace.collect(Engine(lm, kv=make_kv_policy("keyformer", budget=0.3, seed=seed)), [LONG],
                              settings, record=True)
        return [tuple(k.ravel().tolist()) for e in trace.events for k in e.kept]

    assert kept_sets(0) == kept_sets(0)
    assert any(kept_sets(0) != kept_sets(s) for s in (1, 2, 3))


@pytest.mark.parametrize("name", EVICTING)
def test_batch_rows_evict_as_they_would_alone(tiny_models, name):
    lm = tiny_models("gemma3")
    policy = make_kv_policy(name, budget=0.5)
    settings = GenerationSettings(max_new_tokens=10)
    prompts = [LONG, PROMPTS[0], PROMPTS[2]]
    batch = Trace.collect(Engine(lm, kv=policy), prompts, settings)
    for row, prompt in enumerate(prompts):
        assert batch.tokens(row) == Trace.collect(Engine(lm, kv=policy), [prompt], settings).tokens(), row


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["keyformer", "streaming"])
def test_combined_decode_equals_no_cache_reference(tiny_models, monkeypatch, family, name):
    lm = tiny_models(family)
    windows = [info.sliding_window for info in Engine(lm).arch.layer_info]
    # Where every layer slides (Mistral), only a budget below the 8-token window evicts anything.
    budget = 6 if all(windows) else 0.5
    engine = Engine(lm, skip=SkipDecode(LinearSchedule(b_max=6, b_min=3, horizon=10)),
                    kv=make_kv_policy(name, budget=budget))
    prompt_ids = lm.tokenizer(LONG)["input_ids"]
    head_out = record_logits(monkeypatch, engine.arch)
    trace = Trace.collect(engine, [prompt_ids], GenerationSettings(max_new_tokens=16, ignore_eos=True), record=True)
    monkeypatch.undo()
    tokens = trace.tokens()
    ids = torch.tensor([prompt_ids + tokens[:-1]], device=lm.device)
    kept = [e.kept for e in trace.events]
    with torch.no_grad():
        ref = teacher_forced_logits(engine.arch, ids, len(prompt_ids), trace.layer_sets[1:], kept)
        no_evict = teacher_forced_logits(engine.arch, ids, len(prompt_ids), trace.layer_sets[1:])
    engine_logits = torch.stack([logits[0, -1] for logits in head_out])
    torch.testing.assert_close(engine_logits, ref[len(prompt_ids) - 1:], rtol=1e-4, atol=1e-4)
    assert (no_evict[-5:] - ref[-5:]).abs().max() > 1e-3  # eviction really changed the attention


@pytest.mark.parametrize("value, parsed", [(0.5, 0.5), (1, 1.0), ("0.25", 0.25), (256, 256), ("64", 64)])
def test_budget_parsing(value, parsed):
    assert parse_budget(value) == parsed


@pytest.mark.parametrize("value", [0, 1.5, -3, "abc", float("nan"), 2.5])
def test_bad_budgets_are_refused(value):
    with pytest.raises(InputError, match="KV budget"):
        parse_budget(value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="lru"), "unknown KV policy"),
    (dict(name="keyformer", recent=1.5), "recent"),
    (dict(name="keyformer", tau_init=0), "tau_init"),
    (dict(name="keyformer", tau_end=-1), "tau_end"),
    (dict(name="h2o", seed=-1), "seed"),
])
def test_bad_policy_parameters_are_refused(kwargs, message):
    with pytest.raises(InputError, match=message):
        make_kv_policy(**kwargs)


def test_gumbel_noise_is_gumbel_and_keyed_by_position():
    from skipkey.kv.scoring import NoiseIndex
    from skipkey.kv.noise import gumbel_noise

    where = NoiseIndex(3, torch.arange(200)[None], torch.arange(300)[None, None])
    g = gumbel_noise(7, where, (1, 2, 2, 200, 300))
    assert abs(g.mean().item() - 0.5772) < 0.02 and abs(g.var().item() - np.pi ** 2 / 6) < 0.05
    shuffled = NoiseIndex(3, torch.arange(200)[None], torch.arange(300).flip(0)[None, None])
    torch.testing.assert_close(gumbel_noise(7, shuffled, (1, 2, 2, 200, 300)), g.flip(-1))
    assert not torch.equal(gumbel_noise(8, where, (1, 2, 2, 200, 300)), g)


@pytest.mark.parametrize("name", ["h2o", "keyformer"])
def test_chunked_prefill_scoring_keeps_the_same_tokens(tiny_models, monkeypatch, name):
    import skipkey.kv.scoring as scoring

    lm = tiny_models("gemma3")  # sliding layers skip chunks that only see dropped keys
    settings = GenerationSettings(max_new_tokens=4)

    def kept():
        trace = Trace.collect(Engine(lm, kv=make_kv_policy(name, budget=0.5)), [LONG, PROMPTS[0]], settings,
                              record=True)
        return [k for e in trace.events for k in e.kept]

    monkeypatch.setattr(scoring, "SCORE_CHUNK", 4096)
    whole = kept()
    monkeypatch.setattr(scoring, "SCORE_CHUNK", 16)
    for a, b in zip(whole, kept()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("window", [None, 24])
def test_prefill_scores_are_the_same_in_any_chunking(monkeypatch, window):
    """Scoring only each chunk's causal (and window) band equals scoring every key."""
    import skipkey.kv.scoring as scoring
    from skipkey.core.attention import StepState
    from skipkey.core.cache import LayerCache

    torch.manual_seed(0)
    b, hkv, groups, s, d = 2, 2, 2, 70, 8
    query, key = torch.randn(b, hkv * groups, s, d), torch.randn(b, hkv, s, d)
    pad = 9  # the second row is left-padded
    qpos = torch.stack([torch.arange(s), torch.arange(s) - pad]).clamp(min=-1)
    policy = make_kv_policy("keyformer", budget=0.5)

    def scores(chunk):
        monkeypatch.setattr(scoring, "SCORE_CHUNK", chunk)
        layer = LayerCache(window)
        layer.write(key, key, qpos, dense=False)
        scoring.accumulate_scores(layer, 3, query, key, d ** -0.5, StepState(
            cache=None, query_positions=qpos, contribution=policy.score_contribution(0, 10)))
        return layer.scores

    # A sliding layer keeps only its window after the prompt; chunks that see none of it are skipped.
    survives = (qpos >= 0) if window is None else (qpos > qpos.max(dim=1, keepdim=True).values - window)
    survives = survives[:, None, :].expand(b, hkv, s)
    whole = scores(4096)
    for chunk in (7, 16, 33):
        torch.testing.assert_close(scores(chunk)[survives], whole[survives], rtol=1e-5, atol=1e-5)
    assert whole[1, :, :pad].abs().sum() == 0 and whole[survives].min() > 0  # padding is never scored


def test_a_soft_capped_layer_scores_its_capped_attention_weights():
    """Gemma 2 caps its attention logits: H2O's prompt scores are then the weights its attention really used."""
    import skipkey.kv.scoring as scoring
    from skipkey.core.attention import StepState
    from skipkey.core.cache import LayerCache

    torch.manual_seed(0)
    b, hkv, groups, s, d, cap = 1, 2, 2, 30, 8, 1.0
    query, key = torch.randn(b, hkv * groups, s, d), torch.randn(b, hkv, s, d)
    qpos = torch.arange(s)[None]

    def scores(softcap):
        layer = LayerCache(None)
        layer.write(key, key, qpos, dense=True)
        scoring.accumulate_scores(layer, 3, query, key, d ** -0.5, StepState(
            cache=None, query_positions=qpos, contribution=make_kv_policy("h2o", budget=0.5).score_contribution(0, 1)),
            softcap)
        return layer.scores

    logits = query @ key.repeat_interleave(groups, dim=1).transpose(-1, -2) * d ** -0.5
    capped = (torch.tanh(logits / cap) * cap).masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    weights = torch.softmax(capped, dim=-1).sum(dim=2).view(b, hkv, groups, s).sum(dim=2)
    torch.testing.assert_close(scores(cap), weights, rtol=1e-5, atol=1e-5)
    assert (scores(None) - weights).abs().max() > 1e-2  # the cap matters here


@pytest.mark.parametrize("kernels_on", ["1", "0"])  # the fused CPU kernels (where they build), the eager path
def test_an_observation_window_scores_observe_times_prompt_logits(tiny_models, monkeypatch, kernels_on):
    """The prompt pass of ``observe=8`` computes 8 x P logits per query head and layer, not about P^2 / 2
    (counted, not timed): the scored prompt costs what the window asks for at any length."""
    import skipkey.kv.scoring as scoring
    from skipkey.core import kernels

    monkeypatch.setenv(kernels.SWITCH, kernels_on)
    counted = []
    score = scoring.accumulate_scores
    monkeypatch.setattr(scoring, "accumulate_scores", lambda *args: counted.append(score(*args)) or counted[-1])
    lm = tiny_models("llama")
    heads, layers = lm.model.config.num_attention_heads, lm.model.config.num_hidden_layers

    def logits(length, **options):
        counted.clear()
        prompt = [3 + (7 * i) % 250 for i in range(length)]
        Trace.collect(Engine(lm, kv=make_kv_policy("keyformer", budget=0.5, **options)), [prompt],
                      GenerationSettings(max_new_tokens=2))
        assert len(counted) == layers  # the prompt pass of every layer, and no decode step
        return sum(counted)

    for length in (150, 300):
        assert logits(length, observe=8) == layers * heads * 8 * length
        # Without the window every query is scored: its causal triangle, at least.
        assert logits(length) >= layers * heads * length * (length + 1) // 2


def test_gumbel_noise_is_finite_for_every_draw():
    """The extreme 24-bit draws (0 and 2**24 - 1) give finite noise: in float32 the top one used to round to
    u = 1.0, an infinite Gumbel value, a NaN softmax row, and a whole head's scores turned to NaN."""
    from skipkey.kv.noise import _gumbel_from_bits

    bits = torch.tensor([0, 1, 2**23, 2**24 - 2, 2**24 - 1], dtype=torch.int64)
    noise = _gumbel_from_bits(bits)
    assert torch.isfinite(noise).all()
    assert noise[0] < noise[1] < noise[2] < noise[3] <= noise[4]


def test_keyformer_scores_stay_finite_on_a_long_prompt_and_every_head_keeps_its_budget(tiny_models):
    lm = tiny_models("llama")
    ids = [1 + (i * 7919) % 250 for i in range(900)]
    trace = Trace.collect(Engine(lm, kv=make_kv_policy("keyformer", budget=0.25)), [ids],
                          GenerationSettings(max_new_tokens=3), record=True)
    k = round(0.25 * len(ids))
    for event in trace.events:
        for kept in event.kept:
            assert ((kept[0] >= 0).sum(-1) == k).all()


def test_gumbel_noise_is_the_same_through_every_fast_path():
    """The tabulated per-query draws and the contiguous-key read give exactly the hashed noise."""
    from skipkey.kv.scoring import NoiseIndex
    from skipkey.kv.noise import gumbel_noise

    qpos = torch.tensor([[5, 6, 7, 8], [0, 1, 2, 3]])
    kpos = torch.stack([torch.arange(-3, 57), torch.arange(-8, 52)])[:, None, :]
    shape = (2, 2, 3, 4, 60)
    hashed = gumbel_noise(11, NoiseIndex(4, qpos, kpos), shape)
    tabulated = gumbel_noise(11, NoiseIndex(4, qpos, kpos, position_limit=9), shape)
    contiguous = gumbel_noise(11, NoiseIndex(4, qpos, kpos, key_start=kpos[:, 0, 0], position_limit=9), shape)
    torch.testing.assert_close(tabulated, hashed, rtol=0, atol=0)
    torch.testing.assert_close(contiguous, hashed, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_one_recorded_prompt_pass_serves_every_policy(tiny_models, family):
    """Decoding from a shared prompt pass is decoding after running the prompt: same tokens, same kept sets."""
    lm = tiny_models(family)
    prompts = [LONG, PROMPTS[0]]
    settings = GenerationSettings(max_new_tokens=8)
    recorded = Engine(lm).prompt_pass(prompts)
    specs = [("full", {}), ("keyformer", {}), ("keyformer", dict(observe=8, pool=3, normalize=True)),
             ("h2o", {}), ("tova", {}), ("snapkv", dict(observe=6)), ("streaming", {})]
    for name, options in specs:
        for budget in (0.3, 0.7):
            engine = Engine(lm, kv=make_kv_policy(name, budget, **options))
            fresh = Trace.collect(engine, prompts, settings, record=True)
            shared = Trace.for_engine(engine)
            for event in engine.generate(prompts, settings, record=True, prompt_pass=recorded):
                shared.add(event)
            for row in range(len(prompts)):
                assert shared.tokens(row) == fresh.tokens(row), (name, options, budget, row)
            for a, b in zip(fresh.events, shared.events):
                for x, y in zip(a.kept, b.kept):
                    np.testing.assert_array_equal(x, y)


def test_a_recorded_prompt_pass_refuses_other_prompts(tiny_models):
    lm = tiny_models("llama")
    recorded = Engine(lm).prompt_pass([LONG])
    with pytest.raises(InputError, match="other prompts"):
        next(Engine(lm, kv=make_kv_policy("h2o", 0.5)).generate([PROMPTS[0]], prompt_pass=recorded))


@pytest.mark.parametrize("spec", ["keyformer", "keyformer:observe=32,pool=7", "h2o:normalize=true",
                                  "keyformer:tau_init=0.5,observe=8"])
def test_a_policy_spec_formats_back_to_itself(spec):
    from skipkey.kv.policies import format_policy_spec, parse_policy_spec

    assert format_policy_spec(*parse_policy_spec(spec)) == spec
    assert format_policy_spec(*parse_policy_spec("h2o:normalize=1")) == "h2o:normalize=true"
