"""The real-prompts builder on small sources made here: every category from its source with its licence, anything
meeting Spec-Bench (either half) or repeating dropped and counted, seeded, and the file passes finetune's check."""

import gzip
import hashlib
import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from experiments.real_prompts import german_sentences, main, prose_paragraphs
from skipkey.quality.prompt_file import read_prompts
from skipkey.training.prompt_source import check_prompt_file
from skipkey.training.recipe import FinetuneConfig

QUESTIONS = Path(__file__).parent / "data" / "questions.jsonl"  # Spec-Bench's form: test half 2, 4, 6
SMALL = ["--math-reasoning", "2", "--qa", "2", "--instruction", "2", "--translation", "2", "--summarization", "1",
         "--rag", "1", "--code", "1"]


def git_repo(root: Path, files: dict[str, list[dict]]) -> None:
    """A git repository at ``root`` holding each path's rows as JSONL, committed (the builder reads HEAD)."""
    for path, rows in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.org"]
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "data"], check=True)


def prose(rng: random.Random, sentences: int) -> str:
    subjects = ["The archive", "Every reader", "A careful editor", "The old index", "Each new release"]
    verbs = ["keeps", "explains", "replaces", "describes", "collects"]
    objects = ["the notes of earlier versions", "what changed and why", "the files a user needs",
               "each option in plain words", "the history of the project"]
    return " ".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {n}." for n in range(sentences))


@pytest.fixture
def sources(tmp_path) -> list[str]:
    """Tiny stand-ins for every source, with planted prompts that meet Spec-Bench and a repeat."""
    mirrors = tmp_path / "mirrors"
    git_repo(mirrors / "openai+grade-school-math" / "repo", {"grade_school_math/data/train.jsonl": [
        {"question": q} for q in ["A farmer has 12 cows and buys 5 more. How many cows does he have?",
                                  "Quick one: what is 17 times 23?",  # holds Spec-Bench's test question 4
                                  "Ann reads 20 pages a day. How many pages does she read in a week?"]]})
    git_repo(mirrors / "google-research-datasets+natural-questions" / "repo", {
        "nq_open/NQ-open.dev.jsonl": [{"question": q} for q in [
            "who built the first bridge across the river", "when did the city library first open",
            "describe the smell of a bakery at dawn in three sentences",  # test question 2, whole
            "who built the first bridge across the river"]],  # a repeat
        "nq_open/NQ-open.efficientqa.dev.1.1.jsonl": [{"question": q} for q in [
            "how many players are on a hockey team", "where is the tallest lighthouse in the country",
            "write a short note to a neighbour asking them to water the plants while you are away"]],  # validation 1
        "nq_open/NQ-open.efficientqa.test.1.1.jsonl": [{"question": "what year did the tram line close"}]})
    git_repo(mirrors / "yizhongw+self-instruct" / "repo", {
        "data/seed_tasks.jsonl": [{"instruction": "Suggest a title for this story.",
                                   "instances": [{"input": "A cat learns to sail.", "output": "x"}]}],
        "human_eval/user_oriented_instructions.jsonl": [{"instruction": "Write a haiku about rain.",
                                                         "instances": [{"input": "", "output": "x"}]}]})
    man = tmp_path / "man" / "man1"
    man.mkdir(parents=True)
    (man / "lesen.1.gz").write_bytes(gzip.compress(
        ".TH LESEN 1\n.SH BESCHREIBUNG\nDieses Programm liest die Datei und schreibt das Ergebnis auf die "
        "Standardausgabe, wenn keine Option angegeben ist.\nDie Ausgabe wird nicht verändert, wenn der Benutzer die "
        "Datei nicht lesen kann.\n.SH OPTIONEN\n.TP\n\\fB\\-a\\fR\nAlle Einträge anzeigen\n".encode()))
    docs, rng = tmp_path / "doc", random.Random(0)
    for package in ("alpha", "beta"):
        (docs / package).mkdir(parents=True)
        (docs / package / "copyright").write_text("Format: https://www.debian.org/doc/packaging-manuals/copyright-"
                                                  "format/1.0/\n\nFiles: *\nCopyright: 2024 Someone\nLicense: MIT\n")
        (docs / package / "README").write_text("\n\n".join(prose(rng, 8) for _ in range(8)))
    stdlib = tmp_path / "lib"
    stdlib.mkdir()
    (stdlib / "tally.py").write_text("".join(f"count_{n} = {n}\n" for n in range(30)))
    (tmp_path / "licenses").mkdir()
    return ["--spec-bench", str(QUESTIONS), "--mirrors", str(mirrors), "--man-dir", str(tmp_path / "man"),
            "--man-package", "", "--doc-dir", str(docs), "--licenses-dir", str(tmp_path / "licenses"),
            "--no-pydoc-topics", "--stdlib", str(stdlib)]


