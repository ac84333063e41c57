"""SkipDecode's schedules: how many layers each generation step runs, ``b(t)``, and the measured shapes.

SkipDecode (Del Corro et al. 2023, arXiv 2307.02628) gives every step ``t`` one
layer set ``E(t)``, shared by the whole batch. A *schedule* (here) says how many
layers run, ``b(t)``; a layer *policy* (``skipkey.skipdecode.rankings``) says which
ones; a ``SkipPlan`` joins the two.

Every schedule here is non-increasing in ``t`` and every policy takes a prefix of
one fixed order of layers, so ``E(t+1)`` is a subset of ``E(t)``. That nesting is
why no key or value is ever recomputed: when token ``t`` runs layer ``l``, every
earlier token ran ``l`` too, so its cache at ``l`` exists.

Generation steps are numbered from 0: step ``t`` feeds token ``t`` (the prompt
pass, at full depth, made token 0) and produces token ``t + 1``.
"""

from __future__ import annotations

import bisect
import json
import math
import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from skipkey.config import require_int
from skipkey.errors import InputError

SCHEDULE_KINDS = ("linear", "power", "constant")


def _require_int(name: str, value: object, low: int, high: int | None = None, *, low_is: str = "",
                 high_is: str = "") -> None:
    require_int(name, value, low, high, exact=True, lo_is=low_is, hi_is=high_is)


def _check_warmup(warmup: object, num_layers: int | None) -> None:
    high = None if num_layers is None else num_layers - 1
    _require_int("warmup", warmup, 0, high, high_is=f" (fewer than the model's {num_layers} layers)")


def _check_layer_count(name: str, value: object, warmup: int, num_layers: int | None) -> None:
    # The warm-up layers always run, so a depth must leave room for at least one more.
    _require_int(
        name, value, warmup + 1, num_layers, low_is=" (warmup + 1)", high_is=" (the model's layers)"
    )


def _check_decay(schedule: LinearSchedule | PowerLawSchedule, num_layers: int | None) -> None:
    """The paper's 1 <= b_min <= b_max <= L, with b_min above the warm-up."""
    _check_warmup(schedule.warmup, num_layers)
    _check_layer_count("b_max", schedule.b_max, schedule.warmup, num_layers)
    _require_int(
        "b_min", schedule.b_min, schedule.warmup + 1, schedule.b_max,
        low_is=" (warmup + 1)", high_is=" (b_max)",
    )
    _require_int("horizon", schedule.horizon, 0, low_is=" (steps; 0 starts at b_min)")
    _require_int("hold", schedule.hold, 0, low_is=" (steps at b_max before the decay)")


def _check_constant(schedule: ConstantSchedule, num_layers: int | None) -> None:
    _check_warmup(schedule.warmup, num_layers)
    _check_layer_count("layers", schedule.layers, schedule.warmup, num_layers)


def _check_exponent(exponent: object) -> None:
    if not (
        isinstance(exponent, numbers.Real) and not isinstance(exponent, bool)
        and math.isfinite(exponent) and exponent > 0
    ):
        raise InputError(f"exponent must be a finite number > 0, got {exponent!r}")


def _check_step(t: object) -> None:
    _require_int("generation step t", t, 0)


def _progress(t: int, horizon: int, hold: int = 0) -> float:
    """min(1, (t - hold) / T), at least 0: how far the decay has gone. It starts after ``hold`` steps at
    ``b_max``; T = 0 means it is over as soon as it starts."""
    _check_step(t)
    if t < hold:
        return 0.0
    return 1.0 if horizon == 0 else min(1.0, (t - hold) / horizon)


def _hold_text(hold: int) -> str:
    return f" after {hold} steps at b_max" if hold else ""


def _round_half_up(x: float) -> int:
    # Python's round() goes half to even, which would make equal steps of a decay uneven.
    return math.floor(x + 0.5)


