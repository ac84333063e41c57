"""``python -m skipkey``: the commands a user types, end to end on a tiny local model."""

import json
import os
import subprocess
import sys

import pytest

from skipkey.cli import main
from skipkey.errors import InputError
from skipkey.core.tiny import tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3")
    lm = tiny_model("gemma3")
    lm.model.save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    return str(path)


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_has_tokens_text_timings_layers_and_kept(capsys, model_dir):
    code, out, _ = run_cli(capsys, "generate", "--model", model_dir, "--prompt", "Once upon a time there was",
                           "--max-new-tokens", "12", "--device", "cpu", "--dtype", "float32", "--json",
                           "--skip-target", "2.0", "--kv-policy", "keyformer", "--kv-budget", "0.5")
    assert code == 0
    result = json.loads(out)
    assert len(result["token_ids"]) == len(result["layers_per_token"]) == len(result["kept_positions"]) >= 1
    assert result["layers_per_token"][0] == list(range(6))
    assert all(len(b) <= len(a) for a, b in zip(result["layers_per_token"], result["layers_per_token"][1:]))
    assert result["timings"]["ttft_s"] > 0 and "text" in result
    budget = max(1, round(0.5 * result["prompt_tokens"]))
    first = result["kept_positions"][0]
    assert all(layer is None or all(len(head) <= budget for head in layer) for layer in first)


def test_generate_runs_b_max_for_the_held_steps(capsys, model_dir):
    code, out, _ = run_cli(capsys, "generate", "--model", model_dir, "--prompt", "Once upon a time there was",
                           "--max-new-tokens", "10", "--json", "--skip-min", "2", "--skip-horizon", "3",
                           "--skip-hold", "4")
    layers = [len(step) for step in json.loads(out)["layers_per_token"]]
    # The prompt pass, 4 held steps, then the decay 6 -> 2 over 3 steps (which starts at b_max).
    assert code == 0 and layers == [6] + [6] * 4 + [6, 5, 3, 2, 2]


def test_generate_streams_text(capsys, model_dir):
    code, out, err = run_cli(capsys, "generate", "--model", model_dir, "--prompt", "Hello", "--max-new-tokens", "5",
                             "--device", "cpu")
    assert code == 0 and "tokens, TTFT" in err


