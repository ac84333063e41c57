"""SkipKey's attention function, registered with transformers' ``AttentionInterface``.

The model's own attention modules project, normalise and rotate queries and
keys, call ``KVCache.update`` and then this function. Here we

* build the mask from the *positions* each cache slot holds (never from slot
  indices), so evicted, trimmed and padded caches all mask correctly;
* compute the output with transformers' SDPA path, exactly as ``generate`` does;
* when a KV policy scores tokens (H2O, Keyformer), compute the prompt's attention
  logits a second time for the score only, in query chunks, so the output keeps
  the fast fused kernel and prefill memory stays bounded. A decode step computes
  its logits once, for the output and the score: in one fused C++ call on CPU
  (``skipkey.core.kernels``), else as matmul-softmax-matmul. An evicting layer of a
  policy that does not score (window, streaming) takes the same call without the
  score on CPU: its slots are out of order, so SDPA would need a mask.

Without an engine state in the call (e.g. inside ``model.generate``) it is plain SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from skipkey.core import kernels
from skipkey.kv.noise import NOISE_COLS, gumbel_noise, noise_table, query_starts

ATTENTION_NAME = "skipkey"
SCORE_CHUNK = 256  # prompt queries scored at once; bounds prefill memory on long prompts


@dataclass(frozen=True)
class ScoreContribution:
    """What each query adds to a key's score: ``softmax((logits + Gumbel noise) / tau)`` over its keys.

    H2O, TOVA and SnapKV use the attention weights themselves (``tau = 1``, no noise);
    Keyformer adds noise keyed by ``noise_seed`` and a temperature. One form for every
    policy is what lets the fused decode kernel compute it.
    """

    tau: float = 1.0
    noise_seed: int | None = None  # None: no noise

    @property
    def is_attention(self) -> bool:
        """The contribution is the attention weights (no noise, no temperature)."""
        return self.noise_seed is None and self.tau == 1.0

    def __call__(self, logits: torch.Tensor, where: "NoiseIndex", probs: torch.Tensor | None = None) -> torch.Tensor:
        """``logits`` [B, Hkv, G, q, S] float32, -inf where masked; ``probs``, when given, is their softmax."""
        if self.is_attention:
            return probs if probs is not None else torch.softmax(logits, dim=-1)
        if self.noise_seed is None:
            return torch.softmax(logits / self.tau, dim=-1)
        noisy = logits + gumbel_noise(self.noise_seed, where, logits.shape)
        return torch.softmax(noisy.div_(self.tau) if self.tau != 1.0 else noisy, dim=-1)


@dataclass
class StepState:
    """What one forward step tells the attention function."""

    cache: object  # skipkey.core.cache.KVCache
    query_positions: torch.Tensor  # [B, q], EMPTY (-1) for padding
    dense: bool = True  # no padding among the queries
    contribution: ScoreContribution | None = None  # set when the KV policy scores this step
    start_score: torch.Tensor | None = None  # [B] float32: the score each new token starts with (None: 0)
    accumulate: bool = True  # add each step's contribution (H2O, Keyformer) or replace it (TOVA)
    observe: int = 0  # prompt scores from each row's last ``observe`` queries only (0: all)
    position_limit: int | None = None  # every query position is below this
    # When set, each layer's prompt queries, keys, values and scale are kept here by layer index,
    # so several KV policies can later start from one prompt pass (``score_prompt``).
    capture: dict | None = None


@dataclass(frozen=True)
class NoiseIndex:
    """Where each logit sits: enough to draw noise that does not depend on batching or slot order.

    ``key_start`` [B], when given, says the keys hold consecutive positions from it
    (a prompt chunk), which lets noise be read as one contiguous run per query.
    """

    layer: int
    query_positions: torch.Tensor  # [B, q]
    key_positions: torch.Tensor  # [B, Hp, S]
    key_start: torch.Tensor | None = None
    position_limit: int | None = None  # every query position is below this (known without a device sync)


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


def _mask_for_output(layer, positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor | None:
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


_NO_NOISE = (torch.empty(0), torch.empty(0, dtype=torch.long))  # "no noise" for the fused kernels
_NO_SCORES = torch.empty(0)  # "the output alone" for ``attend_score``


def _fused_noise(contribution: ScoreContribution, layer_idx: int, hkv: int, groups: int, query_positions,
                 position_limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernels' noise arguments: the flat table and each query's start in it, ``[B, Hkv, G, q]``."""
    if contribution.noise_seed is None:
        return _NO_NOISE
    device = query_positions.device
    starts = query_starts(contribution.noise_seed, layer_idx, hkv, groups, device, query_positions, position_limit)
    return noise_table(contribution.noise_seed, str(device)).view(-1), starts.contiguous()


def _per_head_scores(layer, rows: int, hkv: int) -> torch.Tensor:
    layer.ensure_scores()
    if layer.scores.shape[1] != hkv:
        layer.scores = layer.scores.expand(rows, hkv, -1).contiguous()
    return layer.scores


