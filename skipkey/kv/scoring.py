"""How H2O, TOVA, SnapKV and Keyformer score cached tokens: the attention function calls this through ``StepState``.

The core's attention function knows nothing of KV policies: when a policy scores
a step, the engine puts a ``ScoreContribution`` into the ``StepState`` and the
attention function calls its two methods, ``score_prompt`` (the prompt's logits
computed a second time, for the score only, in query chunks) and
``attend_and_score`` (a decode step's logits computed once, for the output and the
score). On CPU both run in one fused C++ call (``skipkey.core.kernels``), except where the model
soft-caps its attention logits (Gemma 2): the kernels do not cap, so those run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from skipkey.core import kernels
from skipkey.core.attention import NO_NOISE, StepState, allowed_keys, attend_fused, mask_for_output, soft_cap
from skipkey.kv.noise import NOISE_COLS, gumbel_noise, noise_table, query_starts

SCORE_CHUNK = 256  # prompt queries scored at once at most; bounds prefill memory on long prompts
# The eager path on CPU scores fewer at once: a chunk's float32 logits (and the noise and softmax made from them)
# at most this many bytes stay in the cache, and below glibc's mmap threshold (32 MB), above which every chunk's
# fresh tensors page-fault their memory in again. 256 queries at 4k tokens took 1.6x the time of 32 (#44).
EAGER_CPU_CHUNK_BYTES = 8 << 20


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


@dataclass(frozen=True)
class ScoreContribution:
    """What each query adds to a key's score: ``softmax((logits + Gumbel noise) / tau)`` over its keys.

    H2O, TOVA and SnapKV use the attention weights themselves (``tau = 1``, no noise);
    Keyformer adds noise keyed by ``noise_seed`` and a temperature. One form for every
    policy is what lets the fused decode kernel compute it. It is also the scorer the
    attention function calls (``score_prompt``, ``attend_and_score``).
    """

    tau: float = 1.0
    noise_seed: int | None = None  # None: no noise

    @property
    def is_attention(self) -> bool:
        """The contribution is the attention weights (no noise, no temperature)."""
        return self.noise_seed is None and self.tau == 1.0

    def __call__(self, logits: torch.Tensor, where: NoiseIndex, probs: torch.Tensor | None = None) -> torch.Tensor:
        """``logits`` [B, Hkv, G, q, S] in the model's dtype or float32, -inf where masked; ``probs``, when
        given, is their softmax. Float32 out, computed as from ``logits.float()`` but without that copy."""
        if self.is_attention:
            return probs if probs is not None else torch.softmax(logits, dim=-1, dtype=torch.float32)
        if self.noise_seed is None:
            return torch.softmax(logits.float() / self.tau, dim=-1)
        noisy = gumbel_noise(self.noise_seed, where, logits.shape).add_(logits)  # the noise is a fresh tensor
        return torch.softmax(noisy.div_(self.tau) if self.tau != 1.0 else noisy, dim=-1)

    def score_prompt(self, layer, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float,
                     state: StepState, softcap: float | None = None) -> None:
        """The prompt's queries add their contribution to ``layer.scores`` (``accumulate_scores``)."""
        accumulate_scores(layer, layer_idx, query, key, scaling, state, softcap)

    def attend_and_score(self, layer, layer_idx: int, query: torch.Tensor, visible: tuple, scaling: float,
                         state: StepState, softcap: float | None = None) -> torch.Tensor:
        """One decode query per row: the logits are computed once, for the output and for the score.

        ``visible`` is what ``LayerCache.write`` returned plus its positions: (keys, values, positions).
        ``softcap``: the model caps its attention logits (``soft_cap``).
        """
        fused = kernels.for_tensors(visible[0], visible[1]) if softcap is None else None
        if fused is not None:
            return _attend_and_score_fused(fused, layer, layer_idx, query, visible, scaling, state)
        return _attend_and_score(layer, layer_idx, query, visible, scaling, state, softcap)


