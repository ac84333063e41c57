"""Fine-tuning on a prompts file people wrote: refused before the model loads when the file is bad or meets
Spec-Bench's test half (naming the file, the line and the question), and identified by its SHA-256 in the
training data's cache, the checkpoint a run resumes and the adapter's metadata."""

import dataclasses
import hashlib
import json
import shlex
from collections import Counter
from pathlib import Path

import pytest

import skipkey.training.data as data_module
import skipkey.training.finetune as finetune
import skipkey.training.prompt_source as prompt_source
from skipkey.cli import build_parser, main as cli_main
from skipkey.core.tiny import tiny_model
from skipkey.errors import InputError
from skipkey.quality.prompt_file import read_prompts
from skipkey.training.prompt_source import check_prompt_file, file_prompts
from skipkey.training.recipe import FinetuneConfig

DATA = Path(__file__).parent / "data"
QUESTIONS = DATA / "questions.jsonl"  # Spec-Bench's form, made here: the test half is questions 2, 4 and 6
CLEAN = DATA / "training_prompts.jsonl"  # a training prompts file in the builder's form, made here
SMALL = dict(steps=2, batch_size=4, lr=1e-2, warmup_steps=1, gen_len=6, sequences=8, targets=(2.0,),
             checkpoint_every=1)


def quiet(msg):
    pass


