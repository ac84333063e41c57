"""Three prompt sets, never mixed: train, validation and test.

* **train**: ``prompts.training_prompts`` and ``prompts.training_text`` (topic
  templates, code openers, Python's help topics and standard-library source), with
  continuations from the full model; what fine-tuning sees.
* **validation**: ``prompts.ORDINARY_PROMPTS``, 48 hand-written everyday openings.
  Every setting is chosen on them: the shape study, option tuning, early stopping.
* **test**: ``test_prompts()``, made here by a different generator (its own
  categories, templates and vocabulary) and used only for reported figures.

``tests/test_splits.py`` fails if a test prompt, or any 12-word window of one,
appears in train or validation.
"""

from __future__ import annotations

import random

TEST_SEED = 20261204
PER_CATEGORY = 8


def _pick(rng: random.Random, options: list[str], taken: set[str]) -> str:
    free = [o for o in options if o not in taken]
    choice = rng.choice(free or options)
    taken.add(choice)
    return choice


# Each category: templates with {a}/{b} slots and the words that fill them. Nothing here is copied from the
# validation prompts or the training templates.
_CATEGORIES: dict[str, tuple[list[str], list[str], list[str]]] = {
    "prose": ([
        "The lighthouse keeper had not spoken to anyone in {a} when",
        "It was the last train out of {b}, and the carriage smelled of",
        "Nobody in the family remembered why the {a} clock had stopped, but",
        "She opened the letter from {b} slowly, because she already knew",
    ], ["three weeks", "eleven days", "a whole winter", "two months", "grandfather's"],
        ["Lisbon", "Krakow", "the capital", "Glasgow", "Osaka", "the old harbour"]),
    "dialogue": ([
        "Teacher: Who can explain why {a}?\nStudent:",
        "Pilot: Tower, we are seeing {b} on approach.\nTower:",
        "Mother: You have been on that phone since {a}.\nTeenager:",
        "Detective: Where were you on the night of {b}?\nSuspect:",
    ], ["the moon changes shape", "ice floats on water", "leaves turn red", "lunch", "the sky looks blue"],
        ["the fourteenth", "light turbulence", "a flock of geese", "the storm", "the gala"]),
    "letters": ([
        "Dear Professor {b},\n\nI am a second-year student and I would like to ask whether",
        "To the residents of {a} Street,\n\nWe are writing to let you know that",
        "Dear Aunt {b},\n\nThe parcel arrived yesterday and",
        "Dear members of the {a} club,\n\nThis year our annual dinner will",
    ], ["Maple", "Birch", "chess", "rowing", "Orchard", "photography"],
        ["Okafor", "Lindqvist", "Moreau", "Helen", "Ruth", "Tanaka"]),
    "email": ([
        "Subject: {a} moved to Thursday\n\nHi team,\n\n",
        "Subject: Question about invoice {b}\n\nHello,\n\nI noticed that",
        "Subject: Welcome aboard!\n\nHi {b},\n\nWe are thrilled that you are joining",
        "Subject: Out of office until {a}\n\nThank you for your message.",
    ], ["the design review", "the quarterly planning", "Monday", "the budget sync", "the 12th"],
        ["4471", "A-2093", "Priya", "Jonas", "889-B", "Marta"]),
    "instructions": ([
        "How to repot a {a} without hurting its roots:\n1.",
        "Assembly instructions for the {b}. Before you begin, make sure",
        "To reset your router to factory settings, {a}",
        "Safety briefing for the {b}: first, locate the nearest",
    ], ["cactus", "fern", "small orchid", "first press and hold", "snake plant"],
        ["bookshelf", "climbing wall", "laboratory", "wooden desk", "kayak trip"]),
    "recipes": ([
        "Recipe: {a} with lemon and garlic.\nIngredients:\n-",
        "My grandmother's {b} takes an hour, but the secret is",
        "Quick {a} for two people. Start by heating",
        "Vegan {b} (serves four). Method:",
    ], ["roast chicken", "grilled salmon", "pan-fried tofu", "baked cod", "stir-fried prawns"],
        ["lentil stew", "apple crumble", "vegetable curry", "mushroom risotto", "banana bread"]),
    "lists": ([
        "Ten books every {a} should read:\n1.",
        "Checklist before moving to {b}:\n[ ]",
        "Reasons to visit {b} in autumn:\n*",
        "Things I learned in my first year as a {a}:\n-",
    ], ["teacher", "software engineer", "nurse", "gardener", "carpenter"],
        ["a new city", "Norway", "Vietnam", "a smaller flat", "Chile", "Morocco"]),
    "code_python": ([
        "def {a}(values):\n    \"\"\"Return the",
        "import json\n\n\ndef load_{b}(path):\n",
        "class {b}Cache:\n    def __init__(self, capacity):\n",
        "# Count how often each word appears in {a}\nfrom collections import Counter\n\n",
    ], ["running_median", "normalise_scores", "moving_average", "a text file", "dedupe_sorted"],
        ["settings", "Session", "Thumbnail", "orders", "Route"]),
    "code_javascript": ([
        "async function fetch{b}(id) {{\n  const response = await",
        "// Toggle the {a} when the button is clicked\ndocument.querySelector(",
        "export function format{b}(value) {{\n",
        "const {a} = items\n  .filter(",
    ], ["menu", "dark mode", "totals", "sidebar", "activeUsers"],
        ["User", "Price", "Weather", "Invoice", "Duration"]),
    "code_c": ([
        "/* Reverse a singly linked list in place. */\nstruct node *reverse(struct node *head) {{\n",
        "#include <stdlib.h>\n\n/* Allocate a {a} of n doubles, zeroed. */\n",
        "int count_{b}(const char *s) {{\n    int n = 0;\n",
        "static void swap_{b}(int *a, int *b) {{\n",
    ], ["buffer", "matrix row", "vector", "ring buffer", "table"],
        ["vowels", "spaces", "digits", "ints", "words"]),
    "factual": ([
        "Q: Why do {a}?\nA:",
        "Q: What is the difference between {b}?\nA:",
        "Question: How does {a} work?\nAnswer:",
        "Explain in simple terms what {b} means.",
    ], ["cats purr", "onions make people cry", "planes stay in the air", "a refrigerator", "vaccines"],
        ["weather and climate", "a comet and an asteroid", "inflation", "a simile and a metaphor",
         "interest and dividends"]),
    "news": ([
        "{b} (Reuters) - Officials announced on Wednesday that",
        "Local council approves plan for new {a}. The decision, which came after",
        "Scientists in {b} have discovered a new species of",
        "The city's {a} will close for repairs next month, affecting",
    ], ["cycle lanes", "public swimming pool", "bus depot", "main bridge", "central library"],
        ["Nairobi", "Oslo", "Brisbane", "Lima", "Toronto", "Hanoi"]),
    "technical": ([
        "A hash table resolves collisions by {a}",
        "In a distributed database, {b} guarantees that",
        "The {b} protocol establishes a connection by",
        "To reduce memory use in a web server, {a}",
    ], ["chaining entries in a list", "open addressing", "we can pool buffers", "linear probing"],
        ["strong consistency", "the two-phase commit", "QUIC", "eventual consistency", "Raft"]),
}


