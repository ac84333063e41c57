"""One teacher-forced pass over a whole sequence with a policy in place.

Prompt positions run every layer; generated position ``P + t`` runs ``E(t)``
and a skipped layer is the identity there. Every layer computes every position
and its output is kept only where that position runs the layer: because the
``E(t)`` nest, no position attends to keys or values the cached decode would
not have. Optionally, decode queries see only the positions a KV policy kept.

This is the no-cache reference the engine's tests compare against, the forward
that fine-tuning (SkipDecode's training) differentiates through, and how
perplexity is measured for skipping.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from skipkey.attention import allowed_keys


def _mask(layer_idx: int, window: int | None, total: int, prompt_len: int, kept, num_heads: int, device):
    positions = torch.arange(total, device=device)
    causal = allowed_keys(positions[None, None, :], positions[None, :], window)  # [1, 1, T, T]
    if kept is None:
        return causal
    heads = max((k[layer_idx].shape[1] for k in kept if k[layer_idx] is not None), default=1)
    mask = causal.expand(1, heads, total, total).clone()
    for t, step_kept in enumerate(kept[: total - prompt_len]):
        layer_kept = step_kept[layer_idx]
        if layer_kept is None:
            continue  # the layer was freed: this query does not run it
        query = prompt_len + t
        row = torch.zeros(heads, total, dtype=torch.bool, device=device)
        for h in range(heads):
            pos = layer_kept[0, min(h, layer_kept.shape[1] - 1)]
            row[h, torch.as_tensor(pos[pos >= 0], dtype=torch.long, device=device)] = True
        row[:, query] = True
        mask[0, :, query] = row
    return mask.repeat_interleave(num_heads // heads, dim=1) if heads > 1 else mask


def teacher_forced_logits(adapter, input_ids: torch.Tensor, prompt_len: int,
                          layer_sets: Sequence[Sequence[int]] | None = None,
                          kept: Sequence[Sequence[np.ndarray | None]] | None = None) -> torch.Tensor:
    """Logits ``[T, V]`` for a single sequence ``input_ids`` ``[1, T]``.

    ``layer_sets[t]`` is ``E(t)``, run by generated position ``prompt_len + t``
    (missing entries run every layer). ``kept[t][l]`` (as recorded in
    ``StepEvent.kept`` for the event that produced token ``t``) restricts what the
    query at ``prompt_len + t`` sees in layer ``l``, besides itself.
    """
    total = input_ids.shape[1]
    device = input_ids.device
    positions = torch.arange(total, device=device)[None]
    hidden = adapter.embed(input_ids, positions)
    layer_kwargs = adapter.position_inputs(hidden, positions)
    layer_sets = list(layer_sets or [])
    for idx in range(adapter.num_layers):
        runs = torch.ones(total, dtype=torch.bool, device=device)
        for t, layers in enumerate(layer_sets[: total - prompt_len]):
            runs[prompt_len + t] = idx in layers
        if not runs.any():
            continue
        mask = _mask(idx, adapter.layer_info[idx].sliding_window, total, prompt_len, kept, adapter.num_heads, device)
        out = adapter.run_layer(idx, hidden, layer_kwargs[idx], attention_mask=mask)
        hidden = torch.where(runs[None, :, None], out, hidden)
    return adapter.head(hidden)[0]