@dataclass(frozen=True)
class LinearSchedule:
    """The paper's schedule: ``b(t) = round(b_max - (b_max - b_min) * min(1, t / T))``.

    ``T`` is ``horizon``, the number of steps the decay takes (the paper set it from
    a length statistic of the data). ``horizon = 0`` means the decay is already
    over: ``b(t) = b_min`` from the first step. Halves round up.

    ``hold`` (ours; 0 is the paper's) delays the decay: the first ``hold`` steps run
    ``b_max``, and ``t`` above counts from there.
    """

    b_max: int
    b_min: int
    horizon: int
    warmup: int = 1
    hold: int = 0

    def __post_init__(self) -> None:
        _check_decay(self, None)

    def validate(self, num_layers: int) -> None:
        _check_decay(self, num_layers)

    def depth(self, t: int) -> int:
        return _round_half_up(self.b_max - (self.b_max - self.b_min) * _progress(t, self.horizon, self.hold))

    def describe(self) -> str:
        return (
            f"linear: {self.b_max} -> {self.b_min} layers over {self.horizon} steps{_hold_text(self.hold)}, "
            f"warm-up {self.warmup}"
        )


@dataclass(frozen=True)
class PowerLawSchedule:
    """The power-law variant the paper mentions trying.

    ``b(t) = round(b_min + (b_max - b_min) * (1 - min(1, t / T)) ** exponent)``.
    ``exponent = 1`` is the linear schedule; above 1 the depth falls fast at first
    and then levels off towards ``b_min``; below 1 it stays high longer and drops
    late. ``horizon = 0`` means ``b(t) = b_min`` from the first step. Halves round up.
    ``hold``: as ``LinearSchedule``'s.
    """

    b_max: int
    b_min: int
    horizon: int
    exponent: float = 2.0
    warmup: int = 1
    hold: int = 0

    def __post_init__(self) -> None:
        _check_decay(self, None)
        _check_exponent(self.exponent)

    def validate(self, num_layers: int) -> None:
        _check_decay(self, num_layers)

    def depth(self, t: int) -> int:
        remaining = (1.0 - _progress(t, self.horizon, self.hold)) ** self.exponent
        return _round_half_up(self.b_min + (self.b_max - self.b_min) * remaining)

    def describe(self) -> str:
        return (
            f"power law (exponent {self.exponent:g}): {self.b_max} -> {self.b_min} layers "
            f"over {self.horizon} steps{_hold_text(self.hold)}, warm-up {self.warmup}"
        )


@dataclass(frozen=True)
class ConstantSchedule:
    """The same number of layers at every step: ``b(t) = layers``."""

    layers: int
    warmup: int = 1

    def __post_init__(self) -> None:
        _check_constant(self, None)

    @property
    def b_max(self) -> int:
        return self.layers

    @property
    def b_min(self) -> int:
        return self.layers

    def validate(self, num_layers: int) -> None:
        _check_constant(self, num_layers)

    def depth(self, t: int) -> int:
        _check_step(t)
        return self.layers

    def describe(self) -> str:
        return f"constant: {self.layers} layers, warm-up {self.warmup}"


Schedule = LinearSchedule | PowerLawSchedule | ConstantSchedule


def _check_kind(kind: str) -> None:
    if kind not in SCHEDULE_KINDS:
        raise InputError(f"schedule kind must be one of {', '.join(SCHEDULE_KINDS)}; got {kind!r}")