def test_prompts(per_category: int = PER_CATEGORY, seed: int = TEST_SEED) -> list[str]:
    """The test set: ``per_category`` prompts from each of 13 categories, distinct and seeded.

    Categories: prose, dialogue, letters, email, instructions, recipes, lists, code in
    three languages (Python, JavaScript, C), factual questions, news and technical text.
    """
    rng = random.Random(seed)
    prompts: list[str] = []
    for category in _CATEGORIES:
        templates, first, second = _CATEGORIES[category]
        made: set[str] = set()
        taken: set[str] = set()
        attempts = 0
        while len(made) < per_category:
            attempts += 1
            if attempts > 200 * per_category:
                raise ValueError(f"category {category} cannot make {per_category} distinct prompts")
            prompt = rng.choice(templates).format(a=_pick(rng, first, taken), b=_pick(rng, second, taken))
            if prompt not in made:
                made.add(prompt)
                prompts.append(prompt)
    return prompts


def categories() -> tuple[str, ...]:
    return tuple(_CATEGORIES)


test_prompts.__test__ = False  # a generator, not a pytest test


# The train side of the same 13 categories: other templates and other words, so fine-tuning sees the kinds of
# text the test set asks about without seeing its texts (``tests/test_splits.py`` checks every 12-word window).
_TRAIN_CATEGORIES: dict[str, tuple[list[str], list[str], list[str]]] = {
    "prose": ([
        "The {a} had been empty for years, until one morning in {b}",
        "Every summer we drove to {b}, and every summer my father insisted that",
        "He found the {a} under the floorboards of the house in {b}.",
        "By the time the snow reached {b}, the {a} had",
        "Outside the bakery in {b}, an old man was feeding",
    ], ["cottage", "photograph", "old violin", "garden shed", "music box", "map", "diary", "lantern"],
        ["Dublin", "Valparaiso", "a mountain village", "Seville", "the coast", "Tromso", "Marrakesh", "Quebec"]),
    "dialogue": ([
        "Customer: I ordered {a} last week and it still has not arrived.\nAgent:",
        "Coach: We lost because of {b}.\nPlayer:",
        "Doctor: How long have you had {a}?\nPatient:",
        "Interviewer: Tell me about a time you {b}.\nCandidate:",
        "A: Did you remember to bring {a}?\nB:",
    ], ["a blue sweater", "this cough", "the tickets", "a pair of boots", "the headaches", "the charger"],
        ["the second half", "handled a conflict", "missed a deadline", "poor passing", "led a project",
         "the weather"]),
    "letters": ([
        "Dear Mr {b},\n\nThank you for your letter of {a}. I am pleased to",
        "Dear neighbours,\n\nAs many of you know, the {a} on our street",
        "My dear {b},\n\nIt has been far too long since I last wrote, and",
        "To whom it may concern,\n\nI am writing to recommend {b}, who",
        "Dear Editor,\n\nI read your article about the {a} with great interest, but",
    ], ["12 March", "old oak tree", "community garden", "last Tuesday", "new parking rules", "playground"],
        ["Adebayo", "Fischer", "Costa", "Eleanor", "Samuel", "Nakamura", "Ingrid", "Patel"]),
    "email": ([
        "Subject: Follow-up on {a}\n\nHi {b},\n\nThanks again for",
        "Subject: Server maintenance tonight\n\nDear {b},\n\nPlease be aware that",
        "Subject: Draft of {a} attached\n\nHello,\n\nAttached is",
        "Subject: Can we reschedule?\n\nHi {b},\n\nSomething came up and",
        "Subject: Lunch on {a}?\n\nHey,\n\n",
    ], ["the contract", "yesterday's call", "the grant proposal", "Friday", "the slides", "the launch plan"],
        ["Amara", "Lukas", "everyone", "Sofia", "Dev team", "Mr Hughes", "Yuki", "Carlos"]),
    "instructions": ([
        "How to change a bicycle {a}:\nStep 1:",
        "Before using the {b} for the first time, read these instructions carefully.",
        "To clean a {a}, you will need warm water, a soft cloth and",
        "Installing the {b}: unpack all the parts and check that",
        "Follow these steps to back up your {a}:\n1.",
    ], ["tyre", "chain", "cast iron pan", "phone", "laptop", "leather jacket", "photo library"],
        ["pressure cooker", "ceiling fan", "espresso machine", "garden hose reel", "dishwasher", "baby monitor"]),
    "recipes": ([
        "Ingredients for {a}:\n- 2 cups of",
        "This {b} is ready in twenty minutes. First, chop",
        "Method for a classic {a}:\n1. Preheat the oven to",
        "The trick to a good {b} is patience. Begin by",
        "Easy weeknight {a} (serves two):\n",
    ], ["pancakes", "tomato soup", "chocolate cake", "shepherd's pie", "lemon tart", "flatbread"],
        ["omelette", "chickpea salad", "beef stew", "pesto pasta", "fried rice", "pumpkin soup"]),
    "lists": ([
        "Five habits of successful {a}:\n1.",
        "What to pack for a week in {b}:\n-",
        "Top tips for new {a}:\n*",
        "Our favourite things to do in {b}:\n1.",
        "Mistakes to avoid as a beginner {a}:\n-",
    ], ["students", "runners", "managers", "photographers", "parents", "writers", "cooks"],
        ["Iceland", "Japan", "the mountains", "Portugal", "Scotland", "Peru", "the desert"]),
    "code_python": ([
        "def {a}(items, key=None):\n",
        "from dataclasses import dataclass\n\n\n@dataclass\nclass {b}:\n",
        "import csv\n\n\ndef read_{b}(filename):\n    \"\"\"",
        "def test_{a}():\n    result =",
        "with open('{b}.txt') as handle:\n    for line in handle:\n",
    ], ["group_by", "flatten", "chunked", "top_n", "parse_date", "merge_dicts", "retry"],
        ["Point", "records", "Config", "inventory", "Order", "log", "Employee"]),
    "code_javascript": ([
        "function {a}(list) {{\n  return list",
        "const {b}Service = {{\n  async getAll() {{\n",
        "// Debounce the {a} handler\nlet timer;\n",
        "class {b}Store {{\n  constructor() {{\n",
        "app.get('/api/{a}', async (req, res) => {{\n",
    ], ["sumValues", "uniqueIds", "search", "resize", "orders", "users"],
        ["Cart", "Todo", "Session", "Product", "Message", "Profile"]),
    "code_c": ([
        "/* Return the length of a string without strlen. */\nsize_t {a}(const char *s) {{\n",
        "#include <stdio.h>\n\nint main(void) {{\n    FILE *f = fopen(\"{b}.txt\", \"r\");\n",
        "typedef struct {{\n    int {a};\n",
        "/* Binary search in a sorted array of {b}. */\nint find(const int *xs, int n, int x) {{\n",
        "void print_{b}(const int *xs, int n) {{\n    for (int i = 0;",
    ], ["my_strlen", "capacity", "str_length", "count", "width"],
        ["scores", "ids", "data", "values", "ages"]),
    "factual": ([
        "Q: How far is {b} from the Sun?\nA:",
        "Q: What causes {a}?\nA:",
        "Question: Who invented {b}?\nAnswer:",
        "Why is {a} important for the body?",
        "What is {b}, and how is it measured?",
    ], ["thunder", "sleep", "tides", "the seasons", "calcium", "earthquakes", "rainbows"],
        ["Mars", "the telephone", "Jupiter", "the printing press", "humidity", "the light bulb"]),
    "news": ([
        "{b} - Heavy rain caused flooding across the region on Monday, and",
        "The {a} announced its quarterly results today, reporting",
        "Thousands gathered in {b} on Saturday to",
        "A new study published this week suggests that {a}",
        "{b} - The national team secured a late victory after",
    ], ["city council", "largest bank", "airline", "regular exercise", "coffee drinkers", "tech company"],
        ["Madrid", "Cairo", "Sydney", "Montreal", "Jakarta", "Dakar", "Helsinki"]),
    "technical": ([
        "A B-tree keeps its data sorted by {a}",
        "When a process calls fork(), the operating system {a}",
        "{b} is a caching strategy in which",
        "The main difference between TCP and UDP is that {a}",
        "In machine learning, {b} refers to",
    ], ["splitting full nodes", "copies the page tables", "one guarantees delivery", "merging siblings",
        "marks pages copy-on-write"], ["Write-through", "Overfitting", "Regularisation", "Write-back",
                                       "Least recently used", "Gradient descent"]),
}
TRAIN_CATEGORIES_VERSION = 1  # bump when the training categories change, so cached training data is rebuilt

