"""Invariants of SkipDecode schedules and layer policies (skipkey/schedules.py)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from skipkey.errors import InputError
from skipkey.schedules import (
    SCHEDULE_KINDS,
    ConstantSchedule,
    ImportanceLayers,
    LinearSchedule,
    PowerLawSchedule,
    SkipPlan,
    TopLayers,
    compute_ratio,
    layer_importance,
    make_schedule,
    nominal_speedup,
    schedule_for_target,
)


@st.composite
def schedules(draw, kind=None):
    """(num_layers, a valid schedule for it)."""
    num_layers = draw(st.integers(1, 40))
    warmup = draw(st.integers(0, min(3, num_layers - 1)))
    b_max = draw(st.integers(warmup + 1, num_layers))
    b_min = draw(st.integers(warmup + 1, b_max))
    horizon = draw(st.integers(0, 150))
    kind = kind or draw(st.sampled_from(SCHEDULE_KINDS))
    if kind == "linear":
        return num_layers, LinearSchedule(b_max, b_min, horizon, warmup=warmup)
    if kind == "power":
        exponent = draw(st.floats(0.1, 8.0))
        return num_layers, PowerLawSchedule(b_max, b_min, horizon, exponent=exponent, warmup=warmup)
    return num_layers, ConstantSchedule(b_min, warmup=warmup)


@st.composite
def plans(draw):
    """A valid SkipPlan, with either policy, and the scores behind an importance ranking."""
    num_layers, schedule = draw(schedules())
    if draw(st.booleans()):
        return SkipPlan(schedule, TopLayers(num_layers, warmup=schedule.warmup), num_layers), None
    scores = draw(st.lists(st.floats(-10, 10), min_size=num_layers, max_size=num_layers))
    pinned = draw(st.sets(st.integers(0, num_layers - 1), max_size=schedule.b_min))
    policy = ImportanceLayers.from_scores(scores, pinned=tuple(pinned))
    return SkipPlan(schedule, policy, num_layers), scores


def horizon_of(schedule):
    return getattr(schedule, "horizon", 0)


# --- budgets -----------------------------------------------------------------


@given(schedules())
def test_budget_never_grows_and_stays_between_b_min_and_b_max(case):
    _, schedule = case
    budgets = [schedule.budget(t) for t in range(horizon_of(schedule) + 5)]
    assert all(later <= earlier for earlier, later in zip(budgets, budgets[1:]))
    assert all(schedule.b_min <= b <= schedule.b_max for b in budgets)
    assert budgets[-1] == schedule.b_min


@given(schedules(kind="linear"))
def test_linear_starts_at_b_max_and_reaches_b_min_at_the_horizon(case):
    _, schedule = case
    if schedule.horizon > 0:
        assert schedule.budget(0) == schedule.b_max
    assert schedule.budget(schedule.horizon) == schedule.b_min
    if schedule.horizon > 1:
        assert schedule.budget(schedule.horizon - 1) >= schedule.b_min


def test_linear_follows_the_papers_formula_with_halves_rounded_up():
    schedule = LinearSchedule(b_max=24, b_min=4, horizon=10)
    assert [schedule.budget(t) for t in (0, 1, 5, 10, 11, 1000)] == [24, 22, 14, 4, 4, 4]
    # 3 - 1 * 1/2 = 2.5: Python's round() would give 2.
    assert LinearSchedule(3, 2, 2).budget(1) == 3


def test_horizon_zero_means_b_min_from_the_first_step():
    for schedule in (LinearSchedule(12, 3, 0), PowerLawSchedule(12, 3, 0)):
        assert [schedule.budget(t) for t in range(4)] == [3, 3, 3, 3]


@given(schedules(kind="power"))
def test_power_law_with_exponent_above_one_never_exceeds_linear(case):
    _, power = case
    power = PowerLawSchedule(power.b_max, power.b_min, power.horizon, exponent=2.0, warmup=power.warmup)
    linear = LinearSchedule(power.b_max, power.b_min, power.horizon, warmup=power.warmup)
    for t in range(power.horizon + 2):
        assert power.budget(t) <= linear.budget(t)


# --- layer sets ---------------------------------------------------------------


@given(plans())
def test_layer_sets_nest_and_have_the_budgets_size(case):
    plan, _ = case
    previous = None
    for t in range(horizon_of(plan.schedule) + 3):
        layers = plan.layer_set(t)
        assert list(layers) == sorted(set(layers))
        assert all(0 <= layer < plan.num_layers for layer in layers)
        assert len(layers) == plan.schedule.budget(t)
        if previous is not None:
            assert set(layers) <= set(previous), f"E({t}) is not inside E({t - 1})"
        previous = layers


@given(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1))), st.data())
def test_top_layers_keep_the_bottom_warmup_and_a_block_at_the_top(sizes, data):
    num_layers, warmup = sizes
    budget = data.draw(st.integers(warmup + 1, num_layers))
    layers = TopLayers(num_layers, warmup=warmup).layers(budget)
    top = [layer for layer in layers if layer >= warmup]
    assert set(range(warmup)) <= set(layers)
    assert top == list(range(num_layers - len(top), num_layers))
    assert len(layers) == budget


def test_top_layers_examples():
    assert TopLayers(8, warmup=1).layers(3) == (0, 6, 7)
    assert TopLayers(8, warmup=0).layers(2) == (6, 7)
    assert TopLayers(8, warmup=2).layers(5) == (0, 1, 5, 6, 7)
    assert TopLayers(8, warmup=1).layers(8) == tuple(range(8))


def test_importance_layers_follow_the_ranking_with_first_and_last_pinned():
    policy = ImportanceLayers.from_scores([0.1, 0.9, 0.3, 0.5, 0.2, 0.05])
    assert policy.pinned == (0, 5)
    assert policy.ranking == (1, 3, 2, 4)
    assert [policy.layers(b) for b in (2, 3, 4, 6)] == [
        (0, 5), (0, 1, 5), (0, 1, 3, 5), (0, 1, 2, 3, 4, 5),
    ]


@given(plans())
def test_importance_layers_keep_pinned_and_the_highest_scored(case):
    plan, scores = case
    if scores is None:
        return
    pinned = set(plan.policy.pinned)
    for t in range(horizon_of(plan.schedule) + 2):
        running = set(plan.layer_set(t))
        assert pinned <= running
        free_running = running - pinned
        free_skipped = set(range(plan.num_layers)) - running
        assert free_running == set(plan.policy.ranking[: len(free_running)])
        if free_running and free_skipped:
            assert min(scores[l] for l in free_running) >= max(scores[l] for l in free_skipped)


def test_importance_layers_accept_a_single_layer_model():
    policy = ImportanceLayers.from_scores([1.0])
    assert policy.pinned == (0,) and policy.layers(1) == (0,)


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
def test_full_budget_runs_every_layer_every_step(kind):
    num_layers = 12
    if kind == "constant":
        schedule = make_schedule(kind, num_layers, layers=num_layers)
    else:
        schedule = make_schedule(kind, num_layers, b_max=num_layers, b_min=num_layers, horizon=20)
    policies = (TopLayers(num_layers), ImportanceLayers.from_scores([float(l % 5) for l in range(num_layers)]))
    for policy in policies:
        plan = SkipPlan(schedule, policy, num_layers)
        assert all(plan.layer_set(t) == tuple(range(num_layers)) for t in range(40))
        assert plan.nominal_speedup(40) == 1.0
        assert plan.compute_ratio(40, layer_cost=1.0, fixed_cost=3.0) == 1.0


# --- importance score ---------------------------------------------------------


def test_layer_importance_is_one_minus_cosine():
    x = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])
    assert layer_importance(x, 3 * x, None) == pytest.approx(0.0, abs=1e-6)
    assert layer_importance(x, -x, None) == pytest.approx(2.0)
    assert layer_importance(x, x.flip(-1), None) == pytest.approx(1.0)


def test_layer_importance_ignores_masked_tokens():
    inputs = torch.randn(2, 5, 8)
    outputs = inputs.clone()
    outputs[0, :2] = -inputs[0, :2]  # padding, left of the prompt
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, :2] = 0
    assert layer_importance(inputs, outputs, mask) == pytest.approx(0.0, abs=1e-6)
    assert layer_importance(inputs, outputs, None) > 0.3


@pytest.mark.parametrize(
    "inputs, outputs, mask, message",
    [
        (torch.zeros(2, 3, 4), torch.zeros(2, 3, 5), None, "batch, seq, hidden"),
        (torch.zeros(3, 4), torch.zeros(3, 4), None, "batch, seq, hidden"),
        (torch.ones(2, 3, 4), torch.ones(2, 3, 4), torch.ones(2, 4), "mask must be"),
        (torch.ones(2, 3, 4), torch.ones(2, 3, 4), torch.zeros(2, 3), "no tokens"),
    ],
)
def test_layer_importance_refuses_bad_shapes(inputs, outputs, mask, message):
    with pytest.raises(InputError, match=message):
        layer_importance(inputs, outputs, mask)


# --- accounting ---------------------------------------------------------------


def test_speedup_and_compute_ratio_by_hand():
    layer_sets = [(0, 1, 2, 3), (0, 3)]
    assert nominal_speedup(layer_sets, 4) == pytest.approx(8 / 6)
    # (4 * 1 + 2) * 2 steps / ((4 + 2) + (2 + 2))
    assert compute_ratio(layer_sets, 4, layer_cost=1.0, fixed_cost=2.0) == pytest.approx(1.2)
    assert compute_ratio(layer_sets, 4, layer_cost=1.0, fixed_cost=0.0) == pytest.approx(8 / 6)


@given(plans(), st.integers(1, 200), st.floats(0.01, 100.0))
def test_compute_ratio_lies_between_one_and_the_nominal_speedup(case, n_steps, fixed_cost):
    plan, _ = case
    nominal = plan.nominal_speedup(n_steps)
    ratio = plan.compute_ratio(n_steps, layer_cost=1.0, fixed_cost=fixed_cost)
    assert 1.0 - 1e-12 <= ratio <= nominal * (1 + 1e-12)


# --- choosing a schedule for a target speedup ---------------------------------


@pytest.mark.parametrize("kind", ["linear", "power"])
@pytest.mark.parametrize("num_layers", [18, 24])
@pytest.mark.parametrize("gen_len", [64, 128])
@pytest.mark.parametrize("target", [1.5, 2.0, 3.0, 5.0])
def test_schedule_for_target_hits_the_target(kind, num_layers, gen_len, target):
    schedule = schedule_for_target(kind, target, num_layers, gen_len)
    plan = SkipPlan(schedule, TopLayers(num_layers), num_layers)
    assert plan.nominal_speedup(gen_len) == pytest.approx(target, rel=0.02)
    assert schedule.b_max == num_layers  # the paper's shape: full depth first


@pytest.mark.parametrize("num_layers", [18, 24])
@pytest.mark.parametrize("target", [1.5, 2.0, 3.0, 5.0])
def test_constant_schedule_for_target_is_the_closest_whole_budget(num_layers, target):
    schedule = schedule_for_target("constant", target, num_layers, 64)
    best = min(abs(num_layers / b - target) for b in range(2, num_layers + 1))
    assert abs(num_layers / schedule.layers - target) == pytest.approx(best)


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
def test_schedule_for_target_reaches_both_ends(kind):
    slowest = schedule_for_target(kind, 1.0, 24, 64)
    assert all(slowest.budget(t) == 24 for t in range(64))
    fastest = schedule_for_target(kind, 12.0, 24, 64, warmup=1)
    assert all(fastest.budget(t) == 2 for t in range(64))


@pytest.mark.parametrize("target", [0.5, 0.99, 12.5, 100.0, math.nan, math.inf, "2"])
def test_schedule_for_target_refuses_what_no_schedule_reaches(target):
    with pytest.raises(InputError, match="from 1 to 12.00"):
        schedule_for_target("linear", target, 24, 64, warmup=1)


# --- refusals -----------------------------------------------------------------

INVALID = [
    (lambda: LinearSchedule(4, 0, 10).validate(8), "b_min must be an integer from 2"),
    (lambda: LinearSchedule(4, 5, 10), r"b_min must be an integer from 2 \(warmup \+ 1\) to 4"),
    (lambda: LinearSchedule(30, 4, 10).validate(24), "b_max must be an integer from 2 .* to 24"),
    (lambda: LinearSchedule(8, 1, 10, warmup=1), "b_min must be an integer from 2"),
    (lambda: LinearSchedule(8, 2, 10, warmup=3), "b_min must be an integer from 4"),
    (lambda: LinearSchedule(8, 2, 10, warmup=-1), "warmup must be an integer >= 0"),
    (lambda: LinearSchedule(8, 2, -1), "horizon must be an integer >= 0"),
    (lambda: LinearSchedule(8, 2.5, 10), "b_min must be an integer from 2"),
    (lambda: LinearSchedule(8.0, 2, 10), "b_max must be an integer >= 2"),
    (lambda: LinearSchedule(8, 2, 3.0), "horizon must be an integer >= 0"),
    (lambda: LinearSchedule(8, True, 10, warmup=0), "b_min must be an integer from 1"),
    (lambda: LinearSchedule(8, 2, 10).budget(-1), "step t must be an integer >= 0"),
    (lambda: PowerLawSchedule(8, 2, 10, exponent=0.0), "exponent must be a finite number > 0"),
    (lambda: PowerLawSchedule(8, 2, 10, exponent=-1.0), "exponent must be a finite number > 0"),
    (lambda: PowerLawSchedule(8, 2, 10, exponent=math.nan), "exponent must be a finite number > 0"),
    (lambda: PowerLawSchedule(8, 2, 10, exponent=math.inf), "exponent must be a finite number > 0"),
    (lambda: PowerLawSchedule(25, 2, 10).validate(24), "b_max must be an integer from 2 .* to 24"),
    (lambda: ConstantSchedule(0), "layers must be an integer >= 2"),
    (lambda: ConstantSchedule(25).validate(24), "layers must be an integer from 2 .* to 24"),
    (lambda: ConstantSchedule(3, warmup=3), "layers must be an integer >= 4"),
    (lambda: make_schedule("cosine", 24), "one of linear, power, constant"),
    (lambda: make_schedule("constant", 24, layers=4, warmup=24), "warmup must be an integer from 0 to 23"),
    (lambda: make_schedule("constant", 24), "needs layers, an integer from 2 to 24"),
    (lambda: make_schedule("constant", 24, layers=4, b_min=2), "takes layers, not"),
    (lambda: make_schedule("linear", 24, b_min=2, horizon=8, layers=4), "not layers"),
    (lambda: make_schedule("linear", 24, horizon=8), "needs b_min, an integer from 2"),
    (lambda: make_schedule("power", 24, b_min=2), "needs horizon, an integer >= 0"),
    (lambda: make_schedule("linear", 24, b_max=25, b_min=2, horizon=8), "b_max must be an integer from 2 .* to 24"),
    (lambda: TopLayers(8, warmup=8), "warmup must be an integer from 0 to 7"),
    (lambda: TopLayers(8, warmup=1).layers(1), "budget .* must be an integer from 2 to 8"),
    (lambda: TopLayers(8, warmup=1).layers(9), "budget .* must be an integer from 2 to 8"),
    (lambda: ImportanceLayers((1, 2), (0, 2)), "exactly once"),
    (lambda: ImportanceLayers((1, 3), (0,)), "exactly once"),
    (lambda: ImportanceLayers((), ()), "exactly once"),
    (lambda: ImportanceLayers((1.0, 2), (0,)), "exactly once"),
    (lambda: ImportanceLayers.from_scores([1.0, math.nan, 2.0]), "finite"),
    (lambda: ImportanceLayers.from_scores([1.0, 2.0], pinned=(2,)), "pinned layer must be an integer from 0 to 1"),
    (lambda: ImportanceLayers.from_scores([1.0, 2.0, 3.0]).layers(1), "budget .* from 2 to 3"),
    (
        lambda: SkipPlan(LinearSchedule(8, 2, 10), ImportanceLayers.from_scores([0.0] * 8, pinned=(0, 1, 7)), 8),
        "runs 3 to 8 layers a step, but the schedule .* asks for 2 to 8",
    ),
    (lambda: SkipPlan(LinearSchedule(8, 2, 10), TopLayers(12), 8), "for 12 layers, the model has 8"),
    (lambda: SkipPlan(LinearSchedule(12, 2, 10), TopLayers(8), 8), "b_max must be an integer from 2 .* to 8"),
    (lambda: SkipPlan(LinearSchedule(8, 3, 10, warmup=2), TopLayers(8), 8), "warm-up .* must be the same"),
    (lambda: SkipPlan(ConstantSchedule(4), TopLayers(8), 8).nominal_speedup(0), "n_steps must be an integer >= 1"),
    (lambda: nominal_speedup([], 8), "at least one generation step"),
    (lambda: compute_ratio([(0, 1)], 2, layer_cost=0.0, fixed_cost=1.0), "layer_cost must be > 0"),
    (lambda: compute_ratio([(0, 1)], 2, layer_cost=1.0, fixed_cost=-1.0), "fixed_cost >= 0"),
    (lambda: schedule_for_target("exp", 2.0, 24, 64), "one of linear, power, constant"),
    (lambda: schedule_for_target("linear", 2.0, 24, 0), "gen_len must be an integer >= 1"),
]


@pytest.mark.parametrize("build, message", INVALID)
def test_invalid_input_is_refused_with_the_allowed_range(build, message):
    with pytest.raises(InputError, match=message):
        build()


def test_describe_names_the_parameters():
    assert LinearSchedule(24, 4, 64).describe() == "linear: 24 -> 4 layers over 64 steps, warm-up 1"
    assert "exponent 2" in PowerLawSchedule(24, 4, 64).describe()
    assert "6 layers" in ConstantSchedule(6).describe()
