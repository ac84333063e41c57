"""The GPU check (``experiments/gpu.sh``): its dry run passes on the CPU, and its GPU run asks for what it must.

No GPU is lent to CI, so the GPU run itself is checked by reading the script; the dry run runs the same steps
small, on the CPU, so the script, its helper and every command it calls keep working.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from skipkey.kv.policies import KV_POLICIES
from skipkey.core.random_models import RANDOM_MODELS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "gpu.sh"
STEPS = ["tests", "skip_opt1.3b", "kv", "offload", "app", "exact"]


def test_the_dry_run_passes_every_step_and_writes_its_results(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(tmp_path)], cwd=ROOT, text=True,
                          capture_output=True, env={**os.environ, "PYTHON": sys.executable}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "gpu_summary.json").read_text())
    assert summary["dry_run"] and [s["step"] for s in summary["steps"]] == STEPS
    assert all(s["status"] == "passed" for s in summary["steps"]), summary
    tests = json.loads((tmp_path / "gpu_tests.json").read_text())
    assert tests["passed"] >= 4 and not tests["failed"]
    [skip] = json.loads((tmp_path / "gpu_bench_skip_opt1.3b.json").read_text())
    assert [r["variant"] for r in skip["rows"]][2:] == [f"skip top {t}x" for t in (1.5, 2.0, 3.0, 5.0)]
    [kv] = json.loads((tmp_path / "gpu_bench_kv_llama7b.json").read_text())
    assert len(kv["rows"]) == len(KV_POLICIES) and kv["dtype"] == "torch.bfloat16"
    [offload] = json.loads((tmp_path / "gpu_bench_offload_opt1.3b.json").read_text())
    assert "disk" in offload["placement"]["device_map"].values()
    assert all(r["transfer_ratio"] > 1 for r in offload["rows"] if r["variant"].startswith("skip"))
    assert json.loads((tmp_path / "gpu_app.json").read_text())["status"].startswith("**Done**")
    exact = json.loads((tmp_path / "gpu_bench_exact_specbench.json").read_text())
    assert exact["part"] == "test" and exact["overall"]["contenders"]["full"]["identical"] == exact["overall"]["prompts"]


def test_the_gpu_run_asks_for_what_the_issue_asks():
    gpu_run = SCRIPT.read_text().split("\nelse\n", 1)[1]
    for needed in ["SKIPKEY_TEST_DEVICE=cuda", "tests/test_engine.py", "tests/test_embedded.py",
                   "tests/test_offload.py", "--model random:opt-1.3b --device cuda",
                   "--model random:opt-6.7b --device cuda", "--batch 1 8", "--compare-targets 1.5 2 3 5",
                   "--model random:llama-7b --device cuda --dtype bfloat16 --prompt-tokens 4096",
                   "--max-new-tokens 256", "--compare-kv $kv_policies", "--kv-budget 0.5",
                   "experiments.gpu_check app --device cuda", "--device-map auto --max-memory 0:1GiB",
                   "--prompts \"${SPEC_BENCH:-../shared/data/spec_bench/question.jsonl}\" --part test"]:
        assert needed in gpu_run, needed
    assert "SKIPKEY_GPU_BUDGET_S:-450" in SCRIPT.read_text()  # under 8 minutes, with room to start


def test_the_big_shapes_are_the_published_ones():
    """Never built here (tens of GB): their configs are checked instead."""
    family, opt = RANDOM_MODELS["opt-6.7b"]
    assert family == "opt" and (opt["hidden_size"], opt["ffn_dim"], opt["num_hidden_layers"],
                                opt["num_attention_heads"], opt["vocab_size"]) == (4096, 16384, 32, 32, 50272)
    family, llama = RANDOM_MODELS["llama-7b"]
    assert family == "llama" and (llama["hidden_size"], llama["intermediate_size"], llama["num_hidden_layers"],
                                  llama["num_attention_heads"], llama["vocab_size"]) == (4096, 11008, 32, 32, 32000)
    assert llama["max_position_embeddings"] >= 4096 + 256