@dataclass(frozen=True)
class ScheduleShape:
    """How a schedule reaches a target speedup, whatever the target: the *shape* of ``b(t)``.

    * ``kind``, ``warmup``, ``exponent``: as the schedules above;
    * ``top``: ``b_max`` as a share of the model's layers (1 is the paper's ``b_max = L``);
    * ``floor``: ``b_min`` as a share of the constant depth ``L / target`` (1 is no decay at
      all; lower starts deeper and ends shallower);
    * ``hold``: the share of the decode steps run at ``b_max`` before the decay starts (0,
      the paper's, decays from the first step; a constant schedule has no decay to delay).

    ``schedule`` then searches ``b_min`` and the horizon for the nominal speedup closest
    to the target, preferring the ``b_min`` nearest ``floor``; where the hold leaves no
    way to reach the target, it is shortened until one does. A constant schedule has
    one depth per target, the closest whole one. ``MEASURED_SHAPES`` holds the shape the
    shape study (``python -m skipkey shapes``) measured best per target.
    """

    kind: str = "linear"
    warmup: int = 1
    top: float = 1.0
    floor: float = 0.0
    exponent: float = 2.0
    hold: float = 0.0

    def __post_init__(self) -> None:
        _check_kind(self.kind)
        _check_warmup(self.warmup, None)
        for name, value in (("top", self.top), ("floor", self.floor)):
            if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 <= value <= 1):
                raise InputError(f"the shape's {name} must be a share from 0 to 1, got {value!r}")
        if not (isinstance(self.hold, numbers.Real) and not isinstance(self.hold, bool) and 0 <= self.hold < 1):
            raise InputError(f"the shape's hold must be a share of the steps from 0 to below 1, got {self.hold!r}")
        _check_exponent(self.exponent)

    def schedule(self, target: float, num_layers: int, gen_len: int) -> Schedule:
        """The schedule of this shape whose nominal speedup over ``gen_len`` steps is closest to ``target``."""
        _require_int("num_layers", num_layers, 1)
        _require_int("gen_len", gen_len, 1, low_is=" (decode steps)")
        _check_warmup(self.warmup, num_layers)
        lowest = self.warmup + 1
        highest = num_layers / lowest
        in_range = (isinstance(target, numbers.Real) and not isinstance(target, bool)
                    and 1 <= target <= highest * (1 + 1e-9))
        if not in_range:
            raise InputError(
                f"target speedup must be from 1 to {highest:.2f} for a {num_layers}-layer model "
                f"with warm-up {self.warmup} (down to {lowest} of {num_layers} layers a step), "
                f"got {target!r}"
            )

        def speedup(schedule: Schedule) -> float:
            # |E(t)| = b(t) under every policy, so the depths are enough.
            return num_layers * gen_len / sum(schedule.depth(t) for t in range(gen_len))

        if self.kind == "constant":
            return min((ConstantSchedule(b, warmup=self.warmup) for b in range(num_layers, lowest - 1, -1)),
                       key=lambda schedule: abs(speedup(schedule) - target))
        if target <= 1 + 1e-9:  # every layer at every step: within 1% would already skip some
            return self._decays(num_layers, num_layers, target, gen_len, speedup, 0)[0]
        return self._closest(target, num_layers, gen_len, speedup, _round_half_up(self.hold * gen_len))

    def _closest(self, target: float, num_layers: int, gen_len: int, speedup, longest_hold: int) -> Schedule:
        """With ``b_max`` as the shape says and the longest hold up to ``longest_hold`` steps that leaves some
        decay within 1% of the target, the decay whose ``b_min`` is nearest ``floor`` among those within 1%
        of the best. Only where no hold at that ``b_max`` comes within 1%, the nearest ``b_max`` that does (a
        floor of a few layers leaves too little room between the two); where none does, the closest of all."""
        lowest = self.warmup + 1
        depth = num_layers / target  # the constant depth that would hit the target
        preferred = min(num_layers, max(lowest, math.ceil(depth - 1e-9), _round_half_up(self.top * num_layers)))
        fallback: list[tuple[float, Schedule]] = []
        for b_max in sorted(range(max(lowest, math.ceil(depth - 1e-9)), num_layers + 1),
                            key=lambda b: (abs(b - preferred), b)):
            # A hold of H steps runs at least H * b_max + (gen_len - H) * lowest layers: no longer hold can reach.
            room = num_layers * gen_len / target * 1.01 - gen_len * lowest
            start = longest_hold if b_max == lowest else min(longest_hold, max(0, math.floor(room / (b_max - lowest)) + 1))
            for hold in range(start, -1, -1):
                options = self._decays(b_max, lowest, target, gen_len, speedup, hold)
                error = {id(s): abs(speedup(s) - target) / target for s in options}
                best = min(error.values())
                wanted = min(b_max, max(lowest, _round_half_up(self.floor * depth)))
                close = [s for s in options if error[id(s)] <= best + 0.01]  # within 1% of the best reachable
                chosen = min(close, key=lambda s: (abs(s.b_min - wanted), error[id(s)], s.horizon))
                if best <= 0.01:
                    return chosen
                fallback.append((error[id(chosen)], chosen))
        return min(fallback, key=lambda pair: pair[0])[1]

    def _decays(self, b_max: int, lowest: int, target: float, gen_len: int, speedup, hold: int) -> list[Schedule]:
        """For each ``b_min``, the horizons either side of ``target``, the decay starting after ``hold`` steps."""

        def decay(b_min: int, horizon: int) -> Schedule:
            if self.kind == "linear":
                return LinearSchedule(b_max, b_min, horizon, warmup=self.warmup, hold=hold)
            return PowerLawSchedule(b_max, b_min, horizon, exponent=self.exponent, warmup=self.warmup, hold=hold)

        options = []
        horizons = range(2 * gen_len + 2)  # a decay may end past the last step: it is then still under way
        for b_min in range(lowest, b_max + 1):
            # The speedup falls as the horizon grows (a longer decay only raises budgets).
            h = bisect.bisect_left(horizons, -target, key=lambda h: -speedup(decay(b_min, h)))
            options += [decay(b_min, h) for h in (h - 1, h) if h in horizons]
        return options

    def reaching(self, target: float, num_layers: int) -> ScheduleShape:
        """This shape with its warm-up lowered, where needed, so ``target`` stays reachable (a warm-up of
        ``w`` runs at least ``w + 1`` layers a step: at most ``L / (w + 1)``)."""
        if not (isinstance(target, numbers.Real) and target > 1) or num_layers / (self.warmup + 1) >= target:
            return self
        return replace(self, warmup=max(0, min(self.warmup, math.floor(num_layers / target + 1e-9) - 1)))

    def describe(self) -> str:
        if self.kind == "constant":
            return f"constant, warm-up {self.warmup}"
        kind = "linear" if self.kind == "linear" else f"power {self.exponent:g}"
        held = f", b_max for the first {self.hold:.0%} of steps" if self.hold else ""
        return (f"{kind}, warm-up {self.warmup}, b_max {self.top:.0%} of L, b_min {self.floor:.0%} of L/target"
                f"{held}")