# What may precede a training prompt (a heading, a scene, a file name): one more axis of variety, so a few
# thousand distinct prompts come from the templates above without numbering them.
_TRAIN_OPENINGS: dict[str, list[str]] = {
    "prose": ["", "Chapter One\n\n", "Part II\n\n", "* * *\n\n", "The Visitor\n\n", "Prologue\n\n"],
    "dialogue": ["", "Scene: a busy office.\n", "Transcript, recorded at 9:14.\n", "Scene: a small kitchen.\n",
                 "(Phone call)\n", "Scene: the waiting room.\n"],
    "letters": ["", "14 Elm Road\nBristol\n\n", "3 May\n\n", "Flat 2, Harbour View\n\n", "Sunday evening\n\n",
                "PRIVATE\n\n"],
    "email": ["", "From: office@example.org\n", "To: all-staff\n", "Priority: high\n", "Reply-To: help@example.com\n",
              "Cc: finance\n"],
    "instructions": ["", "Tools needed: a screwdriver.\n\n", "Difficulty: easy.\n\n", "Time: 30 minutes.\n\n",
                     "Read this first.\n\n", "Warning: unplug the device.\n\n"],
    "recipes": ["", "From the family cookbook:\n\n", "Prep time: 15 minutes.\n\n", "A winter favourite.\n\n",
                "Budget friendly.\n\n", "Gluten free.\n\n"],
    "lists": ["", "Updated for this year.\n\n", "A short guide.\n\n", "From our readers.\n\n",
              "Print this out.\n\n", "In no particular order.\n\n"],
    "code_python": ["", "# utils.py\n", "#!/usr/bin/env python3\n", "# -*- coding: utf-8 -*-\n",
                    "# helpers for the report job\n", "# SPDX-License-Identifier: MIT\n"],
    "code_javascript": ["", "'use strict';\n\n", "// utils.js\n", "/* eslint-disable no-console */\n",
                        "// @ts-check\n", "// helpers for the dashboard\n"],
    "code_c": ["", "/* util.c */\n", "#include <string.h>\n\n", "/* SPDX-License-Identifier: MIT */\n",
               "#include <stdint.h>\n\n", "/* helpers for the parser */\n"],
    "factual": ["", "Science quiz.\n\n", "Homework help.\n\n", "From the FAQ:\n\n", "Ask an expert.\n\n",
                "General knowledge.\n\n"],
    "news": ["", "BREAKING: ", "Updated 10:42. ", "World news. ", "Local news. ", "Business. "],
    "technical": ["", "Lecture notes, week 4.\n\n", "Interview question.\n\n", "Glossary.\n\n",
                  "From the design document:\n\n", "Study guide.\n\n"],
}
assert set(_TRAIN_CATEGORIES) == set(_CATEGORIES) == set(_TRAIN_OPENINGS)


def train_category_prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct training prompts over the test set's categories (in turn), seeded, from other
    templates, words and openings than the test set's (about 4,000 distinct in all, at least 150 per category)."""
    rng = random.Random(seed)
    names = list(_TRAIN_CATEGORIES)
    made: set[str] = set()
    prompts: list[str] = []
    exhausted = 0
    while len(prompts) < count:
        name = names[len(prompts) % len(names)]
        templates, first, second = _TRAIN_CATEGORIES[name]
        prompt = rng.choice(_TRAIN_OPENINGS[name]) + rng.choice(templates).format(a=rng.choice(first),
                                                                                  b=rng.choice(second))
        if prompt in made:
            exhausted += 1
            if exhausted > 100_000:
                raise ValueError(f"the training categories cannot make {count} distinct prompts")
            continue
        made.add(prompt)
        prompts.append(prompt)
    return prompts