@pytest.mark.skipif(shutil.which("groff") is None, reason="renders the man pages with groff")
def test_the_builder_writes_every_category_drops_what_meets_spec_bench_and_passes_the_check(tmp_path, sources):
    out = tmp_path / "prompts.jsonl"
    report = main(["--out", str(out), *SMALL, *sources])
    prompts = read_prompts(out)
    written = {c: [r for r in prompts.records if r.category == c] for c in prompts.categories()}
    assert {c: len(r) for c, r in written.items()} == {"math_reasoning": 2, "qa": 2, "instruction": 2,
                                                      "translation": 2, "summarization": 1, "rag": 1, "code": 1}
    assert all(r.source and r.license for r in prompts.records)
    assert {r.license for r in written["math_reasoning"]} == {"MIT"} and written["rag"][0].license.endswith("CC-BY-SA-3.0")
    assert written["translation"][0].text.startswith("Translate German to English: ")
    assert written["summarization"][0].text.startswith("Summarize: ") and written["summarization"][0].license == "MIT"
    assert 300 <= len(written["summarization"][0].text.split()) <= 901

    categories = report["categories"]
    assert categories["math_reasoning"]["dropped"] == {"meets Spec-Bench's test half": 1}
    assert categories["qa"]["dropped"] == {"meets Spec-Bench's test half": 1, "meets Spec-Bench's validation half": 1,
                                           "repeats an earlier prompt": 1}
    question = written["rag"][0].text.splitlines()[-1]  # the rag question is one no qa prompt asks
    assert question not in {r.text for r in written["qa"]} and question.endswith("?") and question[0].isupper()
    assert report["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest() == prompts.sha256
    assert report["check"]["run"] and report["check"]["test_prompts"] == 3

    # Seeded: the same seed writes the same file, another draws other prompts of the same sources.
    assert main(["--out", str(tmp_path / "again.jsonl"), *SMALL, *sources])["sha256"] == report["sha256"]
    assert main(["--out", str(tmp_path / "other.jsonl"), "--seed", "1", *SMALL, *sources])["sha256"] != report["sha256"]
    assert check_prompt_file(FinetuneConfig(prompts=str(out), spec_bench=str(QUESTIONS), sequences=11))["run"]


def test_german_sentences_leave_out_options_english_and_fragments():
    rendered = ("BESCHREIBUNG\n       Dieses Programm liest die Datei und schreibt das Ergebnis auf die\n"
                "       Standardausgabe, wenn keine Option angegeben ist. Kurz und gut.\n\n"
                "       -a, --all\n              Alle Einträge nicht ignorieren, die mit --all beginnen.\n\n"
                "       This sentence is in English and is left out of the German ones.\n")
    assert german_sentences(rendered) == ["Dieses Programm liest die Datei und schreibt das Ergebnis auf die "
                                          "Standardausgabe, wenn keine Option angegeben ist."]


def test_prose_paragraphs_leave_out_code_headings_lists_and_names():
    text = ("# Title\n\nThis paragraph explains in plain words what the package does and why a user would want "
            "to install it on a machine.\n\n    def code(): return 1\n\n* a list item that goes on for a while "
            "with many words in it to pass the length\n\nThanks to Alice Brown, Carol Dee, Erik Fox, Gina Hall, "
            "Ivan Jones, Kim Lee, Mona Ng, Otto Park and Quinn Roe.\n\nSee the [manual](http://x) for `more` "
            "**details** about every option that the program accepts on the command line today.")
    assert prose_paragraphs(text) == [
        "This paragraph explains in plain words what the package does and why a user would want to install it on "
        "a machine.", "See the manual for more details about every option that the program accepts on the command "
        "line today."]
