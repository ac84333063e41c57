"""An adapter's quality at the shapes it is served with, measured as the shape study confirms a shape (the four
measures on the 48 held-out prompts, 64 tokens, float32, against the full model): the quick check of a training
run before the whole ``eval --suite tuned``. One JSON line per target.

    python -m experiments.shape_check /tmp/me/lora-g 1.5 2 3
"""

import json
import sys
from dataclasses import asdict

from skipkey.skipdecode.adapter import adapter_schedule, load_tuned, read_metadata
from skipkey.models import load
from skipkey.quality.prompts import ORDINARY_PROMPTS
from skipkey.skipdecode.schedules import measured_best_shape
from skipkey.training.shapes import measure_rows


def main() -> None:
    adapter, targets = sys.argv[1], [float(t) for t in sys.argv[2:]] or [1.5, 2.0, 3.0]
    loaded = load("embedded", None, "float32")
    models = {"untuned": loaded, "tuned": load_tuned(loaded, adapter)}
    policy, table = adapter_schedule(read_metadata(adapter))
    rows = [{"model": "tuned", "policy": policy, "target": t, "shape": asdict(measured_best_shape(t, policy, table))}
            for t in targets]
    for row in measure_rows(models, rows, ORDINARY_PROMPTS[:48], 64, lambda msg: print(msg, file=sys.stderr)):
        print(json.dumps({k: row[k] for k in ("target", "shape", "next_token_accuracy", "ppl_of_full_continuations",
                                              "rouge_l", "first_divergence_median")}))


if __name__ == "__main__":
    main()
