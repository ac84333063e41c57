"""The prompts SkipKey measures and trains on, all generated in code or read from Python itself.

* evaluation: ``ORDINARY_PROMPTS`` (held out from training), ``retrieval_tasks``
  (a pass key, one code among many, a person's name, hidden at varied depths of
  long filler), documents to continue and long real text for perplexity (all the
  long text is Python's help topics, ``pydoc_data``);
* training: ``training_prompts``, seeded and varied, never one of the held-out ones.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass

from skipkey.errors import InputError

ORDINARY_PROMPTS = [
    "The history of the Roman Empire",
    "To bake a loaf of sourdough bread, you first",
    "The main differences between TCP and UDP are",
    "Once upon a time, in a village by the sea, there lived",
    "Photosynthesis is the process by which",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The best way to learn a new language is",
    "Dear hiring manager, I am writing to apply for",
    "In 1969, the Apollo 11 mission",
    "The three laws of thermodynamics state that",
    "A good night's sleep matters because",
    "SELECT name, COUNT(*) FROM orders",
    "The capital of Australia is Canberra, and the capital of Canada is",
    "Climate change affects coastal cities by",
    "Here is a recipe for a simple tomato soup:",
    "The stock market fell sharply on Monday after",
    "Machine learning models can overfit when",
    "My favourite memory from childhood is",
    "The following is a summary of the meeting:",
    "Water boils at 100 degrees Celsius at sea level, but on a mountain",
    "The rules of chess say that a bishop",
    "An email to a colleague about the project deadline:",
    "The French Revolution began in 1789 when",
    "How to change a flat tyre: first,",
    "Customer: Hi, my order arrived damaged. What can I do?\nAgent:",
    "Alice: Did you finish the report?\nBob: Almost. I still need\nAlice:",
    "Interviewer: What made you become a nurse?\nNurse:",
    "Things to pack for a weekend hiking trip:\n- water bottle\n-",
    "Top five tips for saving money on groceries:\n1.",
    "Shopping list:\n* eggs\n* flour\n*",
    "The planets of the solar system, in order from the Sun, are",
    "The human skeleton has 206 bones, and the largest of them is",
    "Mount Everest, the highest mountain on Earth, is located",
    "The Pacific Ocean is the largest ocean and covers",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "const express = require('express');\nconst app = express();\n\n",
    "#!/bin/bash\n# Back up the home directory every night\n",
    "def read_lines(path):\n    with open(path) as f:\n",
    "Dear Sam,\n\nThank you so much for the birthday present.",
    "Abstract: We study the effect of sleep on memory consolidation in",
    "Breaking news: a powerful storm is expected to reach the coast",
    "In a small town in the mountains, every winter the",
    "Step 1: Preheat the oven to 180 degrees. Step 2:",
    "The key difference between a virus and a bacterium is",
    "Frequently asked questions\n\nQ: How long does shipping take?\nA:",
    "The meeting is scheduled for Tuesday at 10 a.m. The agenda includes",
    "A haiku about autumn leaves:\n",
    "Review: I bought this coffee maker last month and",
]


# -- evaluation ---------------------------------------------------------------------------------
RETRIEVAL_FAMILIES = ("passkey", "kv", "name")
RETRIEVAL_NEW_TOKENS = {"passkey": 12, "kv": 12, "name": 16}  # generated per task: room for the answer
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
    """Python's help text (shipped with Python) as sentences, from a seeded start, wrapping around."""
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


def _facts(family: str, rng: random.Random, distractors: int) -> tuple[str, str, str, list[str]]:
    """(needle, question, answer, distractor facts) of one task."""
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


