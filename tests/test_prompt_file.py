"""Prompts files: Spec-Bench / MT-bench JSONL and plain text, the halves by question id, and every refusal."""

import json
from pathlib import Path

import pytest

from skipkey.errors import InputError
from skipkey.quality.prompt_file import SPEC_BENCH_BESIDE_REPO, check_lengths, half_of, read_prompts

QUESTIONS = Path(__file__).parent / "data" / "questions.jsonl"  # made here, in Spec-Bench's form


def test_a_spec_bench_file_reads_ids_categories_first_turns_and_references():
    prompts = read_prompts(QUESTIONS)
    assert [r.id for r in prompts.records] == ["1", "2", "3", "4", "5", "6"]
    assert prompts.categories() == ("writing", "math", "summarization")
    first = prompts.records[0]
    assert first.text.startswith("Write a short note") and "rhyme" not in first.text  # the first turn only
    assert prompts.records[2].reference == "1 hour 25 minutes"  # MT-bench keeps references as lists
    assert prompts.records[4].reference.startswith("The council")
    assert len(prompts.sha256) == 64 and prompts.describe()["sha256"] == prompts.sha256



def test_a_references_answer_spans_are_joined_and_an_empty_reference_is_none(tmp_path):
    """Spec-Bench's rag rows hold Natural Questions' answer spans, a list inside the list of turns."""
    path = tmp_path / "refs.jsonl"
    rows = [{"question_id": 1, "turns": ["Who?"], "reference": [["James Ray", " George Harrison "]]},
            {"question_id": 2, "turns": ["When?"], "reference": [[], "", "1989"]},
            {"question_id": 3, "turns": ["Why?"], "reference": ["  "]},
            {"question_id": 4, "turns": ["How?"], "reference": ""},
            {"question_id": 5, "turns": ["What?"], "reference": [[1, 2]]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [r.reference for r in read_prompts(path).records] == ["James Ray; George Harrison", "1989", None, None,
                                                                  None]

def test_the_halves_split_every_category_by_question_id_and_never_overlap():
    prompts = read_prompts(QUESTIONS)
    validation, test = prompts.select("validation"), prompts.select("test")
    assert {r.id for r in validation} == {"1", "3", "5"} and {r.id for r in test} == {"2", "4", "6"}
    assert {r.category for r in validation} == {r.category for r in test} == set(prompts.categories())
    assert half_of("7") == "validation" and half_of("8") == "test"
    assert {half_of(f"q{i}") for i in range(40)} == {"validation", "test"}  # other ids: by hash, both halves
    assert [r.id for r in prompts.select("all", per_category=1)] == ["1", "3", "5"]
    assert [r.id for r in prompts.select("test", categories=("math",))] == ["4"]
    assert prompts.describe(test)["ids"] == ["2", "4", "6"] and prompts.describe(test)["parts"] == ["test"]


def test_spec_bench_itself_splits_in_half_per_category():
    spec_bench = SPEC_BENCH_BESIDE_REPO
    if not spec_bench.exists():
        pytest.skip("Spec-Bench is not beside this checkout")
    prompts = read_prompts(spec_bench)
    for category in prompts.categories():
        both = [r for r in prompts.records if r.category == category]
        assert sum(r.part == "test" for r in both) * 2 == len(both)


def test_lines_end_at_newlines_only(tmp_path):
    """A JSON string may hold U+2028 (GSM8K's questions do), which ``str.splitlines`` would split at."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"question_id": 1, "turns": ["Balls.\u2028How many?"]}\r\n{"question_id": 2, "turns": ["b"]}\n',
                    encoding="utf-8")
    prompts = read_prompts(path)
    assert [r.text for r in prompts.records] == ["Balls.\u2028How many?", "b"] and prompts.records[1].line == 2


def test_a_plain_text_file_is_a_prompt_per_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("The history of Rome\n\nDear team,\\nThe meeting moved to\n")
    prompts = read_prompts(path)
    assert [r.text for r in prompts.records] == ["The history of Rome", "Dear team,\nThe meeting moved to"]
    assert [r.line for r in prompts.records] == [1, 3] and prompts.categories() == ("text",)


@pytest.mark.parametrize("content, message", [
    (b'{"question_id": 1, "turns": ["hi"]}\n{"question_id": 2, "turns": ["a"\n', ":2: not valid JSON"),
    (b'{"question_id": 1, "turns": []}\n', ":1: no prompt"),
    (b'{"question_id": 1, "turns": ["   "]}\n', ":1: no prompt"),
    (b'[1, 2]\n', ":1: each line must be a JSON object"),
    (b'{"question_id": 1, "turns": ["a"]}\n{"question_id": 1, "turns": ["b"]}\n', "question id 1 appears more"),
    (b'\n\n', "holds no prompt"),
    (b'{"turns": ["caf\xe9"]}\n', ":1: not UTF-8"),
])
def test_a_bad_file_is_refused_naming_the_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(InputError, match=message) as caught:
        read_prompts(path)
    assert str(path) in str(caught.value)


def test_a_missing_file_or_a_directory_is_refused(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        read_prompts(tmp_path / "nowhere.jsonl")
    with pytest.raises(InputError, match="is a directory"):
        read_prompts(tmp_path)


def test_a_part_with_no_prompt_or_an_unknown_category_is_refused(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Who?"]}) + "\n")
    prompts = read_prompts(path)
    with pytest.raises(InputError, match="no prompt in the test part"):
        prompts.select("test")
    with pytest.raises(InputError, match="no category 'math'; its categories: qa"):
        prompts.select("all", categories=("math",))
    with pytest.raises(InputError, match="one of validation, test, all"):
        prompts.select("train")


def test_a_prompt_longer_than_the_context_is_refused_with_its_line(tiny_models):
    lm = tiny_models("llama")
    prompts = read_prompts(QUESTIONS)
    ids = check_lengths(prompts, prompts.records, lm.tokenizer, 4096, 64)
    assert len(ids) == 6 and all(ids)
    longest = max(len(i) for i in ids)
    with pytest.raises(InputError, match=r"questions\.jsonl:5 \(question 5\): .* exceeds the model's context"):
        check_lengths(prompts, prompts.records, lm.tokenizer, longest + 63, 64)
