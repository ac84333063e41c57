"""The prompts fine-tuning continues: a set generated in code (``generic``, ``categories``) or a prompts file
people wrote (``--prompts FILE``, e.g. from ``python -m experiments.real_prompts``), and the check such a file
passes before a run starts.

A file is identified by its SHA-256: the training data's cache key, the checkpoint a run resumes and the adapter's
metadata all carry it (the metadata also its path, the categories, and the ``source`` and ``license`` its lines
name). **No prompt of it may meet Spec-Bench's test half** (the even question ids, ``PromptFile.select("test")``):
share no 12-word window with a test prompt, hold no shorter test prompt whole, and be no piece (6 to 11 words) of
one (``skipkey.quality.overlap``); the refusal names the file, the line and the question. The check reads
Spec-Bench from ``--spec-bench`` or, by default, from beside the repository (``SPEC_BENCH_BESIDE_REPO``). Where it
finds no Spec-Bench it cannot vouch for the file, so the run is refused; ``--no-overlap-check`` trains on the file
unchecked, and the adapter's metadata says so. Only the first turn of a Spec-Bench question is checked (the prompt
``bench`` serves; MT-bench's second turns are short follow-ups such as "Now make it rhyme." that ordinary text
holds by chance).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

from skipkey.errors import InputError
from skipkey.quality.overlap import MIN_PIECE, WINDOW, HeldOut
from skipkey.quality.prompt_file import SPEC_BENCH_BESIDE_REPO, PromptFile, PromptRecord, read_prompts
from skipkey.quality.prompts import training_prompts
from skipkey.quality.splits import train_category_prompts
from skipkey.training.recipe import PROMPT_SETS, FinetuneConfig

PROMPT_SET_TEXT = {
    "generic": "skipkey.quality.prompts.training_prompts: topic templates, code openers and Python help-text "
               "passages (pydoc_data); none held out",
    "categories": "skipkey.quality.splits.train_category_prompts: the test set's 13 categories from other "
                  "templates, words and openings (no 12-word window of a test prompt)",
}
FILE_SELECTION = "seeded (--seed): each category's prompts shuffled, then the categories taken in turn"
FILE_SELECTION_VERSION = 1  # bump when file_prompts changes, so cached training data is rebuilt
OVERLAP_RULE = (f"no prompt of the file shares a {WINDOW}-word window with a test prompt, holds a shorter one whole, "
                f"or is a piece of one ({MIN_PIECE} to {WINDOW - 1} words); words: lowercase letters and digits "
                "(skipkey.quality.overlap)")


def prompt_file(cfg: FinetuneConfig) -> PromptFile:
    """The run's prompts file, refused if it is no longer the file the run was set up with."""
    file = read_prompts(cfg.prompts)
    if file.sha256 != cfg.prompts_sha256:
        raise InputError(f"prompts file {cfg.prompts} changed since the run was set up (SHA-256 {file.sha256}, "
                         f"was {cfg.prompts_sha256})")
    return file


def file_prompts(file: PromptFile, count: int, seed: int) -> list[PromptRecord]:
    """``count`` prompts of ``file``: each category's shuffled by ``seed``, the categories taken in turn (in the
    order the file first names them), so any count is a balanced mix and another seed draws other prompts."""
    rng = random.Random(seed)
    queues = []
    for category in file.categories():
        records = [r for r in file.records if r.category == category]
        rng.shuffle(records)
        queues.append(records)
    chosen: list[PromptRecord] = []
    while len(chosen) < min(count, len(file.records)):
        for queue in queues:
            if queue and len(chosen) < count:
                chosen.append(queue.pop(0))
    return chosen


def training_prompt_set(cfg: FinetuneConfig) -> list[str]:
    """The ``cfg.sequences`` prompts whose full-model continuations the run trains on (``cfg.prompts``)."""
    if not cfg.sequences:
        return []
    if cfg.prompts not in PROMPT_SETS:
        return [r.text for r in file_prompts(prompt_file(cfg), cfg.sequences, cfg.seed)]
    make = train_category_prompts if cfg.prompts == "categories" else training_prompts
    return make(cfg.sequences, cfg.seed)


def spec_bench_test_half(path: Path) -> tuple[PromptFile, HeldOut]:
    """Spec-Bench's questions from ``path``, and its test half's first turns indexed for the overlap check."""
    spec_bench = read_prompts(path)
    return spec_bench, HeldOut((r.id, r.text) for r in spec_bench.select("test"))


def check_prompt_file(cfg: FinetuneConfig, log=print) -> dict | None:
    """Refuse a prompts file that meets Spec-Bench's test half, naming the file, the line and the question; or,
    with no Spec-Bench to check against, refuse it unless ``--no-overlap-check``. Returns what the adapter's
    metadata records of the check (None for a generated prompt set); logs how many prompts meet the validation
    half, which is not refused (settings chosen there then read optimistic)."""
    if cfg.prompts in PROMPT_SETS:
        return None
    file = prompt_file(cfg)
    if not cfg.overlap_check:
        return {"run": False, "why": "--no-overlap-check: trained on the file without checking it"}
    path = Path(cfg.spec_bench).expanduser() if cfg.spec_bench else SPEC_BENCH_BESIDE_REPO
    if not path.is_file():
        raise InputError(f"the overlap check of {file.path} could not run: no Spec-Bench questions at {path}; give "
                         "--spec-bench FILE, or --no-overlap-check to train on the file unchecked")
    spec_bench, test_half = spec_bench_test_half(path)
    hits = [(record, hit) for record in file.records if (hit := test_half.find(record.text))]
    if hits:
        record, hit = hits[0]
        more = f" (and {len(hits) - 1} more of its prompts)" if len(hits) > 1 else ""
        raise InputError(f"{file.path}:{record.line}: prompt {record.id} {hit.describe()} of Spec-Bench's test half "
                         f"({path}){more}; training prompts must never be test prompts")
    validation = HeldOut((r.id, r.text) for r in spec_bench.select("validation"))
    met = sum(validation.find(r.text) is not None for r in file.records)
    if met:
        log(f"note: {met} prompts of {file.path} meet Spec-Bench's validation half (settings chosen there will "
            "read optimistic)")
    return {"run": True, "against": str(path), "sha256": spec_bench.sha256, "test_prompts": test_half.count,
            "rule": OVERLAP_RULE, "validation_prompts_met": met}


def describe_prompts(cfg: FinetuneConfig, check: dict | None) -> str | dict:
    """What the adapter's metadata says of the prompts: a generated set's description, or the file (path,
    SHA-256, selection, and the categories, sources and licences of the prompts used) and its overlap check."""
    if cfg.prompts in PROMPT_SETS:
        return PROMPT_SET_TEXT[cfg.prompts]
    file = prompt_file(cfg)
    used = file_prompts(file, cfg.sequences, cfg.seed)
    return {"file": cfg.prompts, "resolved": str(Path(cfg.prompts).resolve()), "sha256": file.sha256,
            "prompts_in_file": len(file.records), "used": len(used), "selection": FILE_SELECTION,
            "categories": dict(Counter(r.category for r in used)),
            "sources": dict(Counter(r.source or "unstated" for r in used)),
            "licenses": dict(Counter(r.license or "unstated" for r in used)),
            "overlap_check": check}