def accumulate_scores(layer, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float,
                      query_positions: torch.Tensor, contribution, observe: int = 0,
                      position_limit: int | None = None) -> None:
    """Add each prompt query's score contribution to ``layer.scores`` [B, Hkv, S], summed over GQA groups.

    Logits are computed in the model's dtype (as eager attention does) in query
    chunks, so prefill memory stays bounded. ``observe`` > 0 scores only each row's
    last ``observe`` queries (SnapKV's observation window).
    """
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    groups = hq // hkv
    scores = _per_head_scores(layer, b, hkv)
    total = torch.zeros(b, hkv, key.shape[2], device=key.device, dtype=torch.float32)
    last = query_positions.max(dim=1).values  # [B]: each row's last prompt position
    # In a sliding-window layer only keys newer than (last position + 1 - window) survive the
    # prompt; queries at or before that line see none of them, so their chunks are skipped.
    skip_until = torch.full_like(last, -1)
    if layer.window is not None and q > 1:
        skip_until = torch.maximum(skip_until, last + 1 - layer.window)
    if observe > 0:
        skip_until = torch.maximum(skip_until, last - observe)
    # A prompt pass with no past: slot i holds the i-th token fed (after left padding), so the
    # chunk's queries see no slot after ``stop`` and, in a sliding layer, none before its window.
    # Scoring only that band is exact and halves the work of a long prompt.
    prompt_only = q == key.shape[2]
    first_slot_position = last - (q - 1)  # position slot 0 holds in each row (negative under padding)
    # With no padding and no window, a chunk's queries see every key before the chunk: only the
    # diagonal block needs the causal mask.
    block_only = prompt_only and layer.window is None and bool((query_positions >= 0).all())
    queries = query * scaling  # the scale folded into the (few) queries, not the (many) logits
    fused = kernels.for_tensors(query, key)
    if fused is not None:  # keys packed once per layer for the kernel's products
        packed = kernels.pack_keys(fused, key)
    else:
        keys_t = key.transpose(-1, -2).contiguous()  # [B, Hkv, D, S]: the chunks' products run ~1.6x faster from it
    first = max(0, q - observe) if observe > 0 and prompt_only else 0
    for start in range(first, q, SCORE_CHUNK):
        stop = min(q, start + SCORE_CHUNK)
        n = stop - start
        qpos = query_positions[:, start:stop]
        if bool((qpos.max(dim=1).values <= skip_until).all()):
            continue
        lo, hi = 0, key.shape[2]
        if prompt_only:
            hi = stop
            if layer.window is not None:
                lo = max(0, start - layer.window + 1)
        positions = layer.positions[:, :, lo:hi]
        qc = queries[:, :, start:stop].reshape(b, hkv, groups * n, d)
        # Padding queries, and queries before the observation window, weigh nothing.
        weight = (qpos > skip_until[:, None]).float()
        if fused is not None:  # logits, mask, noise, softmax and the weighted sum in one pass, logits in registers
            noise = _fused_noise(contribution, layer_idx, hkv, groups, qpos, position_limit)
            fused.score_prompt(qc.contiguous(), groups, packed[:, :, :, lo:hi], qpos.contiguous(), weight, positions,
                               layer.window or 0, *noise, NOISE_COLS, float(contribution.tau), total[:, :, lo:hi])
            continue
        logits = torch.matmul(qc, keys_t[..., lo:hi]).float().view(b, hkv, groups, n, hi - lo)
        if block_only:
            causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril_()
            logits[..., start - lo:].masked_fill_(~causal, float("-inf"))
        else:
            slots = torch.arange(start - lo, stop - lo, device=query.device) if prompt_only else None
            allowed = allowed_keys(positions, qpos, layer.window, slots)
            logits.masked_fill_(~allowed[:, :, None], float("-inf"))
        where = NoiseIndex(layer_idx, qpos, positions, first_slot_position + lo if prompt_only else None,
                           position_limit)
        probs = contribution(logits, where)
        # Sum over query heads and queries in one pass.
        weight = weight[:, None, None, :].expand(b, hkv, groups, n)
        total[:, :, lo:hi] += torch.matmul(weight.reshape(b, hkv, 1, groups * n),
                                           probs.reshape(b, hkv, groups * n, hi - lo))[:, :, 0]
    layer.scores = scores + total


