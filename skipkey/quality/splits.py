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