def retrieval_task(tokenizer, length: int, family: str, depth: float, rng: random.Random) -> RetrievalTask:
    """One task of about ``length`` prompt tokens: the needle at ``depth``, distractor facts of the same
    form (other keys, other roles) scattered through the filler, the question at the end."""
    def count(text: str) -> int:
        return len(tokenizer(" " + text, add_special_tokens=False)["input_ids"])

    intro = RETRIEVAL_INTRO + "\n\n"
    head = len(tokenizer(intro, add_special_tokens=True)["input_ids"])
    # Distractors: facts of the same form, more in longer prompts (as many as the word lists allow).
    distractors = {"passkey": 0, "kv": min(max(3, length // 256), len(CODE_WORDS) - 1),
                   "name": min(max(2, length // 512), len(ROLES) - 1)}[family]
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
    prompt = intro + " ".join(units) + "\n\n" + question
    before = len(tokenizer(intro + " ".join(units[:at]), add_special_tokens=True)["input_ids"])
    total = len(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    return RetrievalTask(prompt, answer, family, round(before / total, 3), needle, question,
                         RETRIEVAL_NEW_TOKENS[family])


def retrieval_tasks(tokenizer, length: int, count: int, seed: int = 0) -> list[RetrievalTask]:
    """``count`` seeded tasks of about ``length`` prompt tokens, the families in turn.

    Families are balanced (they take turns), and within each family the needle's
    depth is spread evenly over ``RETRIEVAL_DEPTHS``, so every family is asked at
    every depth. Filler is Python's help text from a different start per task.
    """
    rng = random.Random(seed * 1_000_003 + length)
    per_family = [len(range(f, count, len(RETRIEVAL_FAMILIES))) for f in range(len(RETRIEVAL_FAMILIES))]
    lo, hi = RETRIEVAL_DEPTHS
    tasks = []
    for i in range(count):
        f, j = i % len(RETRIEVAL_FAMILIES), i // len(RETRIEVAL_FAMILIES)
        depth = lo + (hi - lo) * j / (per_family[f] - 1) if per_family[f] > 1 else (lo + hi) / 2
        task_rng = random.Random(rng.getrandbits(64))
        tasks.append(retrieval_task(tokenizer, length, RETRIEVAL_FAMILIES[f], depth, task_rng))
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


def long_text_ids(tokenizer, tokens: int) -> list[int]:
    """Real English prose: Python's help topics, concatenated (ships with Python)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return tokenizer(text, add_special_tokens=True)["input_ids"][:tokens]


def document_prompts(tokenizer, count: int, tokens: int) -> list[str]:
    """``count`` ordinary documents cut to about ``tokens`` tokens each, to be continued.

    Python's help topics (installed with Python), taken from the end of the list so
    they do not overlap the long-text perplexity passage, which starts at its head.
    The KV budget is a share of the prompt, so agreement needs prompts long enough
    for a budget to mean something: 25% of a 10-token prompt keeps two tokens.
    """
    from pydoc_data.topics import topics

    long_enough = [topics[k] for k in sorted(topics, reverse=True) if len(topics[k]) >= 6 * tokens]
    if count > len(long_enough):
        raise InputError(f"at most {len(long_enough)} document prompts of {tokens} tokens exist here, asked {count}")
    prompts = []
    for text in long_enough[:count]:
        ids = tokenizer(text.strip(), add_special_tokens=False)["input_ids"][:tokens]
        prompts.append(tokenizer.decode(ids))
    return prompts


# -- training -----------------------------------------------------------------------------------
TRAINING_PROMPTS_VERSION = 1  # bump when training_prompts changes, so cached training data is rebuilt
SUBJECTS = [
    "volcanoes", "the printing press", "honeybees", "public libraries", "the violin", "glaciers",
    "the Silk Road", "vaccines", "coral reefs", "the steam engine", "jazz", "origami", "lighthouses",
    "the human heart", "black holes", "green tea", "the Great Wall of China", "penguins", "solar panels",
    "the Renaissance", "earthquakes", "bicycles", "rainforests", "the immune system", "railways", "cheese",
    "typewriters", "the Olympic Games", "deserts", "electric cars", "the Internet", "mushrooms", "windmills",
    "ancient Egypt", "the piano", "recycling", "submarines", "the alphabet", "hurricanes", "the Vikings",
    "suspension bridges", "coffee", "telescopes", "wolves", "the Amazon River", "paper money", "clocks",
    "butterflies", "the Industrial Revolution", "museums", "satellites", "rice farming", "the Sahara",
    "vitamins", "castles", "photography", "octopuses", "democracy", "gardening", "the Byzantine Empire",
    "spreadsheets", "compilers", "the blockchain", "sewing machines", "opera", "marathons", "maple syrup",
]
TEMPLATES = [
    "The history of {s} begins", "A short introduction to {s}.\n\n", "Here are five facts about {s}:\n1.",
    "Q: What should everyone know about {s}?\nA:", "Chapter 1: {S}\n\n", "My grandmother often told me about {s}.",
    "Encyclopedia entry: {S}.", "In this essay I will argue that {s}", "Notes from a lecture on {s}:",
    "The most surprising thing about {s} is", "A children's story about {s}. Once", "Title: A beginner's guide to {s}\n\n",
    "Scientists who study {s} recently found", "Just learned something amazing about {s}!",
    "An interview with an expert on {s}.\nQ:", "Pros and cons of {s}:\n-", "A poem about {s}:\n\n",
    "Dear diary, today I visited an exhibition about {s}.", "If you have ever wondered about {s},",
]
CODE_PROMPTS = [
    "def parse_config(path):\n", "class Inventory:\n    \"\"\"", "import os\nimport sys\n\n\ndef main():\n",
    "# Read a CSV file and print the average of each column\nimport csv\n", "function debounce(fn, wait) {\n",
    "#include <stdio.h>\n\nint main(void) {\n", "<!DOCTYPE html>\n<html>\n<head>\n  <title>",
    "def merge_sorted(a, b):\n    \"\"\"", "CREATE TABLE users (\n", "$ git log --oneline\n",
    "fn main() {\n    let", "public class Point {\n    private", "for (let i = 0; i < items.length; i++) {\n",
    "def is_prime(n: int) -> bool:\n", "# Installation\n\nTo install the package, run", "import numpy as np\n\n",
]


def _doc_passages() -> list[str]:
    """Prose paragraphs of Python's help topics (``pydoc_data``, shipped with Python)."""
    from pydoc_data.topics import topics

    passages = []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            text = " ".join(para.split())
            if para[:1].isalpha() and len(text) > 80 and not set(text) & set("*=|"):
                passages.append(text)
    return passages


def training_prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct prompts, seeded: half topic templates, a fifth code, the rest help-text openings.

    None is one of ``ORDINARY_PROMPTS`` (the held-out prompts), and the subjects
    avoid their topics.
    """
    rng = random.Random(seed)
    passages = _doc_passages()
    held_out = set(ORDINARY_PROMPTS)
    prompts: list[str] = []
    seen = set(held_out)
    while len(prompts) < count:
        kind = len(prompts) % 10
        if kind < 5:
            subject = rng.choice(SUBJECTS)
            prompt = rng.choice(TEMPLATES).format(s=subject, S=subject[:1].upper() + subject[1:])
        elif kind < 7:
            prompt = rng.choice(CODE_PROMPTS)
            if prompt in seen:  # few code openers: vary them by a preceding comment
                prompt = f"# {rng.choice(SUBJECTS)} helper, version {rng.randint(2, 99)}\n{prompt}"
        else:
            words = rng.choice(passages).split()
            prompt = " ".join(words[: rng.randint(8, 30)])
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    assert not held_out & set(prompts)
    return prompts


TRAINING_TEXT_VERSION = 1  # bump when training_text changes, so cached training data is rebuilt


def _stdlib_sources() -> list[str]:
    """Python's own standard-library source files (read as text, never imported), sorted."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo", "__pycache__")
    return sorted(str(p) for p in root.rglob("*.py") if not set(p.relative_to(root).parts) & set(skip))


def training_text(tokenizer, count: int, prompt_tokens: int, gen_tokens: int, seed: int = 0) -> list[list[int]]:
    """``count`` seeded windows of ``prompt_tokens + gen_tokens`` tokens of offline text, for training.

    Alternately Python's help topics (prose, ``pydoc_data``) and the standard
    library's source (code and docstrings), each window from a random place in a
    random document. None of it is a held-out prompt (``ORDINARY_PROMPTS``), which
    are short everyday openings the standard library does not contain.
    """
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    width = prompt_tokens + gen_tokens
    prose = [topics[k] for k in sorted(topics) if len(topics[k]) >= 8 * width]
    files = _stdlib_sources()
    rng.shuffle(files)
    windows: list[list[int]] = []
    tokens_of: dict[str, list[int]] = {}
    attempts = 0
    while len(windows) < count:
        attempts += 1
        if attempts > 20 * count + 100:
            raise InputError(f"could not cut {count} training windows of {width} tokens from the offline text")
        if len(windows) % 2 == 0:
            key = f"topic:{rng.randrange(len(prose))}"
            text = prose[int(key.split(':')[1])]
        else:
            key = files[rng.randrange(min(len(files), 400))]
            try:
                with open(key, encoding="utf-8") as f:
                    text = f.read(40_000)
            except (OSError, UnicodeDecodeError):
                continue
        if key not in tokens_of:
            tokens_of[key] = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = tokens_of[key]
        if len(ids) < width:
            continue
        start = rng.randrange(len(ids) - width + 1)
        windows.append(ids[start:start + width])
    return windows
