"""What exact decoding drafts, cycle by cycle: prompt lookup, the measured costs, and the paces that use them."""

import numpy as np
import pytest

from skipkey.skipdecode.drafting import (MAX_WAIT, Calibration, Experience, FixedPace, MeasuredPace, PromptLookup,
                                         StepCosts)


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    lookup = PromptLookup(max_ngram=3)
    text = np.array([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7])
    # "5 6 7" occurred at the start and was followed by 8 9 1; "6 7" later by 2 3: the longest match wins.
    assert lookup.propose(text, 3) == ((8, 9, 1), 3)
    assert lookup.propose(np.array([1, 2, 3, 4, 2, 9, 4]), 2) == ((2, 9), 1)  # only "4" recurs: latest match
    assert lookup.propose(np.array([1, 2, 3]), 4) == ((), 0)
    assert lookup.propose(np.array([4, 4]), 3) == ((4,), 1)  # the match's continuation may reach the tail


def test_prompt_lookup_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    lookup = PromptLookup(max_ngram=3)
    for _ in range(200):
        text = rng.integers(0, 4, size=rng.integers(2, 30))
        got = lookup.propose(text, 4)
        want = ((), 0)
        for n in (3, 2, 1):
            if n >= len(text):
                continue
            tail = list(text[len(text) - n:])
            found = [i for i in range(len(text) - n) if list(text[i:i + n]) == tail]
            if found:
                want = (tuple(int(t) for t in text[found[-1] + n: found[-1] + n + 4]), n)
                break
        assert got == want


def costs(plain=1.0, per_token=0.04, draft=0.35) -> Experience:
    measured = StepCosts()
    for q in range(1, 10):
        measured.observe_verify(q, plain * (1 + per_token * (q - 1)))
    measured.observe_draft(7, draft * plain)
    return Experience(costs=measured)


def probe_steps(pace: MeasuredPace, accepted: int, steps: int = 400) -> list[int]:
    """The cycles at which ``pace`` drafted, each draft one token whose verify accepted ``accepted``."""
    probes = []
    for step in range(steps):
        cycle = pace.choose(cap=50, proposals=None, depth=7)
        if cycle.source == "layers":
            probes.append(step)
            pace.keep_drafting(1, 0.9)
            pace.observe(cycle, [0.9], accepted=accepted)
    return probes


def test_step_costs_extrapolate_from_what_was_measured():
    measured = StepCosts()
    measured.observe_verify(4, 1.12)
    assert measured.verify_s(4) == 1.12
    assert measured.verify_s(1) == pytest.approx(1.12 / 1.12)  # the prior slope until a plain step is seen
    measured.observe_verify(1, 1.0)
    assert measured.verify_s(7) == pytest.approx(1.0 + 6 * 0.04)  # now the measured slope
    assert measured.draft_s(7, 18) == pytest.approx(0.3 + 0.7 * 7 / 18)  # no draft yet: a share of a plain step
    measured.observe_verify(9, 1.3)  # the cost need not be linear: between measured counts, the larger one's
    assert measured.verify_s(2) == 1.12 and measured.verify_s(5) == 1.3
    assert measured.verify_s(11) == pytest.approx(1.3 + 2 * (1.3 - 1.12) / 5)


def test_probes_that_are_accepted_but_do_not_pay_come_less_and_less_often():
    measured = StepCosts()
    for q, seconds in ((1, 1.0), (2, 1.9), (4, 2.1)):  # a second verified token costs most of a plain step
        measured.observe_verify(q, seconds)
    measured.observe_draft(7, 0.3)
    probes = probe_steps(MeasuredPace(4, None, Experience(costs=measured), layers=18), accepted=1)  # 2 tokens, 2.2 steps
    assert len(probes) < 40 and list(np.diff(probes)[-5:]) == [MAX_WAIT + 1] * 5


def test_a_draft_that_is_never_accepted_falls_back_to_plain_steps_and_probes_less_and_less():
    probes = probe_steps(MeasuredPace(4, None, costs(), layers=18), accepted=0)
    gaps = np.diff(probes)
    assert len(probes) < 60  # mostly plain steps
    assert gaps.max() == MAX_WAIT + 1 and list(gaps[-5:]) == [MAX_WAIT + 1] * 5


