"""The SkipDecode frontier: next-token accuracy against the full model (``eval --suite tuned``) against the
measured speedup of the same schedule on this machine (``bench``), one line per configuration: untuned
``top`` and ``importance``, and each adapter (one ``--eval`` each) at the policy it was trained with.

    python -m experiments.frontier --eval assets/results/eval_tuned.json \
        --bench assets/results/bench_skip_frontier_top.json assets/results/bench_skip_frontier_importance.json \
        --figure assets/skipdecode_frontier.png
"""

import argparse
import json
from pathlib import Path

from skipkey.quality.evaluate import markdown_table, save_figure
from skipkey.training.shapes import frontier_figure, frontier_quality, frontier_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval", nargs="+", required=True, help="eval --suite tuned JSONs, one per adapter")
    parser.add_argument("--bench", nargs="+", required=True, help="bench JSONs with skip POLICY TARGETx rows")
    parser.add_argument("--figure", required=True)
    args = parser.parse_args()
    quality = frontier_quality([json.loads(Path(path).read_text()) for path in args.eval])
    bench = [row for path in args.bench for run in json.loads(Path(path).read_text()) for row in run["rows"]
             if run["batch"] == 1]
    rows = frontier_rows(quality, bench)
    save_figure(frontier_figure(rows), args.figure)
    print(markdown_table(rows, ["series", "target", "measured_speedup", "compute_ratio", "next_token_accuracy",
                                "ppl_of_full_continuations", "rouge_l", "first_divergence_median"]))


if __name__ == "__main__":
    main()