PAPER_SHAPE = ScheduleShape("linear", warmup=1, top=1.0, floor=0.0)  # b_max = L, the lowest b_min that reaches


def measured_best_shape(target: float, policy: str = "top",
                        table: dict[str, Sequence[tuple[float, ScheduleShape]]] | None = None) -> ScheduleShape:
    """The measured-best shape for ``target`` under layer ``policy``: from ``table`` (e.g. the shapes an adapter
    was trained with) where it has rows for ``policy``, else from ``MEASURED_SHAPES``."""
    rows = (table or {}).get(policy) or MEASURED_SHAPES.get(policy)
    if not rows:
        raise InputError(f"no measured schedule shapes for the layer policy {policy!r}")
    if not (isinstance(target, numbers.Real) and not isinstance(target, bool) and target >= 1):
        raise InputError(f"target speedup must be a number of at least 1, got {target!r}")
    return min(rows, key=lambda row: (abs(math.log(row[0]) - math.log(target)), row[0]))[1]


def shapes_to_json(table: dict[str, Sequence[tuple[float, ScheduleShape]]]) -> dict[str, list]:
    """A shape table as JSON: ``{policy: [[target, {kind, warmup, top, floor, exponent}], ...]}``."""
    return {policy: [[target, asdict(shape)] for target, shape in rows] for policy, rows in table.items()}


def shapes_from_json(obj: object) -> dict[str, tuple[tuple[float, ScheduleShape], ...]]:
    """``shapes_to_json``'s inverse, with a clear error for anything else."""
    try:
        table = {str(policy): tuple((float(target), ScheduleShape(**shape)) for target, shape in rows)
                 for policy, rows in obj.items()}
    except (AttributeError, TypeError, ValueError) as error:
        raise InputError(f"not a table of schedule shapes: {error}") from error
    if not table or not all(table.values()):
        raise InputError("a table of schedule shapes needs at least one (target, shape) per policy")
    return table


