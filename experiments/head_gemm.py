"""The LM head on a few rows: ``nn.Linear`` against the weight-streaming product (``skipkey.core.gemm``).

    python -m experiments.head_gemm --output assets/results/head_gemm.json

Times the embedded model's head (262,144 x 640) and its 32k-row draft head in float32 and
bfloat16 for 1..8 rows, median of 15 calls each, interleaved, on this machine's threads; a
quiet machine is needed. Prints milliseconds and the effective bandwidth (weight bytes / time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from skipkey.core.gemm import streamed_product
from skipkey.provenance import machine_description

SHAPES = {"LM head (262144 x 640)": (262144, 640), "32k-row draft head (32768 x 640)": (32768, 640)}


def timed(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--output")
    args = p.parse_args(argv)
    results = []
    for label, (n, d) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            weight = torch.randn(n, d).to(dtype)
            for rows in args.rows:
                hidden = torch.randn(rows, d).to(dtype)
                linear = timed(lambda: torch.nn.functional.linear(hidden, weight), args.repeats)
                streamed = timed(lambda: streamed_product(hidden, weight, None), args.repeats)
                gb = weight.numel() * weight.element_size() / 1e9
                results.append({"weight": label, "dtype": str(dtype), "rows": rows, "linear_ms": linear * 1e3,
                                "streamed_ms": streamed * 1e3, "linear_gb_s": gb / linear, "streamed_gb_s": gb / streamed})
                r = results[-1]
                print(f"{label:34s} {str(dtype):15s} rows {rows}: nn.Linear {r['linear_ms']:7.1f} ms "
                      f"({r['linear_gb_s']:5.1f} GB/s)   streamed {r['streamed_ms']:7.1f} ms "
                      f"({r['streamed_gb_s']:5.1f} GB/s)", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({"machine": machine_description(torch.device("cpu")),
                                                 "threads": torch.get_num_threads(),
                                                 "date": time.strftime("%Y-%m-%d"), "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
