"""The retrieval suite: a fact hidden at a chosen depth of long filler, asked for at the end.

``retrieval_tasks`` makes seeded tasks of a given prompt length, the families in
turn (a pass key, one code among many, a person's name, a number in a table),
each family at depths spread over ``RETRIEVAL_DEPTHS``; ``retrieved`` says whether
a generation gives the answer. The filler is Python's help text (``prompts.help_topics``).
``skipkey.quality.evaluate`` runs the tasks on every KV policy.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass

from skipkey.errors import InputError
from skipkey.quality.prompts import _doc_passages

RETRIEVAL_FAMILIES = ("passkey", "kv", "name", "table")  # the order they take turns in
RETRIEVAL_NEW_TOKENS = {"passkey": 12, "kv": 12, "name": 16, "table": 12}  # generated per task: room for the answer
RETRIEVAL_DEPTHS = (0.1, 0.9)  # the needle's depth (share of the prompt before it) is spread over this range
RETRIEVAL_INTRO = ("Below is a long text with a few important facts hidden in it. Read it and remember the facts: "
                   "a question about one of them comes at the end.")
CODE_WORDS = [
    "Bluefin", "Saffron", "Granite", "Marigold", "Falcon", "Juniper", "Cobalt", "Lantern", "Orchid", "Thistle",
    "Harbor", "Pepper", "Walnut", "Comet", "Velvet", "Glacier", "Meadow", "Copper", "Sparrow", "Quartz",
    "Willow", "Ember", "Tundra", "Cinder", "Maple", "Otter", "Prism", "Raven", "Sable", "Topaz", "Zephyr",
    "Basil", "Cypress", "Dune", "Fjord", "Hazel", "Indigo", "Kestrel", "Lotus", "Nectar",
]
FIRST_NAMES = [
    "Marguerite", "Tobias", "Ingrid", "Kwame", "Aiko", "Rafael", "Siobhan", "Dmitri", "Lucia", "Oskar",
    "Priya", "Bartholomew", "Noor", "Evangeline", "Tomasz", "Adaeze", "Leopold", "Yuki", "Fenella", "Cormac",
    "Ximena", "Anselm", "Hilde", "Ignatius",
]
SURNAMES = [
    "Okonkwo", "Larsen", "Vasquez", "Lindqvist", "Abernathy", "Takahashi", "Moreau", "Kowalczyk", "Fitzgerald",
    "Haddad", "Ferreira", "Nakamura", "Oyelaran", "Brennan", "Castellanos", "Dubois", "Eriksson", "Galloway",
    "Iwasaki", "Mbeki", "Quintero", "Rasmussen", "Sokolov", "Thorne",
]
ROLES = [
    "keeper of the lighthouse", "captain of the night ferry", "head gardener of the botanical garden",
    "conductor of the mountain railway", "owner of the corner bookshop", "keeper of the town archive",
    "pilot of the mail plane", "chef of the harbour restaurant", "curator of the map museum",
    "beekeeper of the old abbey", "warden of the island reserve", "clockmaker of the market square",
    "organist of the cathedral", "ferryman of the northern crossing", "librarian of the observatory",
    "master of the glass workshop",
]
TOWNS = [  # made up, so no town's numbers can be known from anywhere but the table
    "Velmora", "Brackenmoor", "Caldrith", "Dunmarrow", "Eskerholt", "Fennwick", "Galvenna", "Hollowmere",
    "Istravel", "Jorvanne", "Kestrelby", "Lindenhal", "Morrowgate", "Norvale", "Oakhaven", "Pellridge",
]
# The table's number columns: (header, lowest, highest, question, the answer's lead-in). Every cell is a
# 4-digit number, so its shape tells neither its row nor its column: only reading the right cell answers.
TABLE_COLUMNS = [
    ("founded", 1100, 1899, "in which year was {town} founded", "{town} was founded in"),
    ("population", 2000, 9999, "what is the population of {town}", "The population of {town} is"),
    ("altitude (m)", 1000, 2999, "what is the altitude of {town} in metres", "The altitude of {town} is"),
]


@dataclass(frozen=True)
class RetrievalTask:
    """A fact (the needle) stated at ``depth`` of a long filler prompt that ends by asking for it.

    The prompt ends so that the answer is its continuation (``... The pass key is``).
    """

    prompt: str
    answer: str
    family: str  # one of RETRIEVAL_FAMILIES
    depth: float  # share of the prompt's tokens before the needle
    needle: str
    question: str
    new_tokens: int  # tokens to generate: enough for the answer


def _filler_sentences(rng: random.Random) -> list[str]:
    """Python's help text as sentences, from a seeded start, wrapping around."""
    passages = list(dict.fromkeys(_doc_passages()))  # some help topics repeat a paragraph
    start = rng.randrange(len(passages))
    sentences = (s for p in passages[start:] + passages[:start] for s in re.split(r"(?<=[.!?])\s+", p))
    return [s for s in sentences if s[-1:] in ".!?"]  # whole sentences: paragraphs may stop before a code block


