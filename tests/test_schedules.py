"""Invariants of SkipDecode schedules and layer policies (skipkey/skipdecode/schedules.py)."""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skipkey.core.importance import layer_importance
from skipkey.errors import InputError
from skipkey.skipdecode.schedules import (
    MEASURED_SHAPES,
    PAPER_SHAPE,
    SCHEDULE_KINDS,
    ConstantSchedule,
    LinearSchedule,
    PowerLawSchedule,
    ScheduleShape,
    make_schedule,
    measured_best_shape,
    schedule_for_target,
    shapes_from_json,
    shapes_to_json,
)
from skipkey.skipdecode.rankings import ImportanceLayers, SkipPlan, TopLayers, compute_ratio, nominal_speedup


@st.composite
def schedules(draw, kind=None):
    """(num_layers, a valid schedule for it)."""
    num_layers = draw(st.integers(1, 40))
    warmup = draw(st.integers(0, min(3, num_layers - 1)))
    b_max = draw(st.integers(warmup + 1, num_layers))
    b_min = draw(st.integers(warmup + 1, b_max))
    horizon = draw(st.integers(0, 150))
    hold = draw(st.sampled_from([0, 0, draw(st.integers(1, 60))]))  # the paper's 0 half the time
    kind = kind or draw(st.sampled_from(SCHEDULE_KINDS))
    if kind == "linear":
        return num_layers, LinearSchedule(b_max, b_min, horizon, warmup=warmup, hold=hold)
    if kind == "power":
        exponent = draw(st.floats(0.1, 8.0))
        return num_layers, PowerLawSchedule(b_max, b_min, horizon, exponent=exponent, warmup=warmup, hold=hold)
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
    """The step at which the decay is over: after the hold and the horizon."""
    return getattr(schedule, "hold", 0) + getattr(schedule, "horizon", 0)


# --- budgets -----------------------------------------------------------------


@given(schedules())
def test_budget_never_grows_and_stays_between_b_min_and_b_max(case):
    _, schedule = case
    budgets = [schedule.depth(t) for t in range(horizon_of(schedule) + 5)]
    assert all(later <= earlier for earlier, later in zip(budgets, budgets[1:]))
    assert all(schedule.b_min <= b <= schedule.b_max for b in budgets)
    assert budgets[-1] == schedule.b_min


@given(schedules(kind="linear"))
def test_linear_starts_at_b_max_and_reaches_b_min_at_the_horizon(case):
    _, schedule = case
    if schedule.horizon > 0 or schedule.hold > 0:
        assert schedule.depth(0) == schedule.b_max
    assert all(schedule.depth(t) == schedule.b_max for t in range(schedule.hold))
    assert schedule.depth(horizon_of(schedule)) == schedule.b_min
    if schedule.horizon > 1:
        assert schedule.depth(horizon_of(schedule) - 1) >= schedule.b_min


def test_linear_follows_the_papers_formula_with_halves_rounded_up():
    schedule = LinearSchedule(b_max=24, b_min=4, horizon=10)
    assert [schedule.depth(t) for t in (0, 1, 5, 10, 11, 1000)] == [24, 22, 14, 4, 4, 4]
    # 3 - 1 * 1/2 = 2.5: Python's round() would give 2.
    assert LinearSchedule(3, 2, 2).depth(1) == 3


def test_horizon_zero_means_b_min_from_the_first_step():
    for schedule in (LinearSchedule(12, 3, 0), PowerLawSchedule(12, 3, 0)):
        assert [schedule.depth(t) for t in range(4)] == [3, 3, 3, 3]


@given(schedules(kind="power"))
def test_power_law_with_exponent_above_one_never_exceeds_linear(case):
    _, power = case
    power = PowerLawSchedule(power.b_max, power.b_min, power.horizon, exponent=2.0, warmup=power.warmup)
    linear = LinearSchedule(power.b_max, power.b_min, power.horizon, warmup=power.warmup)
    for t in range(power.horizon + 2):
        assert power.depth(t) <= linear.depth(t)


# --- layer sets ---------------------------------------------------------------


@given(plans())
def test_layer_sets_nest_and_have_the_budgets_size(case):
    plan, _ = case
    previous = None
    for t in range(horizon_of(plan.schedule) + 3):
        layers = plan.layer_set(t)
        assert list(layers) == sorted(set(layers))
        assert all(0 <= layer < plan.num_layers for layer in layers)
        assert len(layers) == plan.schedule.depth(t)
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
    pinned = set(plan.order.pinned)
    for t in range(horizon_of(plan.schedule) + 2):
        running = set(plan.layer_set(t))
        assert pinned <= running
        free_running = running - pinned
        free_skipped = set(range(plan.num_layers)) - running
        assert free_running == set(plan.order.ranking[: len(free_running)])
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


