"""KV policies on long inputs from a prompts file: every policy at every budget, one prompt pass per prompt, ROUGE-L
against the full model and the references, the KV held, EOS, resuming, refusals, and the CLI's results file."""

import hashlib
import json
from pathlib import Path

import pytest

from experiments.kv_long_input_table import table
from test_cli import model_dir  # noqa: F401  (the CLI tests' tiny model directory)
from skipkey.cli import main
from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.core.tiny import tiny_model
from skipkey.core.trace import Trace
from skipkey.errors import InputError
from skipkey.quality import long_input
from skipkey.quality.evaluate import kv_configs
from skipkey.quality.long_input import (FULL, long_input_prompts, long_input_rows, long_input_table,
                                        run_long_input)
from skipkey.quality.metrics import rouge_l
from skipkey.quality.prompt_file import check_lengths, read_prompts

LONG_INPUT = Path(__file__).parent / "data" / "long_input.jsonl"  # made here, in Spec-Bench's form
POLICIES = ["keyformer", "keyformer:observe=8,pool=7", "h2o", "tova", "snapkv"]
BUDGETS = [0.5, 0.25]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_gemma(tiny_models):
    return tiny_models("gemma3")


def run(loaded, configs, used, **kwargs):
    prompts = read_prompts(LONG_INPUT)
    ids = check_lengths(prompts, used, loaded.tokenizer, loaded.context_length, NEW_TOKENS)
    return run_long_input(loaded, configs, used, ids, GenerationSettings(max_new_tokens=NEW_TOKENS),
                          lambda msg: None, **kwargs)


@pytest.fixture(scope="module")
def test_half(tiny_gemma):
    """Every policy at every budget on the fixture's test half: summarization 2 (a reference) and 8 (none),
    rag 4 (two answer spans) and 10."""
    configs = kv_configs(tiny_gemma.num_layers, POLICIES, BUDGETS, 0, NEW_TOKENS, combined=False)
    used = long_input_prompts(read_prompts(LONG_INPUT), "test")
    return configs, used, run(tiny_gemma, configs, used)


def test_the_part_takes_the_files_summarization_and_rag_prompts_of_its_half():
    prompts = read_prompts(LONG_INPUT)
    assert [r.id for r in long_input_prompts(prompts, "test")] == ["2", "4", "8", "10"]  # not writing's 6
    assert [r.id for r in long_input_prompts(prompts, "validation", per_category=1)] == ["1", "3"]
    assert [r.id for r in long_input_prompts(prompts, "all", categories=["writing"])] == ["5", "6"]


def test_every_policy_runs_at_every_budget_and_the_full_model_scores_one_against_itself(test_half):
    configs, used, records = test_half
    labels = {c.label for c in configs}
    assert len(labels) == 1 + len(POLICIES) * len(BUDGETS)
    assert [r["id"] for r in records] == [p.id for p in used] and all(set(r["runs"]) == labels for r in records)
    for record in records:
        for run_ in record["runs"].values():
            assert 1 <= run_["new_tokens"] <= NEW_TOKENS and run_["eos"] == (run_["new_tokens"] < NEW_TOKENS)
            assert run_["rouge_l_full"] == rouge_l(record["runs"][FULL]["output"], run_["output"])
        assert record["runs"][FULL]["rouge_l_full"] == 1.0
    rows = long_input_rows(records, configs)
    assert {(r["category"], r["label"]) for r in rows} == {(c, label) for c in ("summarization", "rag")
                                                          for label in labels}
    full = [r for r in rows if r["label"] == FULL]
    assert all(r["rouge_l_vs_full"] == 1.0 and r["rouge_l_vs_full_ci95"] == (1.0, 1.0) for r in full)
    assert all(r["prompts"] == 2 for r in rows)
    # The policies really change the outputs here, so the scores mean something.
    assert any(r["rouge_l_vs_full"] < 1.0 for r in rows)


