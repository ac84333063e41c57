"""Prompts people wrote, read from a file: Spec-Bench / MT-bench JSONL, or plain text.

Spec-Bench (Xia et al., 2024, github.com/hemingkx/Spec-Bench, Apache-2.0) is the field's standard
for speculative decoding: 480 questions in 13 categories, one JSON object a line with
``question_id``, ``category``, ``turns`` (the first turn is the prompt) and, for some categories,
``reference``. MT-bench files have the same form. The file is read from wherever the user keeps
it (``../shared/data/spec_bench/question.jsonl`` beside this repository here); nothing of it is
copied into the project.

Two halves, by question id (*our choice*): an odd id is **validation** (every setting is chosen
there), an even one **test** (only reported). Spec-Bench numbers each category's questions
consecutively, so every category splits in half (5 and 5 of MT-bench's ten, 40 and 40 of the
eighty). An id that is not a whole number goes by the parity of its SHA-256.

Everything a file can get wrong is refused here, naming the file and line, before any model work.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from skipkey.config import validate_prompt_ids
from skipkey.errors import InputError

PARTS = ("validation", "test", "all")
# Where Spec-Bench's questions are kept on the machines this project runs on: beside the repository
# (``../shared/data/spec_bench/question.jsonl`` from its root), never inside it.
SPEC_BENCH_BESIDE_REPO = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"
PLAIN_CATEGORY = "text"  # a plain-text file's prompts have no category
MAX_FILE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a file: its id and category, the text, the reference answer if any, and its line; where a
    line says so (a training prompts file's lines do), where the text came from and under which licence."""

    id: str
    category: str
    text: str
    reference: str | None
    line: int
    source: str | None = None
    license: str | None = None

    @property
    def part(self) -> str:
        """``validation`` or ``test``: the half this prompt's id puts it in."""
        return half_of(self.id)


@dataclass(frozen=True)
class PromptFile:
    """A file's prompts, with what identifies it (its path and SHA-256)."""

    path: str
    sha256: str
    records: tuple[PromptRecord, ...]

    def select(self, part: str = "all", per_category: int | None = None,
               categories: tuple[str, ...] | None = None) -> tuple[PromptRecord, ...]:
        """The prompts of ``part`` (``PARTS``), the first ``per_category`` of each category in file order."""
        if part not in PARTS:
            raise InputError(f"the prompt part must be one of {', '.join(PARTS)}, got {part!r}")
        known = self.categories()
        unknown = [c for c in categories or () if c not in known]
        if unknown:
            raise InputError(f"{self.path} has no category {unknown[0]!r}; its categories: {', '.join(known)}")
        chosen, taken = [], {}
        for record in self.records:
            if part != "all" and record.part != part:
                continue
            if categories and record.category not in categories:
                continue
            if per_category is not None and taken.get(record.category, 0) >= per_category:
                continue
            taken[record.category] = taken.get(record.category, 0) + 1
            chosen.append(record)
        if not chosen:
            raise InputError(f"{self.path} has no prompt in the {part} part")
        return tuple(chosen)

    def categories(self) -> tuple[str, ...]:
        """Each category once, in the order the file first names it."""
        return tuple(dict.fromkeys(r.category for r in self.records))

    def describe(self, used: tuple[PromptRecord, ...] | None = None) -> dict:
        """What a results file records of the prompts: the file, its SHA-256 and the ids used."""
        used = self.records if used is None else used
        return {"path": self.path, "sha256": self.sha256, "ids": [r.id for r in used],
                "parts": sorted({r.part for r in used})}


def half_of(question_id: str) -> str:
    """``validation`` for an odd id, ``test`` for an even one (a non-numeric id: its SHA-256's parity)."""
    try:
        number = int(question_id)
    except ValueError:
        number = hashlib.sha256(question_id.encode()).digest()[-1]
    return "validation" if number % 2 else "test"