@st.composite
def shapes(draw):
    kind = draw(st.sampled_from(SCHEDULE_KINDS))
    return ScheduleShape(kind, warmup=draw(st.integers(0, 3)), top=draw(st.floats(0, 1)),
                         floor=draw(st.floats(0, 1)), exponent=draw(st.sampled_from([0.5, 1.0, 2.0, 3.0])),
                         hold=draw(st.sampled_from([0.0, draw(st.floats(0, 0.9))])))


@given(shape=shapes(), num_layers=st.integers(6, 32), gen_len=st.integers(16, 96), share=st.floats(0, 1))
@settings(max_examples=60, deadline=None)
def test_a_shape_gives_a_valid_schedule_near_any_reachable_target(shape, num_layers, gen_len, share):
    highest = num_layers / (shape.warmup + 1)
    target = 1 + share * (highest - 1)
    schedule = shape.schedule(target, num_layers, gen_len)
    schedule.validate(num_layers)
    assert schedule.warmup == shape.warmup
    reached = SkipPlan(schedule, TopLayers(num_layers, warmup=shape.warmup), num_layers).nominal_speedup(gen_len)
    if shape.kind == "constant":  # whole depths only: the closest one
        best = min(abs(num_layers / b - target) for b in range(shape.warmup + 1, num_layers + 1))
        assert abs(reached - target) == pytest.approx(best)
    else:  # 1/gen_len steps of granularity: within 3% even at 16 steps
        assert reached == pytest.approx(target, rel=0.03)


@given(shape=shapes(), num_layers=st.integers(6, 24), low=st.floats(0, 1), high=st.floats(0, 1))
@settings(max_examples=40, deadline=None)
def test_a_higher_target_never_runs_more_layers(shape, num_layers, low, high):
    highest = num_layers / (shape.warmup + 1)
    a, b = sorted((1 + low * (highest - 1), 1 + high * (highest - 1)))
    layers = [sum(shape.schedule(t, num_layers, 32).depth(s) for s in range(32)) for t in (a, b)]
    assert layers[1] <= layers[0] * 1.03  # the same shape: at most the 1% search tolerance either way


@given(shape=shapes(), num_layers=st.integers(6, 24))
@settings(max_examples=20, deadline=None)
def test_target_one_runs_every_layer(shape, num_layers):
    schedule = shape.schedule(1.0, num_layers, 32)
    assert all(schedule.depth(t) == num_layers for t in range(32))


def test_the_shape_sets_b_max_and_b_min_where_the_target_allows():
    paper = PAPER_SHAPE.schedule(2.0, 18, 63)
    assert paper.b_max == 18 and paper.b_min == 2  # the paper: full depth first, the floor as low as it goes
    low = ScheduleShape("linear", 1, top=0.6, floor=0.9).schedule(2.0, 18, 63)
    assert (low.b_max, low.b_min) == (11, 8)
    assert ScheduleShape("constant", 1).schedule(2.0, 18, 63) == ConstantSchedule(9, warmup=1)


def test_a_hold_runs_b_max_first_and_then_the_same_decay_later():
    plain, held = LinearSchedule(8, 2, 6), LinearSchedule(8, 2, 6, hold=3)
    assert [held.depth(t) for t in range(12)] == [8, 8, 8] + [plain.depth(t) for t in range(9)]
    assert PowerLawSchedule(8, 2, 0, hold=2).depth(1) == 8 and PowerLawSchedule(8, 2, 0, hold=2).depth(2) == 2
    assert "after 3 steps at b_max" in held.describe() and "after" not in plain.describe()


def test_a_shapes_hold_keeps_full_depth_first_and_shortens_only_where_the_target_needs_it():
    shape = ScheduleShape("linear", 1, top=1.0, floor=0.0, hold=0.1875)  # 12 of 63 steps
    at_1_5 = shape.schedule(1.5, 18, 63)
    assert at_1_5.hold == 12 and [at_1_5.depth(t) for t in range(13)] == [18] * 13
    assert SkipPlan(at_1_5, TopLayers(18), 18).nominal_speedup(63) == pytest.approx(1.5, rel=0.01)
    at_5 = shape.schedule(5.0, 18, 63)  # 12 steps at 18 layers leave no way to 5x: a shorter hold, b_max kept
    assert at_5.b_max == 18 and at_5.hold < 12
    assert SkipPlan(at_5, TopLayers(18), 18).nominal_speedup(63) == pytest.approx(5.0, rel=0.01)
    assert ScheduleShape("constant", 1, hold=0.5).schedule(2.0, 18, 63) == ConstantSchedule(9, warmup=1)
    assert "first 19% of steps" in shape.describe() and "steps" not in PAPER_SHAPE.describe()


@given(target=st.floats(1, 20), rows=st.lists(st.floats(1, 10), min_size=1, max_size=5, unique=True))
def test_measured_best_shape_is_the_nearest_target_row(target, rows):
    table = {"top": tuple((t, ScheduleShape(floor=i / 10)) for i, t in enumerate(sorted(rows)))}
    chosen = measured_best_shape(target, "top", table)
    nearest = min(abs(math.log(t) - math.log(target)) for t in rows)
    assert any(shape == chosen and abs(math.log(t) - math.log(target)) == nearest for t, shape in table["top"])


