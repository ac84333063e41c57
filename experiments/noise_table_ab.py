"""How much of Keyformer's prompt scoring is its noise table's memory traffic: one layer's scoring at a 4k prompt
(Llama-MHA-350M shape: 16 heads of 64, bf16, random inputs) with the shipped 32 MB table and with smaller ones
that fit the caches, beside H2O (the same kernel with no noise). Interleaved rounds, one process.

    python -m experiments.noise_table_ab > assets/results/noise_table_ab.txt

A smaller table changes every draw (so every Keyformer quality figure), which is why it is measured here and
not shipped: the gap between the shipped table and H2O bounds what any cheaper noise could buy.
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone

import torch


from skipkey.kv import noise
from skipkey.core.attention import StepState
from skipkey.kv.scoring import ScoreContribution, accumulate_scores
from skipkey.core.cache import LayerCache
from skipkey.provenance import machine_description

HEADS, DIM, LAYER, SEED = 16, 64, 3, 0


def score_once(inputs, rows: int | None) -> float:
    """Seconds for one layer's prompt scoring; ``rows`` None is H2O (no noise)."""
    q, k, v, pos = inputs
    contribution = ScoreContribution()
    if rows is not None:
        noise.NOISE_ROWS = rows
        noise.clear_tables()
        noise.noise_table(SEED, "cpu")  # built outside the timed call, as a long-running process has it
        contribution = ScoreContribution(1.0, SEED)
    layer = LayerCache(None)
    layer.write(k, v, pos, dense=True)
    start = time.perf_counter()
    accumulate_scores(layer, LAYER, q, k, DIM ** -0.5, StepState(cache=None, query_positions=pos, contribution=contribution,
                                                             position_limit=pos.shape[1]))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--rows", type=int, nargs="+", default=[noise.NOISE_ROWS, 64, 16])
    args = parser.parse_args()
    shipped = noise.NOISE_ROWS
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, args.tokens, DIM, dtype=torch.bfloat16) for _ in range(3))
    inputs = (q, k, v, torch.arange(args.tokens)[None])
    variants = [None, *args.rows]
    times = {r: [] for r in variants}
    try:
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for rows in variants:
                seconds = score_once(inputs, rows)
                if round_:
                    times[rows].append(seconds)
    finally:
        noise.NOISE_ROWS = shipped
        noise.clear_tables()
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {machine_description(torch.device('cpu'))}; "
          f"{args.tokens} tokens, {args.rounds} rounds")
    print("| variant | table | min ms | median ms | vs H2O (median) |")
    print("|---|---|---|---|---|")
    base = sorted(times[None])[len(times[None]) // 2]
    for rows, t in times.items():
        median = sorted(t)[len(t) // 2]
        name = "h2o (no noise)" if rows is None else f"keyformer, {rows} rows" + (" (shipped)" if rows == shipped else "")
        table = "–" if rows is None else f"{rows * 2 * noise.NOISE_COLS * 4 / 2 ** 20:g} MB"
        print(f"| {name} | {table} | {min(t) * 1e3:.1f} | {median * 1e3:.1f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
