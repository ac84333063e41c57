"""SkipKey's attention function, registered with transformers' ``AttentionInterface``.

The model's own attention modules project, normalise and rotate queries and
keys, call ``KVCache.update`` and then this function. Here we

* build the mask from the *positions* each cache slot holds (never from slot
  indices), so evicted, trimmed and padded caches all mask correctly;
* compute the output with transformers' SDPA path, exactly as ``generate`` does, or, where the
  model soft-caps its attention logits (Gemma 2), with the eager attention its own code runs;
* when a KV policy scores tokens (H2O, Keyformer), call the scorer the engine put
  into the ``StepState`` (``Scorer``; ``skipkey.kv.scoring`` implements it): for the
  prompt it scores after the output, which keeps the fast fused kernel; a decode
  step computes its logits once, for the output and the score. An evicting layer
  of a policy that does not score (window, streaming) takes the fused decode call
  without the score on CPU: its slots are out of order, so SDPA would need a mask.

Without an engine state in the call (e.g. inside ``model.generate``) it is plain SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from skipkey.core import kernels

ATTENTION_NAME = "skipkey"


class Scorer(Protocol):
    """How a KV policy scores cached tokens, called by the attention function (``skipkey.kv.scoring``)."""

    def score_prompt(self, layer, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float,
                     state: "StepState", softcap: float | None = None) -> None:
        """Add the prompt queries' contributions to ``layer.scores`` (after the output was computed);
        ``softcap``: the model caps its attention logits there (``soft_cap``)."""

    def attend_and_score(self, layer, layer_idx: int, query: torch.Tensor, visible: tuple, scaling: float,
                         state: "StepState", softcap: float | None = None) -> torch.Tensor:
        """A decode step's attention output, its contributions added to ``layer.scores`` on the way."""


@dataclass
class StepState:
    """What one forward step tells the attention function."""

    cache: object  # skipkey.core.cache.KVCache
    query_positions: torch.Tensor  # [B, q], EMPTY (-1) for padding
    dense: bool = True  # no padding among the queries
    contribution: Scorer | None = None  # set when the KV policy scores this step
    start_score: torch.Tensor | None = None  # [B] float32: the score each new token starts with (None: 0)
    accumulate: bool = True  # add each step's contribution (H2O, Keyformer) or replace it (TOVA)
    observe: int = 0  # prompt scores from each row's last ``observe`` queries only (0: all)
    position_limit: int | None = None  # every query position is below this
    # When set, each layer's prompt queries, keys, values, scale and soft cap are kept here by layer index,
    # so several KV policies can later start from one prompt pass (``replay_prompt``).
    capture: dict | None = None


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