def _distinct(rng: random.Random, draw, count: int) -> list:
    out: list = []
    while len(out) < count:
        value = draw(rng)
        if value not in out:
            out.append(value)
    return out


def _name(rng: random.Random) -> str:
    first, last = rng.choice(FIRST_NAMES), rng.choice(SURNAMES)
    if rng.random() < 0.4:  # a double-barrelled surname: more tokens to keep
        last = f"{last}-{rng.choice([s for s in SURNAMES if s != last])}"
    return f"{first} {last}"


def _table_facts(rng: random.Random, others: int) -> tuple[str, str, str, list[str]]:
    """A table of ``others + 1`` towns (the needle, every cell a different number) and a question for one cell.

    The asked row and column are drawn, so neither the first row nor one column is the answer's place;
    the other cells are the distractors, in the same table.
    """
    towns = _distinct(rng, lambda r: r.choice(TOWNS), others + 1)
    used: set[int] = set()
    rows = [[_unused(rng, low, high, used) for _, low, high, _, _ in TABLE_COLUMNS] for _ in towns]
    lines = ["The towns of the valley:", "| town | " + " | ".join(c[0] for c in TABLE_COLUMNS) + " |",
             "|---" * (len(TABLE_COLUMNS) + 1) + "|"]
    lines += [f"| {town} | " + " | ".join(map(str, row)) + " |" for town, row in zip(towns, rows)]
    row, column = rng.randrange(len(towns)), rng.randrange(len(TABLE_COLUMNS))
    _, _, _, asked, lead = TABLE_COLUMNS[column]
    question = (f"Question: In the table of towns above, {asked.format(town=towns[row])}?\n"
                f"Answer: {lead.format(town=towns[row])}")
    return "\n".join(lines), question, str(rows[row][column]), []


def _unused(rng: random.Random, low: int, high: int, used: set[int]) -> int:
    """A number in [low, high] not in ``used`` (added to it)."""
    value = rng.randint(low, high)
    while value in used:
        value = rng.randint(low, high)
    used.add(value)
    return value


def _facts(family: str, rng: random.Random, distractors: int) -> tuple[str, str, str, list[str]]:
    """(needle, question, answer, distractor facts) of one task."""
    if family == "table":
        return _table_facts(rng, distractors)
    if family == "passkey":
        key = str(rng.randint(10000, 99999))
        return (f"The pass key is {key}. Remember it. {key} is the pass key.",
                "Question: What is the pass key?\nAnswer: The pass key is", key, [])
    if family == "kv":
        words = _distinct(rng, lambda r: r.choice(CODE_WORDS), distractors + 1)
        codes = _distinct(rng, lambda r: str(r.randint(1000, 9999)), distractors + 1)
        lines = [f"The code for {w} is {c}." for w, c in zip(words, codes)]
        question = f"Question: What is the code for {words[0]}?\nAnswer: The code for {words[0]} is"
        return lines[0], question, codes[0], lines[1:]
    roles = _distinct(rng, lambda r: r.choice(ROLES), distractors + 1)
    names = _distinct(rng, _name, distractors + 1)
    lines = [f"The {role} is named {name}." for role, name in zip(roles, names)]
    return lines[0], f"Question: Who is the {roles[0]}?\nAnswer: The {roles[0]} is named", names[0], lines[1:]


def _mentions(text: str, answer: str) -> bool:
    if answer.isdigit():
        return re.search(rf"(?<!\d){answer}(?!\d)", text) is not None
    return f" {_words(answer)} " in f" {_words(text)} "


def _fill(sentences: list[str], sizes, room: int) -> list[tuple[str, int]]:
    """Consecutive sentences (skipping any that would overflow) until ``room`` tokens are nearly used."""
    filler, used, misses = [], 0, 0
    for sentence in itertools.cycle(sentences):
        size = sizes(sentence)
        if used + size <= room:
            filler.append((sentence, size))
            used, misses = used + size, 0
        else:
            misses += 1
        if room - used < 4 or misses > len(sentences):
            return filler


def _join(units: list[str]) -> str:
    """The units one space apart, but a unit of several lines (a table) on lines of its own."""
    text = units[0] if units else ""
    for before, unit in zip(units, units[1:]):
        text += ("\n" if "\n" in before + unit else " ") + unit
    return text


