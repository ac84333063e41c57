"""The in-place cache: a decode step writes one slot per row and head and copies nothing the size of the cache."""

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import PROMPTS
from skipkey.core.cache import EMPTY, LayerCache
from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.kv.budgets import Budgets
from skipkey.kv.policies import make_kv_policy

LONG_IDS = [3 + (i * 7919) % 250 for i in range(400)]


class LargeAllocations(TorchDispatchMode):
    """Records every op whose output is fresh storage of at least ``threshold`` bytes.

    In-place writes (``scatter_``, ``copy_``, slice assignment) and views return
    storage one of their inputs already had, so they do not count.
    """

    def __init__(self, threshold: int):
        super().__init__()
        self.threshold = threshold
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= self.threshold \
                    and t.untyped_storage().data_ptr() not in inputs:
                self.seen.append((str(func), tuple(t.shape)))
        return out


def _engine(tiny_models, family, name):
    lm = tiny_models(family)
    return Engine(lm, kv=None if name == "full" else make_kv_policy(name, budget=0.5))


@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma2"])  # gemma2: attention with capped logits
@pytest.mark.parametrize("name", ["full", "window", "streaming", "h2o", "keyformer"])
def test_a_decode_step_allocates_nothing_the_size_of_a_layers_cache(tiny_models, family, name):
    engine = _engine(tiny_models, family, name)
    steps = engine.generate([LONG_IDS], GenerationSettings(max_new_tokens=12, ignore_eos=True))
    next(steps)  # the prompt pass sizes every layer's storage
    layers = engine_cache_layers(engine, steps)
    largest = max(layer.keys[:, :, :len(layer)].nbytes for layer in layers if layer.keys is not None)
    pointers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in layers]
    watch = LargeAllocations(largest)
    for _ in range(10):
        with watch:
            next(steps)
        # The storage itself never moved: every step wrote into the buffers sized after the prompt.
        assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in layers] == pointers
    assert watch.seen == []


def engine_cache_layers(engine, steps):
    """The live cache of a running generation, found through the attention's step state."""
    import skipkey.core.attention as attention

    seen = {}
    original = attention.skipkey_attention

    def spy(module, *args, step_state=None, **kwargs):
        seen["cache"] = step_state.cache
        return original(module, *args, step_state=step_state, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface._global_mapping[attention.ATTENTION_NAME] = spy
    try:
        next(steps)  # one decode step, through the spy
    finally:
        AttentionInterface._global_mapping[attention.ATTENTION_NAME] = original
    return seen["cache"].layers


def _layer(positions: list[int], heads: int = 1, window=None) -> LayerCache:
    layer = LayerCache(window)
    n = len(positions)
    keys = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand(1, heads, n, 2).contiguous()
    layer.write(keys, keys.clone(), torch.tensor([positions]), dense=True)
    return layer


def test_the_recent_window_comes_from_positions_when_slots_are_out_of_order():
    """Slots shuffled as in-place eviction leaves them: the newest positions are kept whatever their slot."""
    positions = [7, 2, 9, 0, 5, 8, 1, 3, 6, 4]  # 10 tokens, newest (9, 8, 7) scattered
    policy = make_kv_policy("h2o", budget=5, recent=0.6)  # 3 recent + 2 by score
    layer = _layer(positions)
    layer.ensure_scores()
    # Scores favour the oldest tokens, so only the recent window can keep 7, 8 and 9.
    layer.scores = torch.tensor([[[-p for p in positions]]], dtype=torch.float32)
    budgets = Budgets.for_prompts(policy, [10], "cpu")
    policy.evict(layer, budgets, torch.tensor([10]), capacity=6)
    kept = sorted(p for p in layer.positions[0, 0].tolist() if p != EMPTY)
    assert kept == [0, 1, 7, 8, 9]
    # Each kept slot still holds its own token: values moved with their positions.
    for slot, pos in enumerate(layer.positions[0, 0].tolist()):
        if pos != EMPTY:
            assert layer.keys[0, 0, slot, 0].item() == positions.index(pos)


def test_in_place_eviction_reuses_the_freed_slot_and_keeps_the_window():
    """After the prompt, a step writes into the slot eviction freed; the window policy keeps the last k."""
    policy = make_kv_policy("window", budget=4)
    layer = _layer(list(range(8)))
    budgets = Budgets.for_prompts(policy, [8], "cpu")
    policy.evict(layer, budgets, torch.tensor([8]), capacity=5)
    assert layer.capacity == 5 and sorted(layer.kept_positions()[0, 0].tolist()) == [4, 5, 6, 7]
    pointer = layer.keys.data_ptr()
    for pos in range(8, 15):
        new = torch.full((1, 1, 1, 2), float(100 + pos))
        layer.write(new, new, torch.tensor([[pos]]), dense=True)
        policy.evict(layer, budgets, torch.tensor([pos + 1]), capacity=5)
        assert layer.kept_positions()[0, 0].tolist() == list(range(pos - 3, pos + 1))
        assert layer.keys.data_ptr() == pointer and len(layer) == 4
    slots = layer.positions[0, 0].tolist()
    assert slots != sorted(slots)  # really out of position order
    for slot, pos in enumerate(slots):
        if pos != EMPTY:
            assert layer.keys[0, 0, slot, 0].item() == 100 + pos


def test_a_sliding_layer_appends_in_order_and_moves_its_window_to_the_front():
    layer = _layer(list(range(6)), window=4)
    layer.trim_to_window(spare=20)
    assert layer.capacity == 3 + 4 and layer.kept_positions()[0, 0].tolist() == [3, 4, 5]
    for pos in range(6, 30):
        new = torch.full((1, 1, 1, 2), float(pos))
        keys, _ = layer.write(new, new, torch.tensor([[pos]]), dense=True)
        # What attention reads: the window, in position order, exactly as ``generate`` holds it.
        assert keys[0, 0, :, 0].tolist() == [float(p) for p in range(pos - 3, pos + 1)]
        assert layer.visible_positions()[0, 0].tolist() == list(range(pos - 3, pos + 1))
        layer.trim_to_window(spare=20)
        assert len(layer) == 3


@pytest.mark.parametrize("every", [1, 4])
def test_evict_every_n_steps_holds_at_most_budget_plus_n_minus_one(tiny_models, every):
    lm = tiny_models("llama")
    policy = make_kv_policy("keyformer", budget=40, evict_every=every)
    lengths = [e.cache_lengths for e in Engine(lm, kv=policy).generate(
        [LONG_IDS], GenerationSettings(max_new_tokens=12, ignore_eos=True))]
    assert lengths[0] == (40,) * len(lengths[0])  # the prompt pass always evicts to the budget
    held = [max(step) for step in lengths]
    assert max(held) == 40 + every - 1 and min(held) == 40
    if every > 1:
        assert held[every] == 40 and held[every - 1] == 40 + every - 1