def read_prompts(path: str | Path) -> PromptFile:
    """Read a JSONL file (Spec-Bench / MT-bench form) or plain text (one prompt per non-empty line, ``\\n``
    written for a newline inside one). A ``.jsonl`` or ``.json`` name, or a first character ``{``, means
    JSONL. Any fault is an InputError naming the file and line."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise InputError(f"{path} is larger than {MAX_FILE_BYTES // 2**20} MiB: not a prompts file")
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"prompts file {path} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"prompts file {path} is a directory, not a file") from None
    except OSError as error:
        raise InputError(f"prompts file {path} cannot be read: {error.strerror or error}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise InputError(f"{path}:{line}: not UTF-8 text") from None
    jsonl = path.suffix in (".jsonl", ".json") or text.lstrip().startswith("{")
    records = _read_jsonl(path, text) if jsonl else _read_plain(text)
    if not records:
        raise InputError(f"prompts file {path} holds no prompt")
    ids = [r.id for r in records]
    if len(set(ids)) != len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        raise InputError(f"{path}: question id {twice} appears more than once")
    return PromptFile(str(path), hashlib.sha256(raw).hexdigest(), tuple(records))


def _lines(text: str) -> list[str]:
    """The file's lines: split at newlines only (a JSON string may hold U+2028, which ``str.splitlines`` also
    splits at), a Windows line end's carriage return dropped."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def _read_jsonl(path: Path, text: str) -> list[PromptRecord]:
    records = []
    for number, line in enumerate(_lines(text), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise InputError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise InputError(f"{path}:{number}: each line must be a JSON object, got {type(row).__name__}")
        prompt = _first_turn(row)
        if prompt is None:
            raise InputError(f"{path}:{number}: no prompt (a non-empty 'turns' list of strings, or a 'prompt' "
                             "string)")
        records.append(PromptRecord(id=str(row.get("question_id", number)),
                                    category=str(row.get("category", PLAIN_CATEGORY)), text=prompt,
                                    reference=_reference_text(row.get("reference")), line=number,
                                    source=_text_field(row, "source"), license=_text_field(row, "license")))
    return records


def _reference_text(value) -> str | None:
    """A row's reference as text, or None. A list holds one per turn (MT-bench): the first non-empty one. A list of
    strings in that place is one turn's acceptable answers (Spec-Bench's rag: Natural Questions' answer spans),
    joined with "; " so that ROUGE sees every span."""
    if isinstance(value, list):
        for turn in value:
            if isinstance(turn, list):
                turn = "; ".join(s.strip() for s in turn if isinstance(s, str) and s.strip())
            if isinstance(turn, str) and turn.strip():
                return turn
        return None
    return value if isinstance(value, str) and value.strip() else None


def _first_turn(row: dict) -> str | None:
    turns = row.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0].strip():
        return turns[0]
    prompt = row.get("prompt")
    return prompt if isinstance(prompt, str) and prompt.strip() else None


def _text_field(row: dict, key: str) -> str | None:
    value = row.get(key)
    return value if isinstance(value, str) and value.strip() else None


def _read_plain(text: str) -> list[PromptRecord]:
    return [PromptRecord(id=str(number), category=PLAIN_CATEGORY, text=line.replace("\\n", "\n"), reference=None,
                         line=number)
            for number, line in enumerate(_lines(text), start=1) if line.strip()]


def check_lengths(prompts: PromptFile, used: tuple[PromptRecord, ...], tokenizer, context_length: int,
                  max_new_tokens: int) -> list[list[int]]:
    """Each used prompt's token ids, or the engine's own refusal naming the file and line of the first one the
    model cannot take."""
    out = []
    for record in used:
        ids = tokenizer(record.text, add_special_tokens=True)["input_ids"]
        try:
            validate_prompt_ids([ids], context_length, max_new_tokens)
        except InputError as error:
            raise InputError(f"{prompts.path}:{record.line} (question {record.id}): {error}") from None
        out.append(ids)
    return out


__all__ = ["PARTS", "SPEC_BENCH_BESIDE_REPO", "PromptFile", "PromptRecord", "check_lengths", "half_of", "read_prompts"]