def test_kv_held_at_25_percent_is_below_50_and_below_the_full_models(test_half):
    configs, _, records = test_half
    for record in records:
        for policy in POLICIES:
            quarter, half = (record["runs"][f"{policy} {b:.0%}"]["kv_bytes_peak"] for b in (0.25, 0.5))
            assert quarter < half < record["runs"][FULL]["kv_bytes_peak"]
    rows = {(r["category"], r["label"]): r for r in long_input_rows(records, configs)}
    for (category, label), row in rows.items():
        full = rows[(category, FULL)]
        assert row["kv_share_of_full"] == pytest.approx(row["kv_bytes_peak_mean"] / full["kv_bytes_peak_mean"])
        if row["budget"] == 0.25:
            assert row["kv_share_of_full"] < rows[(category, label.replace("25%", "50%"))]["kv_share_of_full"] < 1


def test_references_are_used_where_present_and_skipped_where_absent(test_half):
    configs, used, records = test_half
    by_id = {r["id"]: r for r in records}
    references = {p.id: p.reference for p in used}
    assert references["4"] == "the Haddon family dairy; the monks of Saint Ive's priory"  # both answer spans
    assert references["8"] is None and not by_id["8"]["has_reference"]
    assert all("rouge_l_reference" not in run_ for run_ in by_id["8"]["runs"].values())
    for qid in ("2", "4", "10"):
        for run_ in by_id[qid]["runs"].values():
            assert run_["rouge_l_reference"] == rouge_l(references[qid], run_["output"])
    rows = {(r["category"], r["label"]): r for r in long_input_rows(records, configs)}
    summary, rag = rows[("summarization", "h2o 25%")], rows[("rag", "h2o 25%")]
    assert summary["references"] == 1 and rag["references"] == 2
    assert summary["rouge_l_vs_reference"] == by_id["2"]["runs"]["h2o 25%"]["rouge_l_reference"]
    assert summary["full_rouge_l_vs_reference"] == by_id["2"]["runs"][FULL]["rouge_l_reference"]
    assert rows[("rag", FULL)]["rouge_l_vs_reference"] == rag["full_rouge_l_vs_reference"]


def test_the_table_has_each_categorys_full_model_and_a_row_per_policy_and_budget(test_half):
    configs, _, records = test_half
    text = long_input_table(long_input_rows(records, configs))
    assert text.count("**summarization**, 2 prompts (1 with a reference)") == 1
    assert text.count("**rag**, 2 prompts (2 with a reference)") == 1
    for policy in POLICIES:
        assert text.count(f"| {policy} | 50% |") == text.count(f"| {policy} | 25% |") == 2
    assert text.index("| h2o | 50% |") < text.index("| h2o | 25% |")


def test_eos_ends_a_generation_as_it_would_for_a_user_and_is_recorded():
    loaded = tiny_model("gemma3")  # its own copy: its EOS id is changed below
    loaded.model.generation_config.eos_token_id = None
    used = long_input_prompts(read_prompts(LONG_INPUT), "test", per_category=1)
    configs = kv_configs(loaded.num_layers, ["h2o"], [0.5], 0, NEW_TOKENS, combined=False)
    endless = run(loaded, configs, used)
    assert all(not run_["eos"] and run_["new_tokens"] == NEW_TOKENS for r in endless for run_ in r["runs"].values())
    ids = check_lengths(read_prompts(LONG_INPUT), used[:1], loaded.tokenizer, loaded.context_length, NEW_TOKENS)
    tokens = Trace.collect(Engine(loaded), ids, GenerationSettings(max_new_tokens=NEW_TOKENS)).tokens()
    stop = next(i for i, token in enumerate(tokens) if i and token not in tokens[:i])
    loaded.model.generation_config.eos_token_id = tokens[stop]  # the full model's output ends there now
    [ended] = run(loaded, configs, used[:1])
    assert ended["runs"][FULL]["eos"] and ended["runs"][FULL]["new_tokens"] == stop + 1