def _attend_and_score(layer, layer_idx: int, query, key, value, scaling: float, positions,
                      state: StepState) -> torch.Tensor:
    """One decode query per row: the logits are computed once, for the output and for the score."""
    fused = kernels.for_tensors(key, value)
    if fused is not None:
        return _attend_and_score_fused(fused, layer, layer_idx, query, key, value, scaling, positions, state)
    b, hq, _, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    groups = hq // hkv
    # Matmul in the model's dtype and softmax in float32, as transformers' eager attention does.
    # On CPU a half-precision ``K @ q`` runs about twice as fast as ``q @ K^T`` and float32 the
    # other way round (measured with torch 2.13 on the development machine).
    q = (query * scaling).reshape(b, hkv, groups, d)
    if key.dtype == torch.float32:
        logits = torch.matmul(q, key.transpose(-1, -2))
    else:
        logits = torch.matmul(key, q.transpose(-1, -2)).transpose(-1, -2)
    logits = logits.float()  # [B, Hkv, G, S]
    mask = _mask_for_output(layer, positions, state.query_positions)
    if mask is not None:
        logits.masked_fill_(~mask[:, :, 0, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs.to(value.dtype), value)  # [B, Hkv, G, D]
    contribution = state.contribution(logits.view(b, hkv, groups, 1, s),
                                      NoiseIndex(layer_idx, state.query_positions, positions,
                                                 position_limit=state.position_limit),
                                      probs.view(b, hkv, groups, 1, s))
    added = contribution.sum(dim=(2, 3)) if groups > 1 else contribution.view(b, hkv, s)
    scores = _per_head_scores(layer, b, hkv)
    view = layer.visible()
    if state.accumulate:
        scores[..., view].add_(added)  # in place (``+=`` on a slice would copy it back onto itself)
    else:
        scores[..., view] = added
    return out.reshape(b, hq, 1, d).transpose(1, 2).contiguous()


def _attend_and_score_fused(fused, layer, layer_idx: int, query, key, value, scaling: float, positions,
                            state: StepState) -> torch.Tensor:
    """``_attend_and_score`` in one C++ call (``skipkey.core.kernels``): the keys and values are read once,
    the scores updated in place. The scaled query, logits and output accumulate in float32."""
    b, hq = query.shape[:2]
    hkv = key.shape[1]
    contribution = state.contribution
    noise = _fused_noise(contribution, layer_idx, hkv, hq // hkv, state.query_positions, state.position_limit)
    scores = _per_head_scores(layer, b, hkv)[..., layer.visible()]
    return _attend_fused(fused, layer, query, key, value, scaling, positions, state,
                         (scores, state.accumulate, *noise, NOISE_COLS, float(contribution.tau)))


_UNSCORED = (_NO_SCORES, False, *_NO_NOISE, NOISE_COLS, 1.0)  # ``attend_score``'s scoring arguments: none


def _attend_fused(fused, layer, query, key, value, scaling: float, positions, state: StepState,
                  scoring: tuple = _UNSCORED) -> torch.Tensor:
    """A decode step's attention in the fused kernel; by default without the score: an evicting layer of an
    unscored policy, whose out-of-order slots SDPA would need a mask for, and where SDPA runs several times
    below memory speed on CPUs without AMX (``assets/results/decode_kernels.txt``). Full mode keeps SDPA,
    so it stays ``generate``'s token for token."""
    b, hq, _, d = query.shape
    # A decode query needs a mask exactly where the layer is not dense (``_mask_for_output``).
    out = fused.attend_score(query, scaling, key, value, positions, state.query_positions.reshape(b), layer.window or 0,
                             not layer.dense, *scoring)
    return out.view(b, hq, 1, d).transpose(1, 2)


def skipkey_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, step_state: StepState | None = None, **kwargs):
    kwargs.pop("sliding_window", None)
    if step_state is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    layer = step_state.cache.layers[module.layer_idx]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if step_state.capture is not None:
        step_state.capture[module.layer_idx] = (query, key, value, scale)
    key, value = layer.write(key, value, step_state.query_positions, step_state.dense, step_state.start_score)
    positions = layer.visible_positions()
    scoring = step_state.contribution is not None and layer.scored
    if scoring and query.shape[2] == 1:
        return _attend_and_score(layer, module.layer_idx, query, key, value, scale, positions, step_state), None
    fused = kernels.for_tensors(key, value) if layer.reuse and query.shape[2] == 1 else None
    if fused is not None:  # an evicting layer that needs no scores (window, streaming): the output alone
        return _attend_fused(fused, layer, query, key, value, scale, positions, step_state), None
    mask = _mask_for_output(layer, positions, step_state.query_positions)
    out, _ = sdpa_attention_forward(module, query, key, value, _expand_heads(mask, query.shape[1]), dropout=0.0,
                                    scaling=scaling, **kwargs)
    if scoring:
        accumulate_scores(layer, module.layer_idx, query, key, scale, step_state.query_positions,
                          step_state.contribution, step_state.observe, step_state.position_limit)
    return out, None


def score_prompt(layer, layer_idx: int, captured, state: StepState) -> None:
    """Fill a layer's cache from a recorded prompt pass, scoring it as the attention function would have."""
    query, key, value, scale = captured
    key, _ = layer.write(key, value, state.query_positions, state.dense)
    if state.contribution is not None and layer.scored:
        accumulate_scores(layer, layer_idx, query, key, scale, state.query_positions, state.contribution,
                          state.observe, state.position_limit)


def install_attention(model) -> None:
    """Register SkipKey's attention and make ``model`` use it (plain SDPA outside the engine)."""
    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, skipkey_attention)
        # Outside the engine the model builds its own masks; they must be SDPA's.
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    for config in {id(c): c for c in (model.config, getattr(model.config, "text_config", None)) if c}.values():
        config._attn_implementation = ATTENTION_NAME
