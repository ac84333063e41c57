"""One teacher-forced pass over whole sequences with a policy in place.

Prompt positions run every layer; generated position ``P + t`` runs ``E(t)``
and a skipped layer is the identity there. Each layer computes every position
up to the last one that runs it, and its output is kept only where that
position runs the layer: because the ``E(t)`` nest, no position attends to keys
or values the cached decode would not have, and nothing after a layer's last
use needs its keys. Optionally, decode queries see only the positions a KV
policy kept.

This is the no-cache reference the engine's tests compare against, the forward
that fine-tuning (SkipDecode's training) differentiates through, and how
perplexity is measured for skipping. Nothing here disables autograd.

A skip-only adapter applies only at decode steps that skip layers: the
``adapter_gate`` callback is told, before each layer runs, how many layers each
slot's step skips (``[B, T]``, 0 at the prompt and padding), and after the
pass ``None``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from skipkey.core.attention import allowed_keys
from skipkey.errors import InputError


def _mask(layer_idx: int, window: int | None, positions: torch.Tensor, prompt_len: int, kept, num_heads: int):
    """``[B, H, T, T]`` keys each query may see; ``kept`` (one unpadded row only) narrows decode queries."""
    slots = torch.arange(positions.shape[1], device=positions.device)
    # Each query may see its own slot, so padding queries are never fully masked (NaN in SDPA).
    causal = allowed_keys(positions[:, None, :], positions, window, query_slots=slots)  # [B, 1, T, T]
    if kept is None:
        return causal
    total = positions.shape[1]
    heads = max((k[layer_idx].shape[1] for k in kept if k[layer_idx] is not None), default=1)
    mask = causal.expand(1, heads, total, total).clone()
    for t, step_kept in enumerate(kept[: total - prompt_len]):
        layer_kept = step_kept[layer_idx]
        if layer_kept is None:
            continue  # the layer was freed: this query does not run it
        query = prompt_len + t
        row = torch.zeros(heads, total, dtype=torch.bool, device=positions.device)
        for h in range(heads):
            pos = layer_kept[0, min(h, layer_kept.shape[1] - 1)]
            row[h, torch.as_tensor(pos[pos >= 0], dtype=torch.long, device=positions.device)] = True
        row[:, query] = True
        mask[0, :, query] = row
    return mask.repeat_interleave(num_heads // heads, dim=1) if heads > 1 else mask


def _per_step(values: Sequence[Sequence], positions: torch.Tensor, prompt_lens: torch.Tensor,
              outside) -> torch.Tensor:
    """``[B, T]``: ``values[b][t]`` at the slot of row ``b``'s generated position ``P_b + t``, ``outside``
    everywhere else (rows' value lists are equally long)."""
    steps = positions - prompt_lens[:, None]
    table = torch.tensor([list(row) for row in values], device=positions.device)  # [B, S]
    decoding = (steps >= 0) & (steps < table.shape[1])
    return torch.where(decoding, table.gather(1, steps.clamp(0, table.shape[1] - 1)), outside)


def _runs(layer_idx: int, positions: torch.Tensor, prompt_lens: torch.Tensor,
          row_layer_sets: Sequence[Sequence[Sequence[int]]]) -> torch.Tensor:
    """``[B, T]``: which slots run ``layer_idx`` (prompt: all; ``P + t``: the row's ``E(t)``; padding: none)."""
    runs = positions >= 0
    if row_layer_sets:
        flags = [[layer_idx in layers for layers in sets] for sets in row_layer_sets]
        runs &= _per_step(flags, positions, prompt_lens, True)
    return runs


def _skipped(positions: torch.Tensor, prompt_lens: torch.Tensor,
             row_layer_sets: Sequence[Sequence[Sequence[int]]], num_layers: int) -> torch.Tensor:
    """``[B, T]``: how many layers each slot's step skips (``L - len(E(t))``; 0 at the prompt and padding)."""
    if not row_layer_sets:
        return torch.zeros_like(positions)
    counts = [[num_layers - len(layers) for layers in sets] for sets in row_layer_sets]
    return _per_step(counts, positions, prompt_lens, 0)


def _final_hidden(arch, input_ids: torch.Tensor, positions: torch.Tensor, prompt_lens: torch.Tensor,
                  row_layer_sets: Sequence[Sequence[Sequence[int]]], kept=None, adapter_gate=None) -> torch.Tensor:
    """Hidden states ``[B, T, H]`` after the last layer; ``positions`` is -1 at padding; row ``b``'s step ``t``
    runs ``row_layer_sets[b][t]`` (none given: every layer)."""
    skipped = None if adapter_gate is None else _skipped(positions, prompt_lens, row_layer_sets, arch.num_layers)
    rope_pos = positions.clamp(min=0)
    hidden = arch.embed(input_ids, rope_pos)
    inputs_by_end: dict[int, list[dict]] = {}
    try:
        for idx in range(arch.num_layers):
            runs = _runs(idx, positions, prompt_lens, row_layer_sets)
            if not runs.any():
                continue
            # Slots past the last one that runs this layer are never read through it: leave them out.
            end = int(runs.any(dim=0).nonzero().max()) + 1
            if end not in inputs_by_end:
                inputs_by_end[end] = arch.position_inputs(hidden[:, :end], rope_pos[:, :end])
            mask = _mask(idx, arch.layer_info[idx].sliding_window, positions[:, :end], int(prompt_lens[0]),
                         kept, arch.num_heads)
            if skipped is not None:
                adapter_gate(skipped[:, :end])
            out = arch.run_layer(idx, hidden[:, :end], inputs_by_end[end][idx], attention_mask=mask)
            head = torch.where(runs[:, :end, None], out, hidden[:, :end])
            hidden = head if end == hidden.shape[1] else torch.cat([head, hidden[:, end:]], dim=1)
    finally:
        if adapter_gate is not None:
            adapter_gate(None)
    return hidden


def teacher_forced_logits(arch, input_ids: torch.Tensor, prompt_len: int,
                          layer_sets: Sequence[Sequence[int]] | None = None,
                          kept: Sequence[Sequence[np.ndarray | None]] | None = None,
                          adapter_gate=None) -> torch.Tensor:
    """Logits ``[T, V]`` for a single sequence ``input_ids`` ``[1, T]``.

    ``layer_sets[t]`` is ``E(t)``, run by generated position ``prompt_len + t``
    (missing entries run every layer). ``kept[t][l]`` (as recorded in
    ``StepEvent.kept`` for the event that produced token ``t``) restricts what the
    query at ``prompt_len + t`` sees in layer ``l``, besides itself.
    ``adapter_gate``: a skip-only adapter's switch (module docstring).
    """
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    prompt_lens = torch.tensor([prompt_len], device=input_ids.device)
    rows = [list(layer_sets)] if layer_sets else []
    hidden = _final_hidden(arch, input_ids, positions, prompt_lens, rows, kept, adapter_gate)
    return arch.head(hidden)[0]


def teacher_forced_logits_batch(arch, input_ids: torch.Tensor, prompt_lens: Sequence[int],
                                layer_sets: Sequence[Sequence[int]] | None = None, *,
                                attention_mask: torch.Tensor | None = None,
                                logits_at: torch.Tensor | None = None, adapter_gate=None,
                                row_layer_sets: Sequence[Sequence[Sequence[int]]] | None = None) -> torch.Tensor:
    """Logits for a padded batch ``input_ids`` ``[B, T]``, the schedule shared by the batch.

    ``attention_mask`` ``[B, T]`` is 1 at tokens and 0 at padding, on either side
    (default: no padding). ``prompt_lens[b]`` counts row ``b``'s prompt tokens;
    its token at position ``prompt_lens[b] + t`` runs ``layer_sets[t]``, so
    ``E(t)`` follows the generation step, not the slot, as in the engine.
    ``logits_at`` ``[B, T]`` (bool) computes the LM head only there and returns
    ``[N, V]`` in row-major order (the head is most of the cost on big
    vocabularies); by default all of ``[B, T, V]``. ``adapter_gate``: a skip-only
    adapter's switch (module docstring). ``row_layer_sets[b]`` instead gives each
    row its own ``E_b(t)`` (as each prompt served alone ranks its own layers).
    """
    if input_ids.dim() != 2:
        raise InputError(f"input_ids must be [batch, seq], got {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape or len(prompt_lens) != input_ids.shape[0]:
        raise InputError(f"attention_mask {tuple(attention_mask.shape)} and {len(prompt_lens)} prompt lengths "
                         f"must match input_ids {tuple(input_ids.shape)}")
    real = attention_mask.bool()
    positions = torch.where(real, real.long().cumsum(dim=1) - 1, -1)
    lens = torch.as_tensor(list(prompt_lens), device=input_ids.device)
    if bool((lens < 1).any()) or bool((lens > real.sum(dim=1)).any()):
        raise InputError(f"prompt lengths {list(prompt_lens)} must be from 1 to each row's token count")
    if row_layer_sets is not None and (layer_sets or len(row_layer_sets) != input_ids.shape[0]
                                       or len({len(sets) for sets in row_layer_sets}) > 1):
        raise InputError("row_layer_sets gives every row its schedule (equally long), instead of layer_sets")
    rows = [list(s) for s in row_layer_sets] if row_layer_sets else [list(layer_sets)] * len(lens) if layer_sets else []
    hidden = _final_hidden(arch, input_ids, positions, lens, rows, adapter_gate=adapter_gate)
    if logits_at is not None:
        return arch.head(hidden[logits_at.bool()])
    return arch.head(hidden)