def mask_for_output(layer, positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor | None:
    """``None`` where SDPA's own causal/no-mask path is exact, else the explicit mask."""
    q, s = query_positions.shape[1], positions.shape[-1]
    if layer.dense and (q == 1 or (q == s and (layer.window is None or q <= layer.window))):
        return None
    if q == 1 and layer.window is None:
        return (positions >= 0)[:, :, None, :]  # a decode step: every cached token is at or before the query
    slots = torch.arange(q, device=query_positions.device) if q == s else None
    return allowed_keys(positions, query_positions, layer.window, slots)


def _expand_heads(mask: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    if mask is None or mask.shape[1] in (1, num_heads):
        return mask
    return mask.repeat_interleave(num_heads // mask.shape[1], dim=1)


def soft_cap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)``: how Gemma 2 caps its attention logits (and Gemma its final ones)."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def softcapped_attention(module, query, key, value, mask: torch.Tensor | None, dropout: float, scaling: float,
                         softcap: float) -> torch.Tensor:
    """The model's own eager attention with capped logits (SDPA cannot cap), on SDPA's masks: boolean
    (True: may see), or None for causal (each query sees the slots up to its own, as SDPA's ``is_causal``).

    Each KV head's query heads are stacked against its keys, so the cache is never repeated per query head.
    """
    b, hq, q, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    grouped = query.reshape(b, hkv, hq // hkv * q, d)
    logits = soft_cap(torch.matmul(grouped, key.transpose(2, 3)).view(b, hq, q, s) * scaling, softcap)
    if mask is None and q > 1:
        mask = torch.ones(q, s, dtype=torch.bool, device=query.device).tril_()
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs.view(b, hkv, hq // hkv * q, s), value).view(b, hq, q, -1)
    return out.transpose(1, 2).contiguous()


def attention_output(module, query, key, value, mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """SDPA's output, exactly as ``generate`` computes it; eager attention where the model caps its logits."""
    softcap = kwargs.pop("softcap", None)
    if softcap is None:
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return softcapped_attention(module, query, key, value, mask, dropout, scale, softcap), None


NO_NOISE = (torch.empty(0), torch.empty(0, dtype=torch.long))  # "no noise" for the fused kernels
_UNSCORED = (torch.empty(0), False, *NO_NOISE, 1, 1.0)  # ``attend_score``'s scoring arguments: none


def attend_fused(fused, layer, query, visible: tuple, scaling: float, state: StepState,
                 scoring: tuple = _UNSCORED) -> torch.Tensor:
    """A decode step's attention in the fused kernel; by default without the score: an evicting layer of an
    unscored policy, whose out-of-order slots SDPA would need a mask for, and where SDPA runs several times
    below memory speed on CPUs without AMX (``assets/results/decode_kernels.txt``). Full mode keeps SDPA,
    so it stays ``generate``'s token for token. ``visible``: the layer's (keys, values, positions)."""
    b, hq, _, d = query.shape
    key, value, positions = visible
    # A decode query needs a mask exactly where the layer is not dense (``mask_for_output``).
    out = fused.attend_score(query, scaling, key, value, positions, state.query_positions.reshape(b), layer.window or 0,
                             not layer.dense, *scoring)
    return out.view(b, hq, 1, d).transpose(1, 2)


def skipkey_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, step_state: StepState | None = None, **kwargs):
    """transformers' attention interface (its signature is theirs); ``attention_output`` without an engine state."""
    kwargs.pop("sliding_window", None)  # the engine's cache knows each layer's window (``LayerInfo``)
    if step_state is None:
        return attention_output(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    layer = step_state.cache.layers[module.layer_idx]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")
    if step_state.capture is not None:
        step_state.capture[module.layer_idx] = (query, key, value, scale, softcap)
    key, value = layer.write(key, value, step_state.query_positions, step_state.dense, step_state.start_score)
    positions = layer.visible_positions()
    scorer = step_state.contribution if layer.scored else None
    if scorer is not None and query.shape[2] == 1:
        return scorer.attend_and_score(layer, module.layer_idx, query, (key, value, positions), scale, step_state,
                                       softcap), None
    # The fused kernel does not cap logits: a soft-capped model's evicting layers attend eagerly.
    fused = kernels.for_tensors(key, value) if layer.reuse and query.shape[2] == 1 and softcap is None else None
    if fused is not None:  # an evicting layer that needs no scores (window, streaming): the output alone
        return attend_fused(fused, layer, query, (key, value, positions), scale, step_state), None
    mask = mask_for_output(layer, positions, step_state.query_positions)
    out, _ = attention_output(module, query, key, value, _expand_heads(mask, query.shape[1]), 0.0, scaling, **kwargs)
    if scorer is not None:
        scorer.score_prompt(layer, module.layer_idx, query, key, scale, step_state, softcap)
    return out, None


def replay_prompt(layer, layer_idx: int, captured, state: StepState) -> None:
    """Fill a layer's cache from a recorded prompt pass, scoring it as the attention function would have."""
    query, key, value, scale, softcap = captured
    key, _ = layer.write(key, value, state.query_positions, state.dense)
    if state.contribution is not None and layer.scored:
        state.contribution.score_prompt(layer, layer_idx, query, key, scale, state, softcap)


def install_attention(model) -> None:
    """Register SkipKey's attention and make ``model`` use it (plain SDPA outside the engine)."""
    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, skipkey_attention)
        # Outside the engine the model builds its own masks; they must be SDPA's.
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    for config in {id(c): c for c in (model.config, getattr(model.config, "text_config", None)) if c}.values():
        config._attn_implementation = ATTENTION_NAME