def test_a_resumed_run_does_not_redo_finished_prompts(tiny_gemma, test_half, monkeypatch):
    configs, used, records = test_half
    ran, passes, real = [], [], long_input.decode
    monkeypatch.setattr(long_input, "decode", lambda loaded, config, *a: ran.append(config.label) or real(
        loaded, config, *a))
    real_pass = Engine.prompt_pass
    monkeypatch.setattr(Engine, "prompt_pass", lambda self, p: passes.append(1) or real_pass(self, p))
    saved = []
    again = run(tiny_gemma, configs, used, done=json.loads(json.dumps(records)), save=lambda r: saved.append(len(r)))
    assert ran == [] and passes == [] and saved == [1, 2, 3, 4]
    assert [r["runs"] for r in again] == json.loads(json.dumps([r["runs"] for r in records]))
    more = configs + kv_configs(tiny_gemma.num_layers, ["streaming"], [0.5], 0, NEW_TOKENS, combined=False)[1:]
    run(tiny_gemma, more, used[:2], done=records)
    assert ran == ["streaming 50%"] * 2 and len(passes) == 2  # the added config alone, from one prompt pass each
    ran.clear()
    changed = [records[0] | {"prompt_sha1": "another prompt"}]
    run(tiny_gemma, configs[:2], used[:1], done=changed)
    assert ran == [c.label for c in configs[:2]]  # a prompt whose text changed runs again in full


def test_a_file_without_summarization_or_rag_prompts_in_the_part_is_refused(tmp_path):
    only_writing = tmp_path / "writing.jsonl"
    only_writing.write_text('{"question_id": 1, "category": "writing", "turns": ["Write a poem."]}\n')
    with pytest.raises(InputError, match=r"writing.jsonl has no summarization or rag prompt in the all part "
                                         r"\(its categories: writing\); choose others with --categories"):
        long_input_prompts(read_prompts(only_writing), "all")
    one_half = tmp_path / "odd.jsonl"
    one_half.write_text('{"question_id": 1, "category": "summarization", "turns": ["Summarize: a text."]}\n'
                        '{"question_id": 2, "category": "writing", "turns": ["Write a poem."]}\n')
    assert [r.id for r in long_input_prompts(read_prompts(one_half), "validation")] == ["1"]
    with pytest.raises(InputError, match="no summarization or rag prompt in the test part"):
        long_input_prompts(read_prompts(one_half), "test")


def test_the_cli_records_the_files_sha256_the_ids_and_provenance_and_resumes(capsys, model_dir, tmp_path):
    out = tmp_path / "long_input.json"
    argv = ["eval", "--model", model_dir, "--suite", "kv", "--kv-parts", "long-input", "--prompts-file",
            str(LONG_INPUT), "--part", "test", "--max-new-tokens", "4", "--kv-policies", "keyformer", "--budgets",
            "0.5", "--no-combined", "--output", str(out)]
    assert main([*argv, "--per-category", "1"]) == 0
    first = json.loads(out.read_text())
    assert first["prompts_file"] == {"path": str(LONG_INPUT), "sha256": hashlib.sha256(LONG_INPUT.read_bytes())
                                     .hexdigest(), "ids": ["2", "4"], "parts": ["test"]}
    assert first["dtype"] == "torch.float32" and first["complete"] and first["date"] and first["machine"]
    assert first["command"] == "python -m skipkey " + " ".join([*argv, "--per-category", "1"])
    assert first["kv_long_input_settings"]["prompts_sha256"] == first["prompts_file"]["sha256"]
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    printed, log = capsys.readouterr()
    second = json.loads(out.read_text())
    assert second["prompts_file"]["ids"] == ["2", "4", "8", "10"] and second["resumed"] == [first["command"]]
    done = {r["id"]: r for r in second["kv_long_input_prompts"]}
    assert all(done[r["id"]] == r for r in first["kv_long_input_prompts"])  # kept as they were, timings too
    assert log.count("resumed") == 2 and "**summarization**, 2 prompts (1 with a reference)" in printed
    assert first["prompts_file"]["sha256"] in table(second) and "| keyformer | 50% |" in table(second)
    assert main([*argv, "--resume", "--seed", "3"]) == 2
    assert "another seed (seed=0); use another --output" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--kv-parts", "long-input"], "give --prompts-file FILE"),
    (["--kv-parts", "agreement", "--prompts-file", str(LONG_INPUT)], "--prompts-file is read by the kv suite's "
                                                                     "long-input part"),
    (["--kv-parts", "long-input", "--prompts-file", str(LONG_INPUT), "--categories", "poetry"], "no category 'poetry'"),
])
def test_the_cli_refuses_a_long_input_run_it_cannot_do_before_loading_a_model(capsys, argv, message):
    code = main(["eval", "--model", "no-such-model-dir", "--suite", "kv", *argv])
    assert code == 2 and message in capsys.readouterr().err
