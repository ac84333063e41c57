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
from skipkey.skipdecode.schedules import (
    ImportanceLayers,
    Schedule,
    SkipPlan,
    TopLayers,
    make_schedule,
    measured_best_shape,
    schedule_for_target,
)

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
            policy = TopLayers(num_layers, warmup=self.schedule.warmup)
        else:
            scores = self.importance if self.importance is not None else measured
            if scores is None:
                raise InputError("the importance policy needs layer scores: calibrated, or measured on the prompt")
            policy = ImportanceLayers.from_scores(scores)
        return SkipPlan(self.schedule, policy, num_layers)

    def describe(self) -> str:
        return f"SkipDecode {self.schedule.describe()}, {self.policy} layers"


def make_skipdecode(num_layers: int, gen_len: int, *, target: float | None = None, kind: str | None = None,
                    policy: str = "top", b_max: int | None = None, b_min: int | None = None,
                    horizon: int | None = None, warmup: int | None = None, exponent: float | None = None,
                    layers: int | None = None, importance: Sequence[float] | None = None,
                    shapes: dict | None = None, hold: int | None = None) -> SkipDecode:
    """The one edge where the CLI's and the app's SkipDecode options become a validated config.

    Either ``target`` (a nominal speedup over ``gen_len`` steps) or explicit schedule
    parameters. A target takes the measured-best shape for the layer ``policy``
    (``shapes``: a table like ``MEASURED_SHAPES``, e.g. the one an adapter was trained
    with); ``kind``, ``warmup`` and ``exponent``, when given, override the shape's.
    ``hold`` (steps at ``b_max`` before the decay) is for explicit schedules: a target's
    shape sets its own.
    """
    if policy not in LAYER_POLICIES:
        raise InputError(f"unknown layer policy {policy!r}; choose one of {', '.join(LAYER_POLICIES)}")
    if target is not None:
        if hold is not None:
            raise InputError("hold is set by the target's measured-best shape; give b_max, b_min and horizon "
                             "to choose it")
        shape = measured_best_shape(target, policy, shapes)
        given = {k: v for k, v in (("kind", kind), ("warmup", warmup), ("exponent", exponent)) if v is not None}
        if given.get("kind", shape.kind) == "constant" or shape.kind != "constant":
            shape = replace(shape, **given)
        else:  # a decay asked for where a constant shape won: decay gently from just above the constant depth
            shape = replace(shape, top=0.0, floor=1.0, **given)
        if warmup is None:
            shape = shape.reaching(target, num_layers)
        schedule = schedule_for_target(target, num_layers, gen_len, shape)
    else:
        schedule = make_schedule(kind or "linear", num_layers, b_max=b_max, b_min=b_min, horizon=horizon,
                                 warmup=1 if warmup is None else warmup,
                                 exponent=2.0 if exponent is None else exponent, layers=layers,
                                 hold=0 if hold is None else hold)
    skip = SkipDecode(schedule, policy, tuple(importance) if importance is not None else None)
    skip.validate(num_layers)
    return skip
