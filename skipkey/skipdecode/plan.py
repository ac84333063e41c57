"""SkipDecode as the engine sees it: a schedule plus a layer-choice policy.

Del Corro et al., 2023 (arXiv 2307.02628). The paper's policy, ``top``, runs
the bottom warm-up layers and the top ``b(t) - w``; ``importance`` (training
free) runs the layers that change the hidden state most, measured on the
prompt's own prefill unless calibrated scores are given. Either way the sets
nest, so no KV is ever recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from skipkey.errors import InputError
from skipkey.skipdecode.schedules import Schedule, ScheduleSpec, measured_best_shape, schedule_for_target
from skipkey.skipdecode.rankings import ImportanceLayers, SkipPlan, TopLayers

LAYER_POLICIES = ("top", "importance")


@dataclass(frozen=True)
class SkipDecode:
    schedule: Schedule
    policy: str = "top"
    importance: tuple[float, ...] | None = None  # calibrated per-layer scores; None = measure on the prompt

    def __post_init__(self):
        if self.policy not in LAYER_POLICIES:
            raise InputError(f"unknown layer policy {self.policy!r}; choose one of {', '.join(LAYER_POLICIES)}")
        if self.importance is not None:
            object.__setattr__(self, "importance", tuple(float(x) for x in self.importance))

    @property
    def needs_importance(self) -> bool:
        return self.policy == "importance" and self.importance is None

    def validate(self, num_layers: int) -> None:
        if self.importance is not None and len(self.importance) != num_layers:
            raise InputError(f"importance scores are for {len(self.importance)} layers, the model has {num_layers}")
        self.plan(num_layers, [0.0] * num_layers)

    def plan(self, num_layers: int, measured: Sequence[float] | None = None) -> SkipPlan:
        if self.policy == "top":
            order = TopLayers(num_layers, warmup=self.schedule.warmup)
        else:
            scores = self.importance if self.importance is not None else measured
            if scores is None:
                raise InputError("the importance policy needs layer scores: calibrated, or measured on the prompt")
            order = ImportanceLayers.from_scores(scores)
        return SkipPlan(self.schedule, order, num_layers)

    def describe(self) -> str:
        return f"SkipDecode {self.schedule.describe()}, {self.policy} layers"


@dataclass(frozen=True)
class SkipDecodeSpec:
    """SkipDecode as the CLI, the app and the library ask for it; ``build`` is the one edge that checks it.

    Either ``target`` (a nominal speedup over ``gen_len`` steps) or explicit schedule
    parameters (``ScheduleSpec``'s; None: its default). A target takes the measured-best
    shape for the layer ``policy`` (``shapes``: a table like ``MEASURED_SHAPES``, e.g.
    the one an adapter was trained with); ``kind``, ``warmup`` and ``exponent``, when
    given, override the shape's. ``hold`` (steps at ``b_max`` before the decay) is for
    explicit schedules: a target's shape sets its own.
    """

    target: float | None = None
    policy: str = "top"
    kind: str | None = None
    b_max: int | None = None
    b_min: int | None = None
    horizon: int | None = None
    warmup: int | None = None
    exponent: float | None = None
    layers: int | None = None
    hold: int | None = None
    importance: Sequence[float] | None = None  # calibrated per-layer scores; None = measure on the prompt
    shapes: dict | None = None

    def build(self, num_layers: int, gen_len: int) -> SkipDecode:
        """The validated ``SkipDecode`` for a model of ``num_layers`` over ``gen_len`` decode steps."""
        if self.policy not in LAYER_POLICIES:
            raise InputError(f"unknown layer policy {self.policy!r}; choose one of {', '.join(LAYER_POLICIES)}")
        schedule = self._for_target(num_layers, gen_len) if self.target is not None else ScheduleSpec(
            self.kind or "linear", b_max=self.b_max, b_min=self.b_min, horizon=self.horizon,
            warmup=1 if self.warmup is None else self.warmup, exponent=2.0 if self.exponent is None else self.exponent,
            layers=self.layers, hold=0 if self.hold is None else self.hold).build(num_layers)
        skip = SkipDecode(schedule, self.policy, tuple(self.importance) if self.importance is not None else None)
        skip.validate(num_layers)
        return skip

    def _for_target(self, num_layers: int, gen_len: int) -> Schedule:
        if self.hold is not None:
            raise InputError("hold is set by the target's measured-best shape; give b_max, b_min and horizon "
                             "to choose it")
        shape = measured_best_shape(self.target, self.policy, self.shapes)
        given = {k: v for k, v in (("kind", self.kind), ("warmup", self.warmup), ("exponent", self.exponent))
                 if v is not None}
        if given.get("kind", shape.kind) == "constant" or shape.kind != "constant":
            shape = replace(shape, **given)
        else:  # a decay asked for where a constant shape won: decay gently from just above the constant depth
            shape = replace(shape, top=0.0, floor=1.0, **given)
        if self.warmup is None:
            shape = shape.reaching(self.target, num_layers)
        return schedule_for_target(self.target, num_layers, gen_len, shape)


def make_skipdecode(num_layers: int, gen_len: int, spec: SkipDecodeSpec | None = None, **fields) -> SkipDecode:
    """``spec.build(num_layers, gen_len)``; without a spec, one from ``fields`` (``SkipDecodeSpec``'s)."""
    if spec is not None and fields:
        raise InputError("give a SkipDecodeSpec or its fields, not both")
    return (spec or SkipDecodeSpec(**fields)).build(num_layers, gen_len)
