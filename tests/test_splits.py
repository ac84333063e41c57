"""The test prompts never meet train or validation: not whole, not as a 12-word window."""

from collections import Counter

import pytest

from skipkey.quality.overlap import joined, windows
from skipkey.quality.prompts import ORDINARY_PROMPTS, _doc_passages, _stdlib_sources, training_prompts
from skipkey.quality.splits import categories, test_prompts, train_category_prompts

TRAINING_SEEDS = range(8)  # the adapter's rounds used seeds 0..5; a margin for the next ones
TRAINING_COUNT = 1000  # more prompts than any round has drawn (at most 960, seed 4)
CATEGORY_COUNT = 1950  # the training categories' prompts: every one of at most 150 per category, in turn


@pytest.fixture(scope="module")
def test_set():
    return test_prompts()


@pytest.fixture(scope="module")
def training_corpus() -> str:
    """All the text training draws from, as one ' '-joined word stream per document."""
    from pydoc_data.topics import topics

    docs = [p for seed in TRAINING_SEEDS for p in training_prompts(TRAINING_COUNT, seed)]
    docs += [p for seed in TRAINING_SEEDS for p in train_category_prompts(CATEGORY_COUNT, seed)]
    docs += _doc_passages() + list(topics.values())
    for path in _stdlib_sources():
        try:
            with open(path, encoding="utf-8") as f:
                docs.append(f.read(40_000))  # training_text reads this much of each file
        except (OSError, UnicodeDecodeError):
            continue
    return "\n".join(joined(d) for d in docs)


def test_at_least_96_distinct_prompts_over_every_category(test_set):
    assert len(test_set) >= 96 and len(set(test_set)) == len(test_set)
    assert len(categories()) >= 13
    assert {"code_python", "code_javascript", "code_c"} <= set(categories())
    assert test_prompts() == test_set  # seeded


def test_no_test_prompt_or_window_is_in_validation(test_set):
    validation = "\n".join(joined(p) for p in ORDINARY_PROMPTS)
    assert not set(test_set) & set(ORDINARY_PROMPTS)
    leaked = [w for p in test_set for w in windows(p) if w in validation]
    assert not leaked, leaked[:5]


def test_no_test_prompt_or_window_is_in_training_data(test_set, training_corpus):
    leaked = [w for p in test_set for w in windows(p) if w in training_corpus]
    assert not leaked, leaked[:5]


def test_the_window_check_would_catch_a_leak(training_corpus):
    planted = training_prompts(50, 3)[17]
    assert any(w in training_corpus for w in windows(planted))
    assert any(w in joined(ORDINARY_PROMPTS[5]) for w in windows(ORDINARY_PROMPTS[5]))


def test_categories_are_balanced(test_set):
    per = len(test_set) // len(categories())
    assert Counter(len(test_set[i * per:(i + 1) * per]) for i in range(len(categories()))) == {per: len(categories())}


def test_training_category_prompts_cover_the_test_categories_with_other_texts(test_set):
    """Fine-tuning may draw from the test set's categories (not its texts): distinct, seeded, in turn."""
    prompts = train_category_prompts(260, seed=5)
    assert len(set(prompts)) == 260 and prompts == train_category_prompts(260, seed=5) != train_category_prompts(260, 6)
    assert not set(prompts) & (set(test_set) | set(ORDINARY_PROMPTS))
    by_category = [prompts[i::len(categories())] for i in range(len(categories()))]
    assert all(len(c) == 20 for c in by_category)
    assert any("def " in p for p in by_category[categories().index("code_python")])
    assert any("{" in p for p in by_category[categories().index("code_c")])
    with pytest.raises(ValueError, match="cannot make"):
        train_category_prompts(100_000)