def planted(tmp_path: Path, text: str) -> Path:
    """The clean file with ``text`` as its line 4 (question 99)."""
    lines = CLEAN.read_text().splitlines()
    lines.insert(3, json.dumps({"question_id": 99, "category": "qa", "turns": [text]}))
    path = tmp_path / "planted.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: every refusal here must come before it."""
    def loads(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")
    monkeypatch.setattr(finetune, "load_model", loads)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SKIPKEY_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_a_clean_file_passes_and_the_check_says_against_what():
    cfg = FinetuneConfig(prompts=str(CLEAN), spec_bench=str(QUESTIONS), **SMALL)
    check = check_prompt_file(cfg, log=quiet)
    assert check["run"] and check["against"] == str(QUESTIONS) and check["test_prompts"] == 3
    assert check["sha256"] == read_prompts(QUESTIONS).sha256 and check["validation_prompts_met"] == 0
    assert cfg.prompts_sha256 == hashlib.sha256(CLEAN.read_bytes()).hexdigest()


@pytest.mark.parametrize("text, found", [
    # 12 words of question 6 inside a longer text, in other case and punctuation
    ("Local news: the SMALL library in the valley now lends tools, as well as books; people like it.",
     'shares the 12 words "small library in the valley now lends tools as well as books" with question 6'),
    ("what is 17 TIMES 23", 'holds all of question 4'),  # a short question, equal once normalised
    ("Quick quiz before lunch. What is 17 times 23? Answer fast.", 'holds all of question 4'),  # or whole inside
    ("Residents can borrow a drill, a ladder!", 'is all inside question 6'),  # a short piece of a test prompt
])
def test_a_file_meeting_the_test_half_is_refused_naming_file_line_and_question(tmp_path, no_model, text, found):
    path = planted(tmp_path, text)
    cfg = FinetuneConfig(model="tiny-gemma3", out=str(tmp_path / "lora"), prompts=str(path),
                         spec_bench=str(QUESTIONS), **SMALL)
    with pytest.raises(InputError) as refused:
        finetune.train(cfg, work_dir=tmp_path / "w", log=quiet)
    assert str(refused.value).startswith(f"{path}:4: prompt 99 {found}")
    assert "Spec-Bench's test half" in str(refused.value)


def test_the_validation_half_is_noted_not_refused(tmp_path):
    path = planted(tmp_path, "Write a short note to a neighbour asking them to water the plants while you are away.")
    said = []
    check = check_prompt_file(FinetuneConfig(prompts=str(path), spec_bench=str(QUESTIONS), **SMALL), log=said.append)
    assert check["validation_prompts_met"] == 1 and "1 prompts of" in said[0] and "validation half" in said[0]


def test_without_spec_bench_the_check_cannot_run_and_only_an_explicit_flag_trains_unchecked(tmp_path, monkeypatch,
                                                                                         no_model):
    monkeypatch.setattr(prompt_source, "SPEC_BENCH_BESIDE_REPO", tmp_path / "absent" / "question.jsonl")
    for spec_bench in (None, str(tmp_path / "elsewhere.jsonl")):
        cfg = FinetuneConfig(model="tiny-gemma3", out=str(tmp_path / "lora"), prompts=str(CLEAN),
                             spec_bench=spec_bench, **SMALL)
        with pytest.raises(InputError, match=f"the overlap check of {CLEAN} could not run: no Spec-Bench questions "
                                             "at .*--no-overlap-check"):
            finetune.train(cfg, work_dir=tmp_path / "w", log=quiet)
    unchecked = FinetuneConfig(prompts=str(CLEAN), overlap_check=False, **SMALL)
    assert check_prompt_file(unchecked) == {"run": False, "why": "--no-overlap-check: trained on the file without "
                                                                 "checking it"}
    assert "--no-overlap-check" in unchecked.command() and "--spec-bench" not in unchecked.command()


@pytest.mark.parametrize("content, fault", [
    (None, "there is no file"),
    (b"", "holds no prompt"),
    (b'{"question_id": 1, "turns": ["Caf\xe9"]}\n', ":1: not UTF-8"),
    (b'{"question_id": 1, "turns": ["fine"]}\n{"question_id": 2, "turns": [\n', ":2: not valid JSON"),
])
def test_bad_files_are_refused_by_the_cli_before_the_model_loads(tmp_path, capsys, no_model, content, fault):
    path = tmp_path / "prompts.jsonl"
    if content is not None:
        path.write_bytes(content)
    code = cli_main(["finetune", "--model", str(tmp_path / "no-such-model"), "--prompts", str(path), "--sequences",
                     "1", "--batch-size", "1", "--spec-bench", str(QUESTIONS), "--work-dir", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert code == 2 and str(path) in err and fault in err


@pytest.mark.parametrize("kwargs, message", [
    (dict(spec_bench=str(QUESTIONS)), "--spec-bench is for a prompts file"),
    (dict(overlap_check=False), "--no-overlap-check is for a prompts file"),
    (dict(prompts_sha256="0" * 64), "--prompts-sha256 is for a prompts file"),
    (dict(prompts=str(CLEAN), spec_bench=str(QUESTIONS), overlap_check=False), "exclude each other"),
    (dict(prompts=str(CLEAN), sequences=19), "--sequences 19 asks for more prompts than .* holds \\(18\\)"),
    (dict(prompts=str(CLEAN), prompts_sha256="0" * 64), "it is another file than the one asked for"),
])
def test_settings_that_do_not_fit_a_prompts_file_are_refused(kwargs, message):
    with pytest.raises(InputError, match=message):
        FinetuneConfig(**{"sequences": 8, **kwargs})


def test_any_count_is_a_seeded_mix_of_the_categories_in_turn():
    file = read_prompts(CLEAN)
    ten = file_prompts(file, 10, seed=3)
    assert Counter(r.category for r in ten) == {c: 2 for c in file.categories()}
    assert [r.category for r in ten[:5]] == list(file.categories())
    assert ten == file_prompts(file, 10, seed=3) != file_prompts(file, 10, seed=4)
    assert sorted(r.line for r in file_prompts(file, 18, seed=3)) == list(range(1, 19))  # every prompt, once


def test_an_adapter_records_the_files_identity_and_a_changed_file_cannot_resume(cache, monkeypatch):
    path, original = cache / "prompts.jsonl", CLEAN.read_bytes()
    path.write_bytes(original)
    sha = hashlib.sha256(original).hexdigest()
    cfg = FinetuneConfig(model="tiny-gemma3", out=str(cache / "lora"), prompts=str(path), spec_bench=str(QUESTIONS),
                         **SMALL)

    def killed_at_step_2(msg):
        if msg.startswith("step 2/"):
            raise KeyboardInterrupt  # after step 1's checkpoint

    with pytest.raises(KeyboardInterrupt):
        finetune.train(cfg, tiny_model("gemma3"), work_dir=cache / "w", log=killed_at_step_2)

    path.write_bytes(original + b'{"question_id": 19, "category": "qa", "turns": ["Where does the tram stop?"]}\n')
    with pytest.raises(InputError, match="it is another file than the one asked for"):
        dataclasses.replace(cfg)  # as the recorded command, which names the old file's SHA-256
    changed = FinetuneConfig(**{**dataclasses.asdict(cfg), "prompts_sha256": None})
    assert data_module._data_path(tiny_model("gemma3"), changed) != data_module._data_path(tiny_model("gemma3"), cfg)
    with monkeypatch.context() as patch:
        patch.setattr(finetune, "load_model", None)  # the refusal comes before the model loads
        with pytest.raises(InputError, match=f"prompts_sha256: {sha} there, {changed.prompts_sha256} now"):
            finetune.train(changed, work_dir=cache / "w", resume=True, log=quiet)

    moved = cache / "moved.jsonl"  # the same contents anywhere are the same file: its data and its checkpoint
    moved.write_bytes(original)
    said = []
    meta = finetune.train(dataclasses.replace(cfg, prompts=str(moved)), tiny_model("gemma3"), work_dir=cache / "w",
                          resume=True, log=said.append)
    assert said[0].startswith("data: cached") and "resumed from step 1" in said[1]
    prompts = meta["data"]["continuations"]["prompts"]
    assert prompts["file"] == str(moved) and prompts["sha256"] == sha and prompts["used"] == 8
    assert prompts["sources"] == {"written for SkipKey's tests": 8}
    assert prompts["licenses"] == {"Apache-2.0 (this repository)": 8}
    assert prompts["overlap_check"]["run"] and prompts["overlap_check"]["against"] == str(QUESTIONS)
    args = build_parser().parse_args(shlex.split(meta["command"])[3:])
    assert args.prompts == str(moved) and args.prompts_sha256 == sha and args.spec_bench == str(QUESTIONS)
