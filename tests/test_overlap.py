"""The overlap check: a 12-word window of a held-out prompt, the whole of a shorter one, or a short text that is a
piece of one, is found wherever it is (case, punctuation and spacing hide nothing), and nothing less is."""

from hypothesis import given, settings
from hypothesis import strategies as st

from skipkey.quality.overlap import MIN_PIECE, WINDOW, HeldOut, joined, windows, words

LONG = ("The committee agreed on Tuesday that the old stone bridge over the river will be rebuilt before the "
        "first snow falls in the valley.")
SHORT = "Who painted the ceiling of the chapel?"


def held_out() -> HeldOut:
    return HeldOut([("7", LONG), ("12", SHORT)])


def test_words_ignore_case_punctuation_and_spacing():
    assert words("Who  played Anna, in 'Once Upon a Time'?") == "who played anna in once upon a time".split()
    assert joined("Ein Bär.") == " ein bär "  # letters beyond ASCII are words too


def test_a_copied_window_is_found_with_its_question_id():
    run = " ".join(words(LONG)[3:3 + WINDOW])
    hit = held_out().find(f"Notes from the meeting. {run.upper()}!! And then lunch.")
    assert hit is not None and hit.question_id == "7" and hit.kind == "window"
    assert hit.shared.split() == words(LONG)[3:3 + WINDOW] and "question 7" in hit.describe()
    fewer = " ".join(words(LONG)[3:3 + WINDOW - 1])  # one word short of a window
    assert held_out().find(f"Notes. {fewer}. Lunch.") is None


def test_a_short_question_is_found_equal_or_whole_inside_a_text_but_not_in_part():
    for text in ("who painted the ceiling of the chapel", "WHO PAINTED THE CEILING OF THE CHAPEL ???",
                 "A long passage about frescoes.\nWho painted the ceiling of the chapel?"):
        hit = held_out().find(text)
        assert hit is not None and hit.question_id == "12" and hit.kind == "whole", text
    assert held_out().find("Who painted the ceiling of the cathedral?") is None
    assert held_out().find("the ceiling of the chapel") is None  # part of it, too short to be a piece


def test_a_short_text_inside_a_held_out_prompt_is_a_piece_of_it_from_six_words():
    piece = "the old stone bridge over the river"  # 7 words of LONG
    hit = held_out().find(piece.title() + "?")
    assert hit is not None and hit.question_id == "7" and hit.kind == "piece" and "inside question 7" in hit.describe()
    assert held_out().find("the old stone bridge over") is None  # 5 words: a common phrase, not a piece
    assert held_out().find("Notes: " + piece + " and the mill.") is None  # a longer text holds no 12-word window


def test_texts_without_words_are_never_held_out():
    index = HeldOut([("1", "?!"), ("2", SHORT)])
    assert index.count == 1 and index.find("...") is None


VOCABULARY = st.sampled_from("a b c d e".split())


@settings(max_examples=300, deadline=None)
@given(tests=st.lists(st.lists(VOCABULARY, min_size=1, max_size=20), min_size=1, max_size=3),
       text=st.lists(VOCABULARY, max_size=40))
def test_the_index_finds_exactly_what_the_window_scan_finds(tests, text):
    """The index (one pass over a text's words) agrees with ``tests/test_splits.py``'s scan, a held-out prompt's
    windows looked for in the text's words, and with its converse for the pieces: a text of 6 to 11 words looked
    for in a prompt's words."""
    prompts, text = [" ".join(t) for t in tests], " ".join(text)
    scan = any(w in joined(text) for p in prompts for w in windows(p))
    piece = MIN_PIECE <= len(words(text)) < WINDOW and any(joined(text) in joined(p) for p in prompts)
    assert (HeldOut((str(i), p) for i, p in enumerate(prompts)).find(text) is not None) == (scan or piece)