@pytest.mark.parametrize("argv, message", [
    (["--prompt", ""], "empty"),
    (["--prompt", "hi", "--skip-target", "0.5"], "--skip-target must be at least 1"),
    (["--prompt", "hi", "--skip-target", "50"], "target speedup must be from 1 to"),
    (["--prompt", "hi", "--skip-target", "2", "--skip-hold", "3"], "hold is set by the target's measured-best shape"),
    (["--prompt", "hi", "--skip-min", "2", "--skip-horizon", "4", "--skip-hold", "-1"], "hold must be an integer >= 0"),
    (["--prompt", "hi", "--kv-policy", "keyformer", "--kv-budget", "1.5"], "KV budget 1.5 is invalid"),
    (["--prompt", "hi", "--kv-policy", "keyformer", "--kv-budget", "0"], "KV budget 0"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens must be in 1.."),
    (["--prompt", "hi", "--device", "tpu"], "Unknown device"),
    (["--prompt", "x" * 1100], "exceeds the model's context"),
    (["--prompt", "hi", "--max-memory", "cpu:1GiB"], "only used with a device map"),
    (["--prompt", "hi", "--device", "cpu", "--device-map", "auto"], "or a device map, not both"),
    (["--prompt", "hi", "--device-map", "auto", "--max-memory", "cpu"], "Cannot read max memory"),
    (["--prompt", "hi", "--device-map", "auto", "--offload-dir", "/proc/skipkey-offload"], "cannot be written"),
    (["--prompt", "hi", "--device-map", "auto", "--adapter", "assets/skipdecode-lora"], "without a device map"),
])
def test_bad_input_exits_2_with_one_line(capsys, model_dir, argv, message):
    code, _, err = run_cli(capsys, "generate", "--model", model_dir, *argv)
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("error: ") and message in last


def test_unknown_model_name(capsys):
    code, _, err = run_cli(capsys, "generate", "--model", "no/such-model-anywhere", "--prompt", "hi")
    assert code == 2 and "unreachable" in err


def test_bench_reports_ratios_against_full_and_generate(capsys, model_dir, tmp_path):
    out_file = tmp_path / "bench.json"
    code, out, _ = run_cli(capsys, "bench", "--model", model_dir, "--device", "cpu", "--max-new-tokens", "6",
                           "--prompt-tokens", "24", "--batch", "1", "2", "--repeats", "1", "--warmup", "0",
                           "--skip-target", "2.0", "--output", str(out_file))
    assert code == 0
    results = json.loads(out_file.read_text())
    assert [r["batch"] for r in results] == [1, 2]
    for result in results:
        names = [row["variant"] for row in result["rows"]]
        assert names[:2] == ["generate", "full"] and len(names) == 3
        full = result["rows"][1]
        assert full["speedup_vs_full"] == pytest.approx(1.0)
        assert result["rows"][2]["nominal_speedup"] > 1.2
        assert all(row["tokens_per_s"] > 0 for row in result["rows"])
    assert "vs full" in out


def test_a_compared_kv_spec_may_carry_its_own_budget(capsys, model_dir, tmp_path):
    """``window:budget=1.0`` beside ``window`` at ``--kv-budget``: the same policy, kernel and all, keeping the
    whole prompt, so the row shows what the attention path alone buys against the full model."""
    out_file = tmp_path / "bench.json"
    code, _, _ = run_cli(capsys, "bench", "--model", model_dir, "--device", "cpu", "--max-new-tokens", "4",
                         "--prompt-tokens", "40", "--repeats", "1", "--warmup", "0", "--no-generate",
                         "--compare-kv", "window:budget=1.0", "window", "--kv-budget", "0.5",
                         "--output", str(out_file))
    assert code == 0
    rows = {row["variant"]: row for row in json.loads(out_file.read_text())[0]["rows"]}
    whole = next(row for name, row in rows.items() if name.startswith("window (100% of prompt"))
    half = next(row for name, row in rows.items() if name.startswith("window (50% of prompt"))
    assert whole["kv_bytes"] > half["kv_bytes"] > 0
    code, _, err = run_cli(capsys, "bench", "--model", model_dir, "--compare-kv", "window:budget=0", "--no-generate")
    assert code == 2 and "KV budget 0 is invalid" in err  # refused before the model loads


def test_generate_and_bench_under_disk_offload(capsys, model_dir, tmp_path):
    """--device-map auto with a --max-memory smaller than the model: the same tokens, and the weights moved."""
    offload = ["--device-map", "auto", "--max-memory", "cpu:600KB", "--offload-dir", str(tmp_path / "offload")]
    generate = ["generate", "--model", model_dir, "--prompt", "Once upon a time there was", "--max-new-tokens",
                "10", "--dtype", "float32", "--json", "--skip-target", "2.0"]
    code, out, _ = run_cli(capsys, *generate, "--device", "cpu")
    whole = json.loads(out)
    code, out, _ = run_cli(capsys, *generate, *offload)
    assert code == 0
    placed = json.loads(out)
    assert placed["token_ids"] == whole["token_ids"] and whole["weight_transfer"] is None
    assert "disk" in placed["placement"]["device_map"].values()
    assert placed["weight_transfer"]["transfer_ratio"] > 1.2

    out_file = tmp_path / "bench.json"
    code, out, _ = run_cli(capsys, "bench", "--model", model_dir, "--dtype", "float32", "--max-new-tokens", "6",
                           "--prompt-tokens", "24", "--repeats", "1", "--warmup", "0", "--compare-targets", "2",
                           *offload, "--output", str(out_file))
    assert code == 0 and "transfer" in out
    [result] = json.loads(out_file.read_text())
    rows = {row["variant"]: row for row in result["rows"]}
    assert rows["generate"]["transfer_ratio"] is None and rows["full"]["transfer_ratio"] == pytest.approx(1.0)
    assert rows["skip top 2.0x"]["transfer_ratio"] > 1.2 and rows["full"]["weight_bytes_per_step"] > 0
    assert result["placement"]["request"].startswith("device map auto")
    code, _, err = run_cli(capsys, "bench", "--model", model_dir, *offload, "--adapter", "assets/skipdecode-lora")
    assert code == 2 and "load it without a device map" in err


def test_kv_eval_without_retrieval_reports_agreement_and_long_text_scores(capsys, model_dir, tmp_path):
    out_file = tmp_path / "eval.json"
    argv = ["eval", "--model", model_dir, "--suite", "kv", "--retrieval-lengths", "--prompts", "2",
            "--max-new-tokens", "6", "--budgets", "0.5", "--kv-policies", "h2o", "--kv-prompt-tokens", "48",
            "--ppl-prompt-tokens", "64",
            "--ppl-tokens", "16", "--output", str(out_file)]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    result = json.loads(out_file.read_text())
    assert "kv_retrieval" not in result and result["command"] == "python -m skipkey " + " ".join(argv)
    assert result["kv_prompt_tokens"] == 48
    rows = {row["label"]: row for row in result["kv_agreement"]}
    assert set(rows) == {"full", "h2o 50%", "keyformer 50% + skip 2x"}
    # The full model's own greedy continuations: every position is its argmax.
    assert rows["full"]["next_token_accuracy"] == 1.0 and rows["full"]["token_agreement"] == 1.0
    assert all(0.0 <= row["next_token_accuracy"] <= 1.0 for row in rows.values())
    long_text = {row["label"]: row for row in result["kv_long_text"]}
    assert long_text["full"]["prompt_tokens"] == 64 and long_text["full"]["continuation_tokens"] == 16
    assert "next_token_accuracy" in out
    code, _, err = run_cli(capsys, *argv[:-2], "--figure", str(tmp_path / "f.html"))
    assert code == 2 and "--figure draws the KV retrieval accuracy" in err


def test_module_entry_point(model_dir):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "skipkey", "generate", "--model", model_dir, "--prompt", "Hi",
                           "--max-new-tokens", "3", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) >= 1