def retrieval_task(tokenizer, length: int, family: str, depth: float, rng: random.Random) -> RetrievalTask:
    """One task of about ``length`` prompt tokens: the needle at ``depth``, distractor facts of the same
    form (other keys, other roles, other cells of the table) around it, the question at the end."""
    def count(text: str) -> int:  # with what separates it from the unit before (and, for a table, after)
        text = f"\n{text}\n" if "\n" in text else " " + text
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    intro = RETRIEVAL_INTRO + "\n\n"
    head = len(tokenizer(intro, add_special_tokens=True)["input_ids"])
    # Distractors: facts of the same form, more in longer prompts (as many as the word lists allow).
    distractors = {"passkey": 0, "kv": min(max(3, length // 256), len(CODE_WORDS) - 1),
                   "name": min(max(2, length // 512), len(ROLES) - 1),
                   "table": min(max(3, length // 512), len(TOWNS) - 1)}[family]
    sentences = _filler_sentences(rng)
    for _ in range(100):  # the answer must appear nowhere but in the needle
        needle, question, answer, others = _facts(family, rng, distractors)
        tail = len(tokenizer("\n\n" + question, add_special_tokens=False)["input_ids"])
        room = length - head - tail - sum(map(count, [needle, *others]))
        if room < 16:
            raise InputError(f"a retrieval prompt of {length} tokens leaves no room for filler; use a longer one")
        filler = _fill(sentences, count, room)
        if not any(_mentions(s, answer) for s, _ in filler):
            break
    # Distractors anywhere; then the needle at the sentence boundary nearest its depth.
    for slot in sorted(rng.sample(range(len(filler) + 1), min(len(others), len(filler) + 1)), reverse=True):
        fact = others.pop()
        filler.insert(slot, (fact, count(fact)))
    total = head + sum(size for _, size in filler) + count(needle) + tail
    at, before = 0, head
    while at < len(filler) and before + filler[at][1] / 2 < depth * total:
        before += filler[at][1]
        at += 1
    units = [s for s, _ in filler]
    units.insert(at, needle)
    prompt = intro + _join(units) + "\n\n" + question
    before = len(tokenizer(intro + _join(units[:at]), add_special_tokens=True)["input_ids"])
    total = len(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    return RetrievalTask(prompt, answer, family, round(before / total, 3), needle, question,
                         RETRIEVAL_NEW_TOKENS[family])


def retrieval_families(names) -> tuple[str, ...]:
    """``names`` checked (at least one, each a family, none twice), in ``RETRIEVAL_FAMILIES``' order:
    the order they take turns in, so the same families make the same tasks however they are listed."""
    names = list(names)
    if not names or len(set(names)) < len(names) or not set(names) <= set(RETRIEVAL_FAMILIES):
        raise InputError(f"retrieval families are one or more of {', '.join(RETRIEVAL_FAMILIES)}, each once; "
                         f"got {' '.join(names) or 'none'}")
    return tuple(f for f in RETRIEVAL_FAMILIES if f in names)


def retrieval_tasks(tokenizer, length: int, count: int, seed: int = 0,
                    families=RETRIEVAL_FAMILIES) -> list[RetrievalTask]:
    """``count`` seeded tasks of about ``length`` prompt tokens, the ``families`` in turn.

    Families are balanced (they take turns), and within each family the needle's
    depth is spread evenly over ``RETRIEVAL_DEPTHS``, so every family is asked at
    every depth. Filler is Python's help text from a different start per task.
    ``families=("passkey", "kv", "name")`` makes the tasks the suite made before
    the table family, seed for seed.
    """
    families = retrieval_families(families)
    rng = random.Random(seed * 1_000_003 + length)
    per_family = [len(range(f, count, len(families))) for f in range(len(families))]
    lo, hi = RETRIEVAL_DEPTHS
    tasks = []
    for i in range(count):
        f, j = i % len(families), i // len(families)
        depth = lo + (hi - lo) * j / (per_family[f] - 1) if per_family[f] > 1 else (lo + hi) / 2
        task_rng = random.Random(rng.getrandbits(64))
        tasks.append(retrieval_task(tokenizer, length, families[f], depth, task_rng))
    return tasks


def _words(text: str) -> str:
    """Lower-case words and numbers, one space apart: what a name is compared by."""
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def retrieved(text: str, answer: str) -> bool:
    """Whether a generation (the first few tokens after the question) gives ``answer``.

    A number must be the first number generated, digit for digit (``5821`` or
    ``582130`` do not count for ``58213``). A name or phrase must appear, compared
    word by word, ignoring case, spacing and punctuation (``okonkwo larsen``
    matches ``Okonkwo-Larsen``).
    """
    if answer.isdigit():
        numbers = re.findall(r"\d+", text)
        return bool(numbers) and numbers[0] == answer
    return f" {_words(answer)} " in f" {_words(text)} "
