"""SkipKey's attention function, registered with transformers' ``AttentionInterface``.

The model's own attention modules project, normalise and rotate queries and
keys, call ``KVCache.update`` and then this function. Here we

* build the mask from the *positions* each cache slot holds (never from slot
  indices), so evicted, trimmed and padded caches all mask correctly;
* compute the output with transformers' SDPA path, exactly as ``generate`` does;
* when a KV policy scores tokens (H2O, Keyformer), compute the attention logits
  a second time for the score only, in query chunks, so the output keeps the
  fast fused kernel and prefill memory stays bounded.

Without an engine state in the call (e.g. inside ``model.generate``) it is plain SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "skipkey"
SCORE_CHUNK = 256  # prompt queries scored at once; bounds prefill memory on long prompts


@dataclass
class StepState:
    """What one forward step tells the attention function."""

    cache: object  # skipkey.cache.KVCache
    query_positions: torch.Tensor  # [B, q], EMPTY (-1) for padding
    # (logits [B, Hkv, G, q, S] float32, -inf where masked; NoiseIndex) -> score contribution, same shape
    contribution: Callable[[torch.Tensor, "NoiseIndex"], torch.Tensor] | None = None


@dataclass(frozen=True)
class NoiseIndex:
    """Where each logit sits: enough to draw noise that does not depend on batching or slot order."""

    layer: int
    query_positions: torch.Tensor  # [B, q]
    key_positions: torch.Tensor  # [B, Hp, S]


def allowed_keys(positions: torch.Tensor, query_positions: torch.Tensor, window: int | None,
                 query_slots: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask [B, Hp, q, S]: slot holds a token at or before the query, inside its window.

    ``query_slots`` (a prompt forward with no past) are the queries' own slots: each
    query may always see itself, so padding queries are never fully masked (SDPA
    would return NaN there and poison later layers' keys).
    """
    kpos = positions[:, :, None, :]
    qpos = query_positions[:, None, :, None]
    allowed = (kpos >= 0) & (kpos <= qpos)
    if window is not None:
        allowed &= (qpos - kpos) < window
    if query_slots is not None:
        slots = torch.arange(positions.shape[2], device=positions.device)
        allowed |= slots[None, None, None, :] == query_slots[None, None, :, None]
    return allowed


def _mask_for_output(layer, query_positions: torch.Tensor) -> torch.Tensor | None:
    """``None`` where SDPA's own causal/no-mask path is exact, else the explicit mask."""
    q, s = query_positions.shape[1], len(layer)
    if layer.dense and (q == 1 or (q == s and (layer.window is None or q <= layer.window))):
        return None
    slots = torch.arange(q, device=query_positions.device) if q == s else None
    return allowed_keys(layer.positions, query_positions, layer.window, slots)


def _expand_heads(mask: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    if mask is None or mask.shape[1] in (1, num_heads):
        return mask
    return mask.repeat_interleave(num_heads // mask.shape[1], dim=1)


def accumulate_scores(layer, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float,
                      query_positions: torch.Tensor, contribution) -> None:
    """Add each query's score contribution to ``layer.scores`` [B, Hkv, S], summed over GQA groups."""
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    layer.ensure_scores()
    if layer.scores.shape[1] != hkv:
        layer.scores = layer.scores.expand(b, hkv, -1).contiguous()
    keys = key.float()
    total = torch.zeros(b, hkv, key.shape[2], device=key.device, dtype=torch.float32)
    # In a sliding-window layer only keys newer than (last position + 1 - window) survive the
    # prompt; queries at or before that line see none of them, so their chunks are skipped.
    survivors_from = None
    if layer.window is not None and q > 1:
        survivors_from = query_positions.max(dim=1).values + 1 - layer.window
    # A prompt pass with no past: slot i holds the i-th token fed (after left padding), so the
    # chunk's queries see no slot after ``stop`` and, in a sliding layer, none before its window.
    # Scoring only that band is exact and halves the work of a long prompt.
    prompt_only = q == key.shape[2]
    for start in range(0, q, SCORE_CHUNK):
        stop = min(q, start + SCORE_CHUNK)
        qpos = query_positions[:, start:stop]
        if survivors_from is not None and bool((qpos.max(dim=1).values <= survivors_from).all()):
            continue
        lo, hi = 0, key.shape[2]
        if prompt_only:
            hi = stop
            if layer.window is not None:
                lo = max(0, start - layer.window + 1)
        positions = layer.positions[:, :, lo:hi]
        qc = query[:, :, start:stop].float().reshape(b, hkv, hq // hkv, stop - start, d)
        logits = torch.einsum("bhgqd,bhsd->bhgqs", qc, keys[:, :, lo:hi]) * scaling
        slots = torch.arange(start - lo, stop - lo, device=query.device) if prompt_only else None
        allowed = allowed_keys(positions, qpos, layer.window, slots)
        logits = logits.masked_fill(~allowed[:, :, None], float("-inf"))
        probs = contribution(logits, NoiseIndex(layer_idx, qpos, positions))
        probs = probs * (qpos >= 0)[:, None, None, :, None]
        total[:, :, lo:hi] += probs.sum(dim=(2, 3))
    layer.scores = layer.scores + total


def skipkey_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, skipkey: StepState | None = None, **kwargs):
    kwargs.pop("sliding_window", None)
    if skipkey is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    layer = skipkey.cache.layers[module.layer_idx]
    mask = _expand_heads(_mask_for_output(layer, skipkey.query_positions), query.shape[1])
    out, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scaling, **kwargs)
    if skipkey.contribution is not None:
        accumulate_scores(layer, module.layer_idx, query, key, scaling if scaling is not None else query.shape[-1] ** -0.5,
                          skipkey.query_positions, skipkey.contribution)
    return out, None


def install_attention(model) -> None:
    """Register SkipKey's attention and make ``model`` use it (plain SDPA outside the engine)."""
    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, skipkey_attention)
        # Outside the engine the model builds its own masks; they must be SDPA's.
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    for config in {id(c): c for c in (model.config, getattr(model.config, "text_config", None)) if c}.values():
        config._attn_implementation = ATTENTION_NAME
