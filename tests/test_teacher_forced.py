"""The batched teacher-forced forward: what the engine's cached decode computes, for a padded batch."""

import pytest
import torch

from conftest import PROMPTS, record_logits
from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.core.tiny import FAMILIES
from skipkey.errors import InputError
from skipkey.skipdecode.schedules import LinearSchedule
from skipkey.skipdecode.plan import SkipDecode
from skipkey.quality.teacher_forced import teacher_forced_logits, teacher_forced_logits_batch

STEPS = 14


def engine_run(lm, monkeypatch, policy="top"):
    """Prompt ids, generated tokens per row, layer sets and the engine's own logits ``[B, N, V]``."""
    importance = (0.5, 0.1, 0.4, 0.2, 0.3, 0.6) if policy == "importance" else None
    engine = Engine(lm, skip=SkipDecode(LinearSchedule(b_max=6, b_min=2, horizon=10), policy, importance))
    seen = record_logits(monkeypatch, engine.arch)
    prompt_ids = [lm.tokenizer(p)["input_ids"] for p in PROMPTS]
    tokens, layer_sets = [], []
    for event in engine.generate(prompt_ids, GenerationSettings(max_new_tokens=STEPS, ignore_eos=True)):
        tokens.append(event.tokens)
        layer_sets.append(event.layers)
    monkeypatch.undo()
    generated = [[step[r] for step in tokens] for r in range(len(PROMPTS))]
    return engine.arch, prompt_ids, generated, layer_sets[1:], torch.cat([s[:, -1:] for s in seen], dim=1)


def padded(prompt_ids, generated, side):
    """Rows ``prompt + generated[:-1]`` padded on ``side``, their mask, and where each row's logits sit."""
    rows = [p + g[:-1] for p, g in zip(prompt_ids, generated)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    at = torch.zeros_like(ids, dtype=torch.bool)
    for r, (row, prompt) in enumerate(zip(rows, prompt_ids)):
        start = width - len(row) if side == "left" else 0
        ids[r, start:start + len(row)] = torch.tensor(row)
        mask[r, start:start + len(row)] = 1
        at[r, start + len(prompt) - 1:start + len(row)] = True
    return ids, mask, at


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["top", "importance"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_batch_equals_engine_cached_decode(tiny_models, monkeypatch, family, policy, side):
    lm = tiny_models(family)
    adapter, prompt_ids, generated, layer_sets, engine_logits = engine_run(lm, monkeypatch, policy)
    ids, mask, at = (t.to(lm.device) for t in padded(prompt_ids, generated, side))
    with torch.no_grad():
        logits = teacher_forced_logits_batch(adapter, ids, [len(p) for p in prompt_ids], layer_sets,
                                             attention_mask=mask, logits_at=at)
    torch.testing.assert_close(logits.view(len(PROMPTS), STEPS, -1), engine_logits, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        full = teacher_forced_logits_batch(adapter, ids, [len(p) for p in prompt_ids], attention_mask=mask,
                                           logits_at=at)
    assert (full - logits).abs().max() > 1e-2, "skipping must change the logits, or this test proves nothing"


def test_one_unpadded_row_is_the_single_sequence_function(tiny_models):
    lm = tiny_models("gemma3")
    adapter = Engine(lm).arch
    ids = torch.tensor([lm.tokenizer(PROMPTS[0])["input_ids"]], device=lm.device)
    sets = SkipDecode(LinearSchedule(6, 2, 8)).plan(6).layer_sets(ids.shape[1] - 20)
    with torch.no_grad():
        single = teacher_forced_logits(adapter, ids, 20, sets)
        batch = teacher_forced_logits_batch(adapter, ids, [20], sets)
    torch.testing.assert_close(batch[0], single)


def test_gradients_reach_every_layer_through_skipping(tiny_models):
    lm = tiny_models("llama")
    adapter = Engine(lm).arch
    weights = [layer.mlp.down_proj.weight for layer in adapter.layers]
    ids = torch.tensor([lm.tokenizer(PROMPTS[0])["input_ids"]], device=lm.device)
    at = torch.zeros_like(ids, dtype=torch.bool)
    at[0, 20:] = True  # generated positions only; the prompt runs every layer and feeds them
    try:
        for w in weights:
            w.requires_grad_(True)
        sets = [(0, 4, 5)] * (ids.shape[1] - 20)
        loss = teacher_forced_logits_batch(adapter, ids, [20], sets, logits_at=at).logsumexp(-1).mean()
        loss.backward()
        assert all(w.grad is not None and torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0 for w in weights)
    finally:
        for w in weights:
            w.requires_grad_(False)
            w.grad = None


def test_bad_shapes_and_prompt_lengths_are_refused(tiny_models):
    adapter = Engine(tiny_models("llama")).arch
    ids = torch.ones(2, 8, dtype=torch.long)
    with pytest.raises(InputError, match="prompt lengths"):
        teacher_forced_logits_batch(adapter, ids, [3])
    with pytest.raises(InputError, match="from 1 to"):
        teacher_forced_logits_batch(adapter, ids, [3, 9])
    with pytest.raises(InputError, match="batch, seq"):
        teacher_forced_logits_batch(adapter, ids[0], [3])


def test_each_row_its_own_layer_sets_is_each_row_alone(tiny_models):
    """``row_layer_sets``: a padded batch in which every row runs its own ``E_b(t)`` gives each row the logits it
    gets alone with that schedule (as a prompt served by itself ranks its own layers)."""
    lm = tiny_models("gemma3")
    arch = Engine(lm).arch
    text = lm.tokenizer(" ".join(PROMPTS))["input_ids"]
    rows = [text[:18], text[5:25]]
    prompt_lens = [10, 12]
    plans = [SkipDecode(LinearSchedule(6, 2, 6), "importance", scores).plan(6)
             for scores in ((0.5, 0.1, 0.4, 0.2, 0.3, 0.6), (0.1, 0.6, 0.2, 0.5, 0.4, 0.3))]
    steps = [len(row) - p for row, p in zip(rows, prompt_lens)]
    sets = [plan.layer_sets(max(steps)) for plan in plans]
    assert sets[0] != sets[1], "the rows must differ, or this test proves nothing"
    width = max(map(len, rows))
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, width - len(row):] = torch.tensor(row)
        mask[r, width - len(row):] = 1
    with torch.no_grad():
        batch = teacher_forced_logits_batch(arch, ids, prompt_lens, attention_mask=mask, row_layer_sets=sets)
        for r, row in enumerate(rows):
            alone = teacher_forced_logits(arch, torch.tensor([row]), prompt_lens[r], sets[r])
            torch.testing.assert_close(batch[r, width - len(row):], alone, rtol=1e-4, atol=1e-4)
    with pytest.raises(InputError, match="every row its schedule"):
        teacher_forced_logits_batch(arch, ids, prompt_lens, sets[0], attention_mask=mask, row_layer_sets=sets)
    with pytest.raises(InputError, match="every row its schedule"):
        teacher_forced_logits_batch(arch, ids, prompt_lens, attention_mask=mask, row_layer_sets=sets[:1])
