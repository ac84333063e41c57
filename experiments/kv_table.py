"""The KV speed tables of docs/results/kv.md, from the JSON that ``experiments/speed.sh``'s KV block writes.

    python -m experiments.kv_table

One row per (model, prompt, batch, policy): decode tok/s (each row's own median), the lockstep "vs full" with the
range over runs (where there were several), the memory-traffic limit, the measured speedup over it, then (where the
run has a ``window:budget=1.0`` row) the speedup over that row and over the bytes limit against it, TTFT vs full and
the KV cache held (MiB).
Then the time-to-first-token run at 4k (five alternating repeats): each policy's median TTFT and the median and range
of its runs' own ratios to the full model's. Then the scored prompt pass in both dtypes (``bench_kv_prompt_*.json``):
per model, prompt and policy, TTFT and decode against the full model in float32 and in bfloat16, side by side.
Then eviction's own gain (``eviction_gain.py``): one column per prompt and batch, each policy's lockstep speedup
over ``window:budget=1.0`` and its share of the two limits. Every row names the dtype its run used.
"""

from __future__ import annotations

import json
import re
from statistics import median
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "assets" / "results"  # the data it reads
FILES = [("llama-mha-350m", "bench_kv_llama350m_2k.json"), ("llama-mha-350m", "bench_kv_llama350m_4k.json"),
         ("llama-mha-350m", "bench_kv_llama350m_2k_b8.json"), ("llama-mha-350m", "bench_kv_llama350m_4k_b8.json"),
         ("embedded", "bench_kv_embedded.json")]
TTFT = "bench_kv_llama350m_4k_ttft.json"
PROMPT_PASS = "bench_kv_prompt_*.json"  # one per model and dtype
GAIN = ["eviction_gain_2k_b1.json", "eviction_gain_4k_b1.json", "eviction_gain_2k_b8.json", "eviction_gain_4k_b8.json"]


def policy_name(variant: str) -> str:
    """``"snapkv (50% of prompt, recent 30%, observe 32, pool 7)"`` -> ``"snapkv (observe 32, pool 7)"``: the
    table's own budget (50%) and recent window go; another budget stays (``"window (100% of prompt)"``)."""
    name, _, rest = variant.partition(" (")
    options = [o for o in rest.rstrip(")").split(", ") if o and not re.match(r"(50% of prompt|recent \d+%)$", o)]
    return f"{name} ({', '.join(options)})" if options else name


REFERENCE = "window (100% of prompt"  # keeps the whole prompt through the evicting layers' attention kernel


def against_reference(row: dict, reference: dict | None) -> str:
    """The row's speedup over the reference row (the same attention kernel, nothing evicted) and that over its
    own bytes limit there: what eviction itself delivers, whatever the full model's attention costs."""
    if reference is None or row is reference or row["variant"] == "full":
        return "| – | – "
    gain = row["speedup_vs_full"] / reference["speedup_vs_full"]
    limit = row["ideal_ratio"] / reference["ideal_ratio"]
    return f"| {gain:.2f}x | {gain / limit:.2f} "


def dtype_of(run: dict) -> str:
    """The dtype a bench run used, as its JSON records it (``"torch.bfloat16"`` -> ``"bfloat16"``)."""
    return str(run.get("dtype", "?")).replace("torch.", "")


def ratio_with_range(value: float, spread: list | None) -> str:
    return f"{value:.2f}x" + (f" ({spread[0]:.2f}–{spread[1]:.2f})" if spread else "")