def _fused_noise(contribution: ScoreContribution, layer_idx: int, hkv: int, groups: int, query_positions,
                 position_limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernels' noise arguments: the flat table and each query's start in it, ``[B, Hkv, G, q]``."""
    if contribution.noise_seed is None:
        return NO_NOISE
    device = query_positions.device
    starts = query_starts(contribution.noise_seed, layer_idx, hkv, groups, device, query_positions, position_limit)
    return noise_table(contribution.noise_seed, str(device)).view(-1), starts.contiguous()


def _per_head_scores(layer, rows: int, hkv: int) -> torch.Tensor:
    layer.ensure_scores()
    if layer.scores.shape[1] != hkv:
        layer.scores = layer.scores.expand(rows, hkv, -1).contiguous()
    return layer.scores


def _skipped_before(layer, query_positions: torch.Tensor, observe: int) -> torch.Tensor:
    """Per row, the last query position that scores nothing: [B].

    In a sliding-window layer only keys newer than (last position + 1 - window)
    survive the prompt; queries at or before that line see none of them. With an
    observation window, queries before it weigh nothing.
    """
    last = query_positions.max(dim=1).values  # [B]: each row's last prompt position
    skip_until = torch.full_like(last, -1)
    if layer.window is not None and query_positions.shape[1] > 1:
        skip_until = torch.maximum(skip_until, last + 1 - layer.window)
    if observe > 0:
        skip_until = torch.maximum(skip_until, last - observe)
    return skip_until


def accumulate_scores(layer, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float,
                      state: StepState, softcap: float | None = None) -> int:
    """Add each prompt query's score contribution to ``layer.scores`` [B, Hkv, S], summed over GQA groups.

    Logits are computed in the model's dtype (as eager attention does) in query
    chunks, so prefill memory stays bounded. ``state.observe`` > 0 scores only each
    row's last ``observe`` queries (SnapKV's observation window): ``observe`` x S
    logits per query head, not S^2 / 2. ``softcap``: the model caps its attention logits (``soft_cap``).
    Returns the number of logits computed.
    """
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    query_positions, observe = state.query_positions, state.observe
    scores = _per_head_scores(layer, b, hkv)
    total = torch.zeros(b, hkv, key.shape[2], device=key.device, dtype=torch.float32)
    skip_until = _skipped_before(layer, query_positions, observe)
    # A prompt pass with no past: slot i holds the i-th token fed (after left padding), so the
    # chunk's queries see no slot after ``stop`` and, in a sliding layer, none before its window.
    # Scoring only that band is exact and halves the work of a long prompt.
    prompt_only = q == key.shape[2]
    first = max(0, q - observe) if observe > 0 and prompt_only else 0
    chunks = _PromptChunks(layer, layer_idx, (query, scaling), key, state, prompt_only, q - first, softcap)
    computed = 0
    for start, stop in _scored_chunks(query_positions[:, first:], skip_until, chunks.size):
        start, stop = start + first, stop + first
        lo, hi = 0, key.shape[2]
        if prompt_only:
            hi = stop
            if layer.window is not None:
                lo = max(0, start - layer.window + 1)
        # Padding queries, and queries before the observation window, weigh nothing.
        weight = (query_positions[:, start:stop] > skip_until[:, None]).float()
        chunks.add(start, stop, lo, hi, weight, total)
        computed += b * hq * (stop - start) * (hi - lo)
    layer.scores = scores + total
    return computed


def _scored_chunks(query_positions: torch.Tensor, skip_until: torch.Tensor, size: int) -> list[tuple[int, int]]:
    """The chunks of ``size`` queries ``[start, stop)`` in which some row has a query after its ``skip_until``:
    decided for all chunks at once (one device sync a layer, not one a chunk)."""
    rows, q = query_positions.shape
    count = -(-q // size)
    padded = F.pad(query_positions, (0, count * size - q), value=-1)
    scored = (padded.view(rows, count, size).amax(dim=2) > skip_until[:, None]).any(dim=0).tolist()
    return [(i * size, min(q, (i + 1) * size)) for i in range(count) if scored[i]]


class _PromptChunks:
    """One layer's prompt queries, scored a chunk at a time into a running total (``accumulate_scores``)."""

    def __init__(self, layer, layer_idx: int, queries: tuple[torch.Tensor, float], key: torch.Tensor,
                 state: StepState, prompt_only: bool, scored: int, softcap: float | None):
        """``queries``: the layer's queries and their scale, applied a chunk at a time (an observation window
        scales only its own); ``scored``: how many of them are scored (the last ones)."""
        self.layer, self.layer_idx, self.state = layer, layer_idx, state
        self.queries, self.scaling = queries
        self.prompt_only, self.softcap = prompt_only, softcap
        query_positions = state.query_positions
        self.first_slot_position = query_positions.max(dim=1).values - (query_positions.shape[1] - 1)
        # With no padding and no window, a chunk's queries see every key before the chunk: only the
        # diagonal block needs the causal mask.
        self.block_only = prompt_only and layer.window is None and bool((query_positions >= 0).all())
        self.fused = kernels.for_tensors(self.queries, key) if softcap is None else None  # the kernel does not cap
        self.size = SCORE_CHUNK  # queries a chunk
        if self.fused is None and key.device.type == "cpu":
            most = EAGER_CPU_CHUNK_BYTES // (4 * self.queries.shape[0] * self.queries.shape[1] * key.shape[2])
            self.size = max(16, min(SCORE_CHUNK, 1 << max(0, most.bit_length() - 1)))
        if self.fused is not None:  # keys packed once per layer for the kernel's products
            self.packed = kernels.pack_keys(self.fused, key)
        else:  # [B, Hkv, D, S]: contiguous, the chunks' products run ~1.6x faster; worth its copy past one chunk
            self.keys_t = key.transpose(-1, -2)
            if scored > SCORE_CHUNK:
                self.keys_t = self.keys_t.contiguous()

    def add(self, start: int, stop: int, lo: int, hi: int, weight: torch.Tensor, total: torch.Tensor) -> None:
        """Queries ``start:stop`` against slots ``lo:hi``: their weighted contributions added to ``total``."""
        layer, state, contribution = self.layer, self.state, self.state.contribution
        b, hq, _, d = self.queries.shape
        hkv = total.shape[1]
        groups, n = hq // hkv, stop - start
        qpos = state.query_positions[:, start:stop]
        positions = layer.positions[:, :, lo:hi]
        qc = (self.queries[:, :, start:stop] * self.scaling).reshape(b, hkv, groups * n, d)
        if self.fused is not None:  # logits, mask, noise, softmax and the weighted sum in one pass, logits in registers
            noise = _fused_noise(contribution, self.layer_idx, hkv, groups, qpos, state.position_limit)
            self.fused.score_prompt(qc.contiguous(), groups, self.packed[:, :, :, lo:hi], qpos.contiguous(), weight,
                                    positions, layer.window or 0, *noise, NOISE_COLS, float(contribution.tau),
                                    total[:, :, lo:hi])
            return
        # In the model's dtype, as eager attention computes them; the contribution reads them into float32
        # (capped logits are capped in float32).
        logits = torch.matmul(qc, self.keys_t[..., lo:hi]).view(b, hkv, groups, n, hi - lo)
        if self.softcap is not None:
            logits = soft_cap(logits.float(), self.softcap)
        if self.block_only:
            later = torch.ones(n, n, dtype=torch.bool, device=qc.device).triu_(1)
            logits[..., start - lo:].masked_fill_(later, float("-inf"))
        else:
            slots = torch.arange(start - lo, stop - lo, device=qc.device) if self.prompt_only else None
            allowed = allowed_keys(positions, qpos, layer.window, slots)
            logits.masked_fill_(~allowed[:, :, None], float("-inf"))
        where = NoiseIndex(self.layer_idx, qpos, positions,
                           self.first_slot_position + lo if self.prompt_only else None, state.position_limit)
        probs = contribution(logits, where)
        # Sum over query heads and queries in one pass.
        weight = weight[:, None, None, :].expand(b, hkv, groups, n)
        total[:, :, lo:hi] += torch.matmul(weight.reshape(b, hkv, 1, groups * n),
                                           probs.reshape(b, hkv, groups * n, hi - lo))[:, :, 0]


def _attend_and_score(layer, layer_idx: int, query, visible: tuple, scaling: float, state: StepState,
                      softcap: float | None = None) -> torch.Tensor:
    """``ScoreContribution.attend_and_score`` as matmul-softmax-matmul (no fused kernel for these tensors, or
    capped logits)."""
    key, value, positions = visible
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
    logits = soft_cap(logits.float(), softcap)  # [B, Hkv, G, S]
    mask = mask_for_output(layer, positions, state.query_positions)
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


def _attend_and_score_fused(fused, layer, layer_idx: int, query, visible: tuple, scaling: float,
                            state: StepState) -> torch.Tensor:
    """``_attend_and_score`` in one C++ call (``skipkey.core.kernels``): the keys and values are read once,
    the scores updated in place. The scaled query, logits and output accumulate in float32."""
    b, hq = query.shape[:2]
    hkv = visible[0].shape[1]
    contribution = state.contribution
    noise = _fused_noise(contribution, layer_idx, hkv, hq // hkv, state.query_positions, state.position_limit)
    scores = _per_head_scores(layer, b, hkv)[..., layer.visible()]
    return attend_fused(fused, layer, query, visible, scaling, state,
                        (scores, state.accumulate, *noise, NOISE_COLS, float(contribution.tau)))