# The shape study's winners, per layer policy: (target, shape), rows in target order; a target uses the row
# nearest it (in log speedup). Read from ``measured_shapes.json`` beside this module, which
# `python -m skipkey shapes` measured (assets/results/shape_study.json, untuned weights);
# ``tests/test_shapes.py`` checks the file against that committed study. Full depth first (b_max = L) won
# everywhere, and untuned, held there: with the original weights every skipping step costs more than running
# the first steps at full depth and the tail shallower.
MEASURED_SHAPES_FILE = Path(__file__).with_name("measured_shapes.json")
MEASURED_SHAPES: dict[str, tuple[tuple[float, ScheduleShape], ...]] = shapes_from_json(
    json.loads(MEASURED_SHAPES_FILE.read_text()))


def schedule_for_target(target: float, num_layers: int, gen_len: int, shape: ScheduleShape | None = None,
                        policy: str = "top") -> Schedule:
    """The schedule closest to ``target`` (nominal speedup over ``gen_len`` decode steps).

    ``shape`` defaults to the measured-best one for ``target`` and the layer ``policy``
    (``measured_best_shape``, its warm-up lowered if the target needs it);
    ``SkipPlan.nominal_speedup`` tells the speedup reached.
    """
    if shape is None:
        shape = measured_best_shape(target, policy).reaching(target, num_layers)
    return shape.schedule(target, num_layers, gen_len)


@dataclass(frozen=True)
class ScheduleSpec:
    """An explicit schedule as the CLI, the app and the library ask for it, checked by ``build``.

    ``b_max`` defaults to ``L``; ``hold`` steps run ``b_max`` before a decay starts; a
    constant schedule takes ``layers`` instead of ``b_max``, ``b_min``, ``horizon``, ``hold``.
    """

    kind: str = "linear"
    b_max: int | None = None
    b_min: int | None = None
    horizon: int | None = None
    warmup: int = 1
    exponent: float = 2.0
    layers: int | None = None
    hold: int = 0

    def build(self, num_layers: int) -> Schedule:
        """The validated schedule for a model of ``num_layers``; messages name that model's ranges."""
        kind, warmup = self.kind, self.warmup
        _check_kind(kind)
        _require_int("num_layers", num_layers, 1)
        # Checked against the model first, so the messages name its range.
        _check_warmup(warmup, num_layers)
        if kind == "constant":
            if (self.b_max, self.b_min, self.horizon) != (None, None, None) or self.hold:
                raise InputError("a constant schedule takes layers, not b_max, b_min, horizon or hold")
            if self.layers is None:
                raise InputError(f"a constant schedule needs layers, an integer from {warmup + 1} to {num_layers}")
            _check_layer_count("layers", self.layers, warmup, num_layers)
            schedule: Schedule = ConstantSchedule(self.layers, warmup=warmup)
        else:
            if self.layers is not None:
                raise InputError(f"a {kind} schedule takes b_max, b_min and horizon, not layers")
            b_max = num_layers if self.b_max is None else self.b_max
            _check_layer_count("b_max", b_max, warmup, num_layers)
            if self.b_min is None:
                raise InputError(f"a {kind} schedule needs b_min, an integer from {warmup + 1} to b_max")
            if self.horizon is None:
                raise InputError(f"a {kind} schedule needs horizon, an integer >= 0 (steps)")
            if kind == "linear":
                schedule = LinearSchedule(b_max, self.b_min, self.horizon, warmup=warmup, hold=self.hold)
            else:
                schedule = PowerLawSchedule(b_max, self.b_min, self.horizon, exponent=self.exponent, warmup=warmup,
                                            hold=self.hold)
        schedule.validate(num_layers)
        return schedule


def make_schedule(kind: str, num_layers: int, **options) -> Schedule:
    """``ScheduleSpec(kind, **options).build(num_layers)``: a validated schedule from keyword options."""
    return ScheduleSpec(kind, **options).build(num_layers)
