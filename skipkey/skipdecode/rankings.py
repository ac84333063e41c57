"""SkipDecode's layer policies (which layers a step runs), the ``SkipPlan`` that joins them to a schedule, and
the speed-up arithmetic of layer sets.

A layer policy's *layer order* (``TopLayers``, ``ImportanceLayers``) takes a prefix of one fixed order of layers, so with a non-increasing
schedule (``skipkey.skipdecode.schedules``) ``E(t+1)`` is a subset of ``E(t)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from skipkey.config import is_int
from skipkey.errors import InputError
from skipkey.skipdecode.schedules import Schedule, _check_warmup, _require_int


def _check_depth(order: TopLayers | ImportanceLayers, depth: int) -> None:
    low, high = order.depth_range
    _require_int(f"depth (layers a step runs) for {order.describe()}", depth, low, high)


@dataclass(frozen=True)
class TopLayers:
    """The paper's policy: skip lower and middle layers, keep the top ones.

    ``E = {0..w-1} ∪ {L-(b-w) .. L-1}``: ``w`` bottom warm-up layers always run
    (``w = 1`` is our choice), then the top ``b - w``.
    """

    num_layers: int
    warmup: int = 1

    def __post_init__(self) -> None:
        _require_int("num_layers", self.num_layers, 1)
        _check_warmup(self.warmup, self.num_layers)

    @property
    def depth_range(self) -> tuple[int, int]:
        return self.warmup + 1, self.num_layers

    def layers(self, depth: int) -> tuple[int, ...]:
        _check_depth(self, depth)
        first_top = self.num_layers - (depth - self.warmup)
        return (*range(self.warmup), *range(first_top, self.num_layers))

    def describe(self) -> str:
        return f"top layers with warm-up {self.warmup} of {self.num_layers}"


@dataclass(frozen=True)
class ImportanceLayers:
    """Training-free variant: drop the least important layers first.

    Not the paper's policy (it fine-tunes the model with ``TopLayers``). Off-the-shelf
    weights degrade far less when the dropped layers are those that change the
    hidden state least (``skipkey.core.importance.layer_importance``), with the first and last pinned.
    ``pinned`` layers always run; ``ranking`` lists every other layer, most
    important first, and a depth ``b`` runs its first ``b - len(pinned)``. Any
    fixed ranking keeps ``E(t)`` nested, so the cache invariant holds.
    """

    ranking: tuple[int, ...]
    pinned: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranking", tuple(self.ranking))
        object.__setattr__(self, "pinned", tuple(self.pinned))
        every = (*self.pinned, *self.ranking)
        if not every or not all(map(is_int, every)) or sorted(every) != list(range(len(every))):
            raise InputError(
                f"pinned {self.pinned} and ranking {self.ranking} must together name every "
                f"layer 0 to {len(every) - 1} exactly once"
            )

    @classmethod
    def from_scores(
        cls, scores: Sequence[float], pinned: Sequence[int] | None = None
    ) -> ImportanceLayers:
        """Rank layers by ``scores[l]`` (higher = more important; ties: lower layer first).

        ``pinned`` defaults to the first and last layer.
        """
        num_layers = len(scores)
        _require_int("number of layer scores", num_layers, 1)
        values = [float(s) for s in scores]
        if not all(map(math.isfinite, values)):
            raise InputError(f"layer scores must be finite numbers, got {values}")
        if pinned is None:
            pinned = (0, num_layers - 1)
        for layer in pinned:
            _require_int("pinned layer", layer, 0, num_layers - 1)
        kept = tuple(sorted(set(pinned)))
        ranking = sorted(
            (layer for layer in range(num_layers) if layer not in kept),
            key=lambda layer: (-values[layer], layer),
        )
        return cls(ranking=tuple(ranking), pinned=kept)

    @property
    def num_layers(self) -> int:
        return len(self.ranking) + len(self.pinned)

    @property
    def depth_range(self) -> tuple[int, int]:
        return max(1, len(self.pinned)), self.num_layers

    def layers(self, depth: int) -> tuple[int, ...]:
        _check_depth(self, depth)
        return tuple(sorted((*self.pinned, *self.ranking[: depth - len(self.pinned)])))

    def describe(self) -> str:
        return f"importance-ranked layers, pinned {self.pinned}, of {self.num_layers}"


LayerOrder = TopLayers | ImportanceLayers  # a layer policy as an object: the order its prefixes come from


def _executed(layer_sets: Sequence[Sequence[int]]) -> int:
    if len(layer_sets) == 0:
        raise InputError("need at least one generation step to compute a speedup")
    executed = sum(len(layers) for layers in layer_sets)
    if executed == 0:
        raise InputError("no layer ran in any step; every step runs at least one layer")
    return executed


def nominal_speedup(layer_sets: Sequence[Sequence[int]], num_layers: int) -> float:
    """Speedup of the layer stack alone: ``L * N / sum_t |E(t)|``."""
    return num_layers * len(layer_sets) / _executed(layer_sets)


def compute_ratio(
    layer_sets: Sequence[Sequence[int]], num_layers: int, layer_cost: float, fixed_cost: float
) -> float:
    """End-to-end compute ratio, full model over skipping, per generated token.

    ``fixed_cost`` is what runs at every step whatever is skipped (embedding, final
    norm, LM head), in the same unit as ``layer_cost`` (e.g. FLOPs or parameters
    read). It is why the real ratio sits below the nominal speedup.
    """
    if not (layer_cost > 0 and fixed_cost >= 0):
        raise InputError(
            f"layer_cost must be > 0 and fixed_cost >= 0, got {layer_cost!r} and {fixed_cost!r}"
        )
    n_steps = len(layer_sets)
    skipping = _executed(layer_sets) * layer_cost + n_steps * fixed_cost
    return n_steps * (num_layers * layer_cost + fixed_cost) / skipping


@dataclass(frozen=True)
class SkipPlan:
    """A schedule and a layer order for one model: ``E(t) = order.layers(schedule.depth(t))``."""

    schedule: Schedule
    order: LayerOrder
    num_layers: int
    _by_depth: dict[int, tuple[int, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _require_int("num_layers", self.num_layers, 1)
        self.schedule.validate(self.num_layers)
        if self.order.num_layers != self.num_layers:
            raise InputError(
                f"the layer policy is for {self.order.num_layers} layers, "
                f"the model has {self.num_layers}"
            )
        low, high = self.order.depth_range
        if not low <= self.schedule.b_min <= self.schedule.b_max <= high:
            raise InputError(
                f"{self.order.describe()} runs {low} to {high} layers a step, "
                f"but the schedule ({self.schedule.describe()}) asks for "
                f"{self.schedule.b_min} to {self.schedule.b_max}"
            )
        if isinstance(self.order, TopLayers) and self.order.warmup != self.schedule.warmup:
            raise InputError(
                f"the schedule's warm-up ({self.schedule.warmup}) and the policy's "
                f"({self.order.warmup}) must be the same"
            )

    def layer_set(self, t: int) -> tuple[int, ...]:
        """``E(t)``, the layers step ``t`` runs, ascending."""
        depth = self.schedule.depth(t)
        layers = self._by_depth.get(depth)
        if layers is None:
            layers = self._by_depth[depth] = self.order.layers(depth)
        return layers

    def layer_sets(self, n_steps: int) -> list[tuple[int, ...]]:
        _require_int("n_steps", n_steps, 1)
        return [self.layer_set(t) for t in range(n_steps)]

    def nominal_speedup(self, n_steps: int) -> float:
        return nominal_speedup(self.layer_sets(n_steps), self.num_layers)

    def compute_ratio(self, n_steps: int, layer_cost: float, fixed_cost: float) -> float:
        return compute_ratio(self.layer_sets(n_steps), self.num_layers, layer_cost, fixed_cost)
