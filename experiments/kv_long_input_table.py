"""The long-input tables of docs/results/kv.md (summarization and rag), from the JSON that
``python -m skipkey eval --suite kv --kv-parts long-input --prompts-file FILE`` writes.

    python -m experiments.kv_long_input_table [RESULTS.json]

The first line says where the figures came from (the command, the machine, the date, the dtype and the prompts
file's SHA-256); then, per category, the full model's own ROUGE-L against the references and one row per policy
and budget (``skipkey.quality.long_input.long_input_table``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from skipkey.quality.long_input import long_input_table

RESULTS = Path(__file__).resolve().parents[1] / "assets" / "results" / "eval_kv_long_input_test.json"


def table(result: dict) -> str:
    source = result["prompts_file"]
    head = (f"`{result['command']}` ({result['machine']}, {result['date']}, {result['dtype']}; {len(source['ids'])} "
            f"prompts of {Path(source['path']).name}, SHA-256 {source['sha256']}, the {' and '.join(source['parts'])} "
            f"part)")
    if not result.get("complete"):
        done = len(result.get("kv_long_input_prompts", []))
        head += f". **Incomplete: {done} of {len(source['ids'])} prompts done** (continue it with `--resume`)"
    return head + "\n\n" + long_input_table(result["kv_long_input"])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    print(table(json.loads(Path(argv[0] if argv else RESULTS).read_text())))


if __name__ == "__main__":
    main()