def test_a_draft_that_is_always_accepted_keeps_drafting_at_full_length():
    pace = MeasuredPace(4, None, costs(), layers=18)
    lengths = []
    plain = 0
    for _ in range(50):
        cycle = pace.choose(cap=50, proposals=None, depth=7)
        if cycle.source != "layers":  # a plain step now and then keeps its cost measured
            plain += 1
            continue
        drafted = 0
        for j in range(1, cycle.count + 1):
            drafted = j
            if j < cycle.count and not pace.keep_drafting(j, 0.95):
                break
        pace.observe(cycle, [0.95] * drafted, accepted=drafted)
        lengths.append(drafted)
    assert lengths[-10:] == [4] * 10 and plain == 50 // (MAX_WAIT + 1)


def test_drafting_stops_when_the_next_token_is_not_worth_its_cost():
    pace = MeasuredPace(8, None, costs(draft=0.35), layers=18)
    pace.choose(cap=50, proposals=None, depth=7)
    assert pace.keep_drafting(1, 0.95)
    assert not pace.keep_drafting(1, 0.2)  # a 20% token: the next one's expected gain is below a draft step's cost


def test_lookup_proposals_are_taken_when_they_pay_and_cut_to_what_pays():
    pace = MeasuredPace(4, PromptLookup(), costs(), layers=18)
    pace.draft.first.value, pace.wait = 0.1, 5  # the SkipDecode draft is not paying here, and no probe is due
    proposal = [((11, 12, 13, 14, 15, 16), 3)]
    cycle = pace.choose(cap=50, proposals=proposal, depth=7)
    assert cycle.source == "lookup" and cycle.tokens[0] == (11, 12, 13, 14, 15, 16)[: cycle.count]
    for _ in range(20):  # lookup that is never right: its rate falls until plain steps win
        pace.observe(cycle, [], accepted=0)
    assert pace.choose(cap=50, proposals=proposal, depth=7).source == "plain"


def test_agreement_learns_the_first_token_and_the_run_after_it():
    from skipkey.skipdecode.drafting import Agreement

    source = Agreement(0.5, 0.5)
    assert source.expected(3) == pytest.approx(0.5 + 0.25 + 0.125)
    for _ in range(50):
        source.observe(4, 4)  # every proposal copied whole
    assert source.first.value > 0.99 and source.later.value > 0.99 and source.expected(4) > 3.9
    before = source.later.value
    source.observe(4, 0)  # the first token rejected: nothing after it was judged
    assert source.first.value < 0.8 and source.later.value == before


def test_what_a_run_learns_is_where_the_next_run_starts():
    experience = costs()
    pace = MeasuredPace(4, None, experience, layers=18)
    for _ in range(30):
        cycle = pace.choose(cap=50, proposals=None, depth=7)
        if cycle.source == "layers":
            pace.keep_drafting(1, 0.9)
            pace.observe(cycle, [0.9], accepted=0)
    later = MeasuredPace(4, None, experience, layers=18)
    assert later.draft.first.value < 0.2 and later.calibration.chance(0.9) < 0.6  # from 0.6 and 0.95


def test_calibration_learns_how_often_a_probability_is_right():
    calibration = Calibration()
    assert calibration.chance(0.85) == pytest.approx(0.85)
    for _ in range(200):
        calibration.observe([0.85], accepted=0)
    assert calibration.chance(0.85) < 0.1
    calibration.observe([0.95, 0.95, 0.95], accepted=1)  # the third token was never judged
    assert calibration.seen.sum() == pytest.approx(10 * 4 + 200 + 2)
    for _ in range(2000):  # old evidence is halved: a bin weighs at most CALIBRATION_MEMORY tokens
        calibration.observe([0.85], accepted=1)
    assert calibration.chance(0.85) > 0.9


def test_the_fixed_pace_drafts_k_every_cycle():
    pace = FixedPace(3, None, costs(), layers=18)
    for _ in range(5):
        cycle = pace.choose(cap=10, proposals=None, depth=7)
        assert (cycle.source, cycle.count) == ("layers", 3)
        pace.observe(cycle, [0.1] * 3, accepted=0)
    assert pace.choose(cap=2, proposals=None, depth=7).count == 2
    assert pace.choose(cap=0, proposals=None, depth=7).source == "plain"
