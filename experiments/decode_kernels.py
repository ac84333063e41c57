"""The KV kernels measured alone, per layer, on Llama-MHA-350M's layer shape (16 heads of 64, bf16).

Decode, batch 1 and 8, a 2k prompt at 50%: 1025 cached slots (SDPA over the full model's 2049 for reference):
what a scoring policy's attention costs against SDPA, and what Keyformer's noise costs. Prompt, batch 1, 2k and
4k tokens: what scoring every prompt query (H2O, Keyformer) costs against the layer's causal SDPA.

    python -m experiments.decode_kernels > assets/results/decode_kernels.txt

"cold" cycles through 24 layers' own caches with a weight matrix read between calls, as in a real step, so the
cache comes from memory rather than the CPU's caches.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from skipkey.core import kernels
from skipkey.core.attention import StepState
from skipkey.kv.scoring import NoiseIndex, ScoreContribution, accumulate_scores
from skipkey.core.cache import LayerCache
from skipkey.kv.noise import gumbel_noise
from skipkey.provenance import machine_description

LAYERS, HEADS, SLOTS, FULL_SLOTS, DIM = 24, 16, 1025, 2049, 64
DTYPE = torch.bfloat16


def per_call_us(fn, layers: int = LAYERS, rounds: int = 5, between=None) -> float:
    """Mean microseconds of ``fn(layer)`` over ``rounds`` passes through the layers (one untimed pass first)."""
    total = 0.0
    for r in range(rounds + 1):
        for i in range(layers):
            if between is not None:
                between(i)
            start = time.perf_counter()
            fn(i)
            if r:
                total += time.perf_counter() - start
    return total / rounds / layers * 1e6


def decode(batch: int) -> None:
    torch.manual_seed(0)
    shape = (batch, HEADS, SLOTS, DIM)
    keys = [torch.randn(shape, dtype=DTYPE) for _ in range(LAYERS)]
    values = [torch.randn(shape, dtype=DTYPE) for _ in range(LAYERS)]
    full_keys = [torch.randn(batch, HEADS, FULL_SLOTS, DIM, dtype=DTYPE) for _ in range(LAYERS)]
    full_values = [torch.randn(batch, HEADS, FULL_SLOTS, DIM, dtype=DTYPE) for _ in range(LAYERS)]
    weights = [torch.randn(4096, 1024, dtype=DTYPE) for _ in range(LAYERS)]
    x = torch.randn(batch, 1024, dtype=DTYPE)
    query = torch.randn(batch, HEADS, 1, DIM, dtype=DTYPE)

    def stream_weights(i):
        x @ weights[i].T

    def sdpa_full(i):
        F.scaled_dot_product_attention(query, full_keys[i], full_values[i])

    def sdpa(i):
        F.scaled_dot_product_attention(query, keys[i], values[i])

    def scoring(i):  # the scoring decode attention's kernels (skipkey.kv.scoring, attend and score)
        logits = torch.matmul(keys[i], query.transpose(-1, -2)).transpose(-1, -2).float()
        probs = torch.softmax(logits, dim=-1)
        torch.matmul(probs.to(DTYPE), values[i])

    positions = torch.stack([torch.randperm(2100)[:SLOTS] for _ in range(batch)])[:, None].expand(shape[:3]).contiguous()
    where = NoiseIndex(3, torch.full((batch, 1), 2100), positions, None, 4096)

    def noise(i):
        gumbel_noise(0, where, (batch, HEADS, 1, 1, SLOTS))

    fused = kernels.for_tensors(keys[0])
    qpos, scores = torch.full((batch,), 2100), torch.zeros(batch, HEADS, SLOTS)
    none, no_start = torch.empty(0), torch.empty(0, dtype=torch.long)

    def fused_scoring(i):  # the same, fused (skipkey.core.kernels.attend_score, H2O's contribution)
        fused.attend_score(query, 1.0, keys[i], values[i], positions, qpos, 0, True, scores, True, none, no_start,
                           8192, 1.0)

    def fused_alone(i):  # the same kernel without the score: an unscored policy's evicting layer (window, streaming)
        fused.attend_score(query, 1.0, keys[i], values[i], positions, qpos, 0, True, none, False, none, no_start,
                           8192, 1.0)

    print(f"# decode: microseconds per layer and step, batch {batch}")
    for name, fn in [("SDPA over 2049 slots (full model)", sdpa_full), ("SDPA over 1025 slots", sdpa),
                     ("scoring attention over 1025 slots", scoring),
                     *([("fused scoring attention, 1025 slots", fused_scoring),
                        ("fused attention alone, 1025 slots", fused_alone)] if fused else []),
                     ("Keyformer noise for 1025 slots", noise)]:
        print(f"{name:<36} cold {per_call_us(fn, between=stream_weights):8.1f}   "
              f"warm {per_call_us(fn, layers=1, rounds=200 // batch):8.1f}", flush=True)


def prompt(tokens: int) -> None:
    """One layer's prompt attention against scoring every prompt query (``skipkey.kv.scoring.accumulate_scores``)."""
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, HEADS, tokens, DIM, dtype=DTYPE) for _ in range(3))
    positions = torch.arange(tokens)[None]

    def sdpa(_):
        F.scaled_dot_product_attention(query, key, value, is_causal=True)

    def score(contribution):
        def run(_):
            layer = LayerCache(None)
            layer.write(key, value, positions, dense=True)
            accumulate_scores(layer, 3, query, key, DIM ** -0.5, StepState(cache=None, query_positions=positions,
                                                                    contribution=contribution, position_limit=tokens))
        return run

    print(f"# prompt of {tokens} tokens: milliseconds per layer, batch 1 (the kernels {'on' if kernels.enabled() else 'off'})")
    for name, fn in [("causal SDPA (the prompt's attention)", sdpa), ("H2O scoring every query", score(ScoreContribution())),
                     ("Keyformer scoring (noise, tau 1)", score(ScoreContribution(1.0, 0)))]:
        print(f"{name:<36} {per_call_us(fn, layers=1, rounds=3) / 1e3:8.1f}", flush=True)


def main() -> None:
    print(f"# {' '.join(sys.argv)}\n# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{machine_description(torch.device('cpu'))}")
    for batch in (1, 8):
        decode(batch)
    for tokens in (2048, 4096):
        prompt(tokens)


if __name__ == "__main__":
    main()