def test_document_prompts_are_distinct_long_and_apart_from_the_perplexity_text():
    from skipkey.quality.prompts import document_prompts, long_text_ids

    tokenizer = tiny_model("gemma3").tokenizer
    prompts = document_prompts(tokenizer, 6, 200)
    assert len(set(prompts)) == 6
    assert all(190 <= len(tokenizer(p, add_special_tokens=False)["input_ids"]) <= 210 for p in prompts)
    passage = tokenizer.decode(long_text_ids(tokenizer, 400))
    assert not any(p[:80] in passage for p in prompts)
    with pytest.raises(InputError, match="at most"):
        document_prompts(tokenizer, 500, 200)


def test_kv_eval_retrieval_takes_policy_specs_writes_rows_tasks_figure_and_resumes(capsys, model_dir, tmp_path):
    out_file, figure = tmp_path / "retrieval.json", tmp_path / "retrieval.html"
    argv = ["eval", "--model", model_dir, "--device", "cpu", "--dtype", "float32", "--suite", "kv",
            "--kv-parts", "retrieval", "--retrieval-lengths", "640", "--retrieval-tasks", "3",
            "--retrieval-seed", "7", "--kv-policies", "h2o", "keyformer:observe=16,pool=3", "--budgets", "0.5",
            "--no-combined", "--output", str(out_file), "--figure", str(figure)]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    result = json.loads(out_file.read_text())
    assert result["complete"] and "kv_agreement" not in result and "kv_long_text" not in result
    assert result["kv_retrieval_settings"]["retrieval_seed"] == 7 and result["machine"]
    assert result["kv_retrieval_settings"]["families"] == ["passkey", "kv", "name", "table"]
    rows = {row["label"]: row for row in result["kv_retrieval"]}
    assert set(rows) == {"full", "h2o 50%", "keyformer:observe=16,pool=3 50%"}
    row = rows["keyformer:observe=16,pool=3 50%"]
    assert row["options"] == {"observe": 16, "pool": 3} and row["policy"] == "keyformer" and row["length"] == 640
    assert {"families", "hits", "n", "accuracy", "ci_low", "ci_high", "relative_to_full"} <= set(row)
    assert row["n"] == 3 and set(row["families"]) == {"passkey", "kv", "name"}
    assert [t["index"] for t in result["kv_retrieval_tasks"]] == [0, 1, 2]
    assert "| keyformer:observe=16,pool=3 |" in out and "[640 3/3] name" in err
    assert figure.exists()

    code, _, err = run_cli(capsys, *argv, "--resume")
    assert code == 0 and "3 tasks done earlier" in err and err.count("(resumed)") == 3
    assert json.loads(out_file.read_text())["resumed"] == [result["command"]]
    code, _, err = run_cli(capsys, *[a if a != "7" else "8" for a in argv], "--resume")
    assert code == 2 and "another retrieval_seed" in err
    code, _, err = run_cli(capsys, *argv, "--retrieval-families", "passkey", "kv", "name", "--resume")
    assert code == 2 and "another families" in err


@pytest.mark.parametrize("argv, message", [
    (["--kv-policies", "keyformer:bogus=1"], "has no option 'bogus'"),
    (["--kv-policies", "nosuch"], "unknown KV policy"),
    (["--kv-policies", "h2o", "h2o:"], "twice"),
    (["--resume"], "--resume continues the results in --output"),
    (["--figure", "f.png", "--kv-parts", "agreement"], "--figure draws the KV retrieval accuracy"),
    (["--retrieval-families", "kv", "kv"], "retrieval families are one or more of passkey, kv, name, table"),
])
def test_kv_eval_refuses_bad_options_before_loading_a_model(capsys, argv, message):
    code, _, err = run_cli(capsys, "eval", "--model", "no/such-model-anywhere", "--suite", "kv", *argv)
    assert code == 2 and message in err.strip().splitlines()[-1]
