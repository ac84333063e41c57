"""The prompts SkipKey measures and trains on, all generated in code or read from Python's own text.

* evaluation: ``ORDINARY_PROMPTS`` (held out from training), documents to
  continue and long real text for perplexity (all the long text is Python's help
  topics, ``help_topics``); the retrieval tasks, built on the same help text, are
  ``skipkey.quality.retrieval``;
* training: ``training_prompts``, seeded and varied, never one of the held-out ones.
"""

from __future__ import annotations

import functools
import gzip
import json
import random
from pathlib import Path

from skipkey.errors import InputError

# CPython 3.11.7's pydoc_data.topics, with its source and licence: each Python release regenerates its help
# topics (3.10's, 3.12's and later 3.11s' differ), so reading the running interpreter's would give another
# Python other prompts, retrieval tasks and training text than the ones every committed result was measured on.
HELP_TOPICS_FILE = Path(__file__).with_name("help_topics.json.gz")

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


@functools.lru_cache(maxsize=1)
def help_topics() -> dict[str, str]:
    """Python's help topics (``HELP_TOPICS_FILE``): topic name -> text, the same on every Python."""
    with gzip.open(HELP_TOPICS_FILE, "rt", encoding="utf-8") as f:
        return json.load(f)["topics"]


# -- evaluation ---------------------------------------------------------------------------------
def long_text_ids(tokenizer, tokens: int) -> list[int]:
    """Real English prose: Python's help topics, concatenated."""
    topics = help_topics()
    text = "\n\n".join(topics[k] for k in sorted(topics))
    return tokenizer(text, add_special_tokens=True)["input_ids"][:tokens]


def document_prompts(tokenizer, count: int, tokens: int) -> list[str]:
    """``count`` ordinary documents cut to about ``tokens`` tokens each, to be continued.

    Python's help topics, taken from the end of the list so
    they do not overlap the long-text perplexity passage, which starts at its head.
    The KV budget is a share of the prompt, so agreement needs prompts long enough
    for a budget to mean something: 25% of a 10-token prompt keeps two tokens.
    """
    topics = help_topics()
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
    """Prose paragraphs of Python's help topics."""
    topics = help_topics()
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

    Alternately Python's help topics (prose, ``help_topics``) and the standard
    library's source (code and docstrings), each window from a random place in a
    random document. None of it is a held-out prompt (``ORDINARY_PROMPTS``), which
    are short everyday openings the standard library does not contain. The source is
    the running interpreter's, so the code windows (not the prose) differ between Pythons.
    """
    topics = help_topics()
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