def test_shape_tables_round_trip_through_json():
    assert shapes_from_json(json.loads(json.dumps(shapes_to_json(MEASURED_SHAPES)))) == MEASURED_SHAPES
    with pytest.raises(InputError, match="not a table of schedule shapes"):
        shapes_from_json({"top": [[2.0, {"kind": "cosine"}]]})


@pytest.mark.parametrize("policy", sorted(MEASURED_SHAPES))
@pytest.mark.parametrize("target", [1.25, 1.5, 2.0, 3.0])
def test_schedule_for_target_uses_the_measured_shape(policy, target):
    shape = measured_best_shape(target, policy)
    assert schedule_for_target(target, 18, 63, policy=policy) == shape.schedule(target, 18, 63)


@given(warmup=st.integers(0, 5), num_layers=st.integers(4, 32), share=st.floats(0, 1))
def test_reaching_lowers_the_warmup_only_as_far_as_the_target_needs(warmup, num_layers, share):
    warmup = min(warmup, num_layers - 1)  # a valid warm-up for the model
    target = 1 + share * (num_layers / 1 - 1) / 2  # up to L / 2: every target a warm-up of 0 or 1 reaches
    shape = ScheduleShape(warmup=warmup).reaching(target, num_layers)
    assert shape.warmup <= warmup
    assert num_layers / (shape.warmup + 1) >= target * (1 - 1e-9)
    if shape.warmup < warmup:  # one more warm-up layer would not reach
        assert num_layers / (shape.warmup + 2) < target


@pytest.mark.parametrize("target", [0.5, 0.99, 12.5, 100.0, math.nan, math.inf, "2"])
def test_schedule_for_target_refuses_what_no_schedule_reaches(target):
    with pytest.raises(InputError, match="(from 1 to 12.00|at least 1)"):
        schedule_for_target(target, 24, 64, shape=ScheduleShape(warmup=1))


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
    (lambda: LinearSchedule(8, 2, 3, hold=-1), "hold must be an integer >= 0"),
    (lambda: PowerLawSchedule(8, 2, 3, hold=1.5), "hold must be an integer >= 0"),
    (lambda: LinearSchedule(8, True, 10, warmup=0), "b_min must be an integer from 1"),
    (lambda: LinearSchedule(8, 2, 10).depth(-1), "step t must be an integer >= 0"),
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
    (lambda: make_schedule("constant", 24, layers=4, hold=3), "takes layers, not .*hold"),
    (lambda: make_schedule("linear", 24, b_min=2, horizon=8, layers=4), "not layers"),
    (lambda: make_schedule("linear", 24, horizon=8), "needs b_min, an integer from 2"),
    (lambda: make_schedule("power", 24, b_min=2), "needs horizon, an integer >= 0"),
    (lambda: make_schedule("linear", 24, b_max=25, b_min=2, horizon=8), "b_max must be an integer from 2 .* to 24"),
    (lambda: TopLayers(8, warmup=8), "warmup must be an integer from 0 to 7"),
    (lambda: TopLayers(8, warmup=1).layers(1), "depth .* must be an integer from 2 to 8"),
    (lambda: TopLayers(8, warmup=1).layers(9), "depth .* must be an integer from 2 to 8"),
    (lambda: ImportanceLayers((1, 2), (0, 2)), "exactly once"),
    (lambda: ImportanceLayers((1, 3), (0,)), "exactly once"),
    (lambda: ImportanceLayers((), ()), "exactly once"),
    (lambda: ImportanceLayers((1.0, 2), (0,)), "exactly once"),
    (lambda: ImportanceLayers.from_scores([1.0, math.nan, 2.0]), "finite"),
    (lambda: ImportanceLayers.from_scores([1.0, 2.0], pinned=(2,)), "pinned layer must be an integer from 0 to 1"),
    (lambda: ImportanceLayers.from_scores([1.0, 2.0, 3.0]).layers(1), "depth .* from 2 to 3"),
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
    (lambda: ScheduleShape("exp"), "one of linear, power, constant"),
    (lambda: ScheduleShape(top=1.5), "top must be a share from 0 to 1"),
    (lambda: ScheduleShape(hold=1.0), "hold must be a share of the steps from 0 to below 1"),
    (lambda: ScheduleShape(hold=True), "hold must be a share"),
    (lambda: schedule_for_target(2.0, 24, 0), "gen_len must be an integer >= 1"),
]


@pytest.mark.parametrize("build, message", INVALID)
def test_invalid_input_is_refused_with_the_allowed_range(build, message):
    with pytest.raises(InputError, match=message):
        build()


def test_describe_names_the_parameters():
    assert LinearSchedule(24, 4, 64).describe() == "linear: 24 -> 4 layers over 64 steps, warm-up 1"
    assert "exponent 2" in PowerLawSchedule(24, 4, 64).describe()
    assert "6 layers" in ConstantSchedule(6).describe()
