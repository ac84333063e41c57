"""The engine in full mode: parity with ``generate``, batching, stopping, bad input."""

import threading

import pytest
import torch

from conftest import PROMPTS
from skipkey.config import MAX_NEW_TOKENS_CAP, GenerationSettings
from skipkey.core.engine import Engine
from skipkey.errors import InputError
from skipkey.core.tiny import FAMILIES
from skipkey.core.trace import Trace


def hf_greedy(lm, prompt, n):
    ids = lm.tokenizer(prompt)["input_ids"]
    out = lm.model.generate(torch.tensor([ids], device=lm.device),
                            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=lm.device),
                            max_new_tokens=n, do_sample=False)
    new = out[0, len(ids):].tolist()
    eos = lm.model.generation_config.eos_token_id
    return new[: new.index(eos) + 1] if eos in new else new


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompt", PROMPTS[::2])
def test_full_mode_matches_generate(tiny_models, family, prompt):
    # The prompts are longer than the tiny models' 8-token sliding window (Gemma 3, Mistral).
    lm = tiny_models(family)
    trace = Trace.collect(Engine(lm), [prompt], GenerationSettings(max_new_tokens=40))
    assert trace.tokens() == hf_greedy(lm, prompt, 40)


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_rows_match_their_solo_runs(tiny_models, family):
    lm = tiny_models(family)
    settings = GenerationSettings(max_new_tokens=24)
    batch = Trace.collect(Engine(lm), PROMPTS, settings)
    for row, prompt in enumerate(PROMPTS):
        solo = Trace.collect(Engine(lm), [prompt], settings)
        assert batch.tokens(row) == solo.tokens(), f"row {row}"
        assert batch.text(row) == solo.text()


def test_sampling_is_seeded(tiny_models):
    lm = tiny_models("gemma3")
    a = GenerationSettings(max_new_tokens=30, do_sample=True, temperature=1.5, top_k=50, top_p=0.95, seed=1)
    b = GenerationSettings(max_new_tokens=30, do_sample=True, temperature=1.5, top_k=50, top_p=0.95, seed=2)
    first = Trace.collect(Engine(lm), [PROMPTS[0]], a).tokens()
    assert first == Trace.collect(Engine(lm), [PROMPTS[0]], a).tokens()
    assert first != Trace.collect(Engine(lm), [PROMPTS[0]], b).tokens()


def test_stops_on_eos(tiny_models):
    lm = tiny_models("llama")
    eos = lm.model.generation_config.eos_token_id
    greedy = Trace.collect(Engine(lm), [PROMPTS[0]], GenerationSettings(max_new_tokens=10)).tokens()
    # Make the third greedy token the EOS by pointing its id's logit at EOS: run with an
    # engine whose eos set contains that token instead.
    engine = Engine(lm)
    engine.eos_ids = {greedy[2]}
    trace = Trace.collect(engine, [PROMPTS[0]], GenerationSettings(max_new_tokens=10))
    stop_at = greedy.index(greedy[2])
    assert trace.tokens() == greedy[: stop_at + 1]
    assert len(trace.events) == stop_at + 1 and trace.events[-1].finished == (True,)
    assert eos is not None


def test_stop_event_from_another_thread(tiny_models):
    lm = tiny_models("llama")
    stop = threading.Event()
    seen = []
    for event in Engine(lm).generate([PROMPTS[0]], GenerationSettings(max_new_tokens=200), stop=stop):
        seen.append(event)
        if len(seen) == 5:
            threading.Thread(target=stop.set).start()
            threading.Event().wait(0.05)
    assert 5 <= len(seen) <= 6


def test_cache_holds_prompt_plus_generated_and_windows(tiny_models):
    lm = tiny_models("gemma3")
    engine = Engine(lm)
    prompt_len = len(lm.tokenizer(PROMPTS[0])["input_ids"])
    for event in engine.generate([PROMPTS[0]], GenerationSettings(max_new_tokens=12)):
        for idx, length in enumerate(event.cache_lengths):
            full = prompt_len + event.step
            window = engine.arch.layer_info[idx].sliding_window
            assert length == (min(full, window - 1) if window else full)


@pytest.mark.parametrize("bad, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be in 1.."),
    (dict(max_new_tokens=MAX_NEW_TOKENS_CAP + 1), f"1..{MAX_NEW_TOKENS_CAP}"),
    (dict(max_new_tokens=2.5), "whole number"),
    (dict(temperature=0), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(seed=-3), "seed"),
])
def test_bad_settings_are_refused(bad, message):
    with pytest.raises(InputError, match=message):
        GenerationSettings(**bad)


def test_bad_prompts_are_refused(tiny_models):
    lm = tiny_models("llama")
    engine = Engine(lm)
    with pytest.raises(InputError, match="empty"):
        next(engine.generate(["   "]))
    with pytest.raises(InputError, match="context of 1024 tokens"):
        next(engine.generate(["x" * 1100]))
    with pytest.raises(InputError, match="no prompt"):
        next(engine.generate([]))


@pytest.mark.parametrize("family", FAMILIES)  # the logits themselves: each family's final soft cap or scaling
def test_forced_decode_logprobs_match_a_full_forward(tiny_models, family):
    lm = tiny_models(family)
    prompt = lm.tokenizer(PROMPTS[2])["input_ids"]
    continuation = lm.tokenizer(" and then the story went on for a while")["input_ids"]
    events = list(Engine(lm).generate([prompt], forced=[continuation]))
    assert [e.tokens[0] for e in events] == continuation
    with torch.no_grad():
        logits = lm.model(torch.tensor([prompt + continuation], device=lm.device)).logits[0].float().cpu()
    logp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(continuation)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([e.logprobs[0] for e in events]), logp, rtol=1e-4, atol=1e-4)
    # The model's own choice at each forced position (teacher-forced next-token accuracy counts these).
    assert [e.greedy[0] for e in events] == logits[len(prompt) - 1:-1].argmax(-1).tolist()
    assert all(e.greedy is None for e in Engine(lm).generate([prompt], GenerationSettings(max_new_tokens=3)))


def test_max_new_tokens_beyond_context_is_refused_with_its_range(tiny_models):
    with pytest.raises(InputError, match="max_new_tokens=1500 leaves no room"):
        next(Engine(tiny_models("llama")).generate(["hi"], GenerationSettings(max_new_tokens=1500)))