def main() -> None:
    print("| model | dtype | prompt | batch | policy | decode tok/s | vs full (runs' range) | bytes limit | of limit "
          "| vs window 100% | of its limit | TTFT vs full | KV MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, name in FILES:
        for run in json.loads((HERE / name).read_text()):
            prompts = {row.get("prompt") for row in run["rows"]}
            for prompt_rows in ([r for r in run["rows"] if r.get("prompt") == p] for p in sorted(prompts, key=str)):
                reference = next((r for r in prompt_rows if r["variant"].startswith(REFERENCE)), None)
                for row in prompt_rows:
                    ratio = ratio_with_range(row["speedup_vs_full"], row.get("speedup_range") if run["repeats"] > 1 else None)
                    prompt = run["prompt_tokens"] if isinstance(run["prompt_tokens"], int) else run["prompt_tokens"][0]
                    print(f"| {model} | {dtype_of(run)} | {row.get('prompt', prompt)} | {run['batch']} "
                          f"| {policy_name(row['variant'])} "
                          f"| {row['tokens_per_s']:.1f} | {ratio} | {row['ideal_ratio']:.2f}x "
                          f"| {row['measured_over_ideal']:.2f} {against_reference(row, reference)}"
                          f"| {row['ttft_vs_full']:.2f}x | {row['kv_bytes'] / 2**20:.1f} |")

    path = HERE / TTFT
    for run in json.loads(path.read_text()) if path.exists() else []:
        print(f"\n{run['repeats']} runs beside the full model, prompt {run['prompt_tokens']}, batch {run['batch']}, "
              f"{dtype_of(run)}\n")
        print("| policy | TTFT s (median) | TTFT vs full (runs' range) |")
        print("|---|---|---|")
        for row in run["rows"]:
            ratio = ratio_with_range(row["ttft_vs_full"], row.get("ttft_range"))
            print(f"| {policy_name(row['variant'])} | {row['ttft_s']:.2f} | {ratio} |")
    prompt_pass_table()
    eviction_gain_table()


def prompt_pass_table() -> None:
    """The scored prompt pass in float32 and bfloat16 side by side: TTFT (s, and vs full with the runs' range)
    and decode vs full, per model, prompt and policy."""
    rows: dict[tuple, dict[str, dict]] = {}
    places: dict[str, str] = {}
    for path in sorted(HERE.glob(PROMPT_PASS)):
        # The column: the file name's tail after the model (``float32``, ``float32_avx``, ``float32_eager``), which
        # names the dtype and the path; the JSON's own dtype must agree.
        column = re.sub(r"^bench_kv_prompt_[^_]+_", "", path.stem)
        for run in json.loads(path.read_text()):
            assert column.startswith(dtype_of(run)), f"{path.name} holds a {dtype_of(run)} run"
            places[column] = f"{run['machine'].split(', torch')[0]}, {run['date']}"
            prompt = run["prompt_tokens"] if isinstance(run["prompt_tokens"], int) else run["prompt_tokens"][0]
            for row in run["rows"]:
                key = (run["model"], row.get("prompt", prompt), policy_name(row["variant"]))
                rows.setdefault(key, {})[column] = row if run["repeats"] > 1 else {**row, "ttft_range": None,
                                                                                  "speedup_range": None}
    if not rows:
        return
    dtypes = sorted({d for by_dtype in rows.values() for d in by_dtype})
    print("\n" + "; ".join(f"{d}: {places[d]}" for d in dtypes))
    print("\n| model | prompt | policy | " + " | ".join(f"{d}: TTFT s | TTFT vs full | decode vs full" for d in dtypes)
          + " |")
    print("|---|---|---|" + "---|---|---|" * len(dtypes))
    for (model, prompt, policy), by_dtype in rows.items():
        cells = []
        for d in dtypes:
            row = by_dtype.get(d)
            cells.append("– | – | –" if row is None else
                         f"{row['ttft_s']:.2f} | {ratio_with_range(row['ttft_vs_full'], row.get('ttft_range'))} "
                         f"| {ratio_with_range(row['speedup_vs_full'], row.get('speedup_range'))}")
        print(f"| {model} | {prompt} | {policy} | " + " | ".join(cells) + " |")


def eviction_gain_table() -> None:
    runs = [json.loads((HERE / name).read_text()) for name in GAIN if (HERE / name).exists()]
    if not runs:
        return
    print("\n| | " + " | ".join(f"{r['prompt_tokens']}, batch {r['batch']}" for r in runs) + " |")
    print("|---|" + "---|" * len(runs))
    print("| bytes limit | " + " | ".join(f"{median([x['bytes_limit'] for x in r['rows']]):.2f}x" for r in runs) + " |")
    print("| attention-time limit (reference's attention share) | " + " | ".join(
        f"{median([x['attention_time_limit'] for x in r['rows']]):.2f}x "
        f"({median([x['reference_attention_share'] for x in r['rows']]):.0%})" for r in runs) + " |")
    for i, row in enumerate(runs[0]["rows"]):
        cells = []
        for r in runs:
            x = r["rows"][i]
            assert x["policy"] == row["policy"], "every run lists the same policies"
            cells.append(f"{x['speedup_vs_reference']:.2f}x ({x['range'][0]:.2f}–{x['range'][1]:.2f}): "
                         f"{x['of_limit']:.2f} / {x['of_time_limit']:.2f}")
        print(f"| {row['policy']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
