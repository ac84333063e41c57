"""KV-cache policies: which past tokens each layer keeps.

One small frozen dataclass per policy, holding only its hyper-parameters and a
``priority`` (and, for scoring policies, a ``contribution``). The mechanism is
shared and lives once in ``KVPolicy.evict``: keep the recent window, then the
highest-priority other slots, up to the budget, per row, layer and KV head, and
physically drop the rest (``LayerCache.gather``).

Keyformer: Adnan et al., MLSys 2024, arXiv 2403.09054. H2O: Zhang et al., 2023.
StreamingLLM: Xiao et al., 2023.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from skipkey.core import kernels
from skipkey.core.retention import Appending, Retention
from skipkey.config import require_float, require_int
from skipkey.errors import InputError
from skipkey.kv.budgets import Budgets, Evicting, parse_budget
from skipkey.kv.scoring import ScoreContribution

SINK_TOKENS = 4  # StreamingLLM's attention sinks
# The product's recommended query-aware options for h2o and keyformer, chosen on the retrieval benchmark
# (README, "Query-aware key tokens"); the dataclass defaults stay the paper's.
RECOMMENDED_OPTIONS = {"observe": 8, "pool": 7}
_PROTECTED = torch.finfo(torch.float32).max  # the recent window (and sinks): evicted only past the budget


@dataclass(frozen=True)
class KVPolicy:
    """Budget ``k`` per row, layer and KV head: ``round(rho * P)`` or an absolute count.

    ``recent`` is the share of ``k`` reserved for the most recent tokens (``w = round(r * k)``).
    """

    budget: float | int = 0.5  # a fraction of the prompt or a token count (``parse_budget``)
    recent: float = 0.3
    seed: int = 0
    evict_every: int = 1  # evict every N steps (the paper: 1); the cache holds up to budget + N - 1

    name: ClassVar[str] = ""
    needs_scores: ClassVar[bool] = False  # the attention function computes a score contribution
    scores_while_decoding: ClassVar[bool] = True  # ... on decode steps too, not only for the prompt
    accumulates: ClassVar[bool] = True  # each step adds to the scores (else it replaces them)
    evicts: ClassVar[bool] = True

    def __post_init__(self):
        object.__setattr__(self, "budget", parse_budget(self.budget))
        object.__setattr__(self, "recent", require_float("KV recent-window share", self.recent, 0.0, 1.0))
        object.__setattr__(self, "seed", require_int("seed", self.seed, 0, 2**63 - 1))
        object.__setattr__(self, "evict_every", require_int("evict_every", self.evict_every, 1, 1024))

    def budget_tokens(self, prompt_len: int) -> int:
        if isinstance(self.budget, int):
            return self.budget
        return max(1, round(self.budget * prompt_len))

    def recent_tokens(self, budget: int) -> int:
        return round(self.recent * budget)

    @property
    def prompt_observe(self) -> int:
        """Score only each row's last this-many prompt queries (0: all of them)."""
        return 0

    def options(self) -> list[str]:
        """What ``describe`` adds beyond budget and recent window."""
        return [f"evict every {self.evict_every}"] if self.evict_every > 1 else []

    def describe(self) -> str:
        size = f"{self.budget:.0%} of prompt" if isinstance(self.budget, float) else f"{self.budget} tokens"
        return f"{self.name} ({', '.join([size, f'recent {self.recent:.0%}', *self.options()])})"

    def priority(self, layer, next_positions: torch.Tensor, budgets: Budgets) -> torch.Tensor:
        """[B, 1 or Hkv, S]: higher is kept first (the recent window is always kept)."""
        raise NotImplementedError

    def start_score(self, step: int, positions: torch.Tensor) -> torch.Tensor | None:
        """The score a token written at decode ``step`` starts with, per row (``positions`` [B, 1]); None: 0."""
        return None

    def score_contribution(self, step: int, total_steps: int) -> ScoreContribution:
        """What each query adds to the scores at ``step`` (scoring policies): by default its attention weights."""
        return ScoreContribution()

    def after_prompt(self, layer) -> None:
        """Once per layer, right after the prompt pass scored it and before its first eviction."""

    def retention(self, lengths: list[int], device, total_steps: int) -> Retention:
        """What each layer keeps in a run of ``total_steps`` over prompts of ``lengths`` (the engine asks)."""
        return Evicting(self, lengths, device, total_steps)

    def evict(self, layer, budgets: Budgets, next_positions: torch.Tensor, *, capacity: int,
              due: bool = True) -> None:
        """Keep, per row and head, the recent window plus the top-priority slots, ``budgets.keep[row]`` in all.

        Sliding-window layers first drop what their window no longer shows, so they
        hold the smaller of their window and the budget. The recent window is found
        from positions (the newest ``budgets.recent[row]`` positions), not from slot
        order, so it is right however eviction has shuffled the slots. ``due`` is
        false on the steps between evictions (``evict_every``); out-of-window slots are
        freed anyway. After the prompt the kept slots move into storage of ``capacity``.
        """
        if not layer.settled:
            self.after_prompt(layer)
        elif not due and layer.window is None:
            return  # between evictions a global layer frees nothing; ``write`` kept its counts
        elif due and self._evict_one(layer, budgets, next_positions):
            return
        positions = layer.positions[..., :layer.used]
        rows = positions.shape[0]
        prio = self.priority(layer, next_positions, budgets)[..., :layer.used]
        heads = max(prio.shape[1], positions.shape[1])
        next_pos = next_positions[:, None, None]
        valid = positions >= 0
        if layer.window is not None:
            valid &= positions > (next_pos - layer.window)
        valid = valid.expand(rows, heads, -1)
        count = valid.sum(-1)  # [B, H]
        excess = (count - budgets.keep[:, None]).clamp_(min=0) if due else torch.zeros_like(count)
        most, held, fewest = torch.stack([excess.max(), (count - excess).max(), (count - excess).min()]).tolist()
        if most > 0:
            protected = (positions >= next_pos - budgets.recent[:, None, None]).expand(rows, heads, -1)
            # Victims: lowest priority among the unprotected first, then (only where the recent
            # window alone exceeds the budget) protected slots; never a free one.
            rank = prio.float().clamp(max=_PROTECTED).expand(rows, heads, -1)
            rank = torch.where(valid, torch.where(protected, _PROTECTED, rank), math.inf)
            victims = rank.topk(most, dim=-1, largest=False).indices
            real = torch.arange(most, device=positions.device) < excess[..., None]
            valid = valid & ~torch.zeros_like(valid).scatter_(-1, victims, real)
        layer.keep_only(valid, held=held, fewest=fewest, capacity=capacity)

    def _evict_one(self, layer, budgets: Budgets, next_positions: torch.Tensor) -> bool:
        """The steady state, in a handful of ops: every row and head holds one token too many.

        A global layer then drops its lowest-priority unprotected slot; a sliding layer
        whose budget covers its window drops the token that just left the window (its
        oldest). Returns False where that does not hold (the general path decides).
        """
        if layer.full_from != layer.used or layer.held != layer.used:
            return False  # some row or head has a free slot: counts differ
        positions = layer.positions
        if layer.window is not None:
            if budgets.least < layer.window - 1 or layer.held != layer.window:
                return False
            victim = positions.min(dim=-1, keepdim=True).indices
        else:
            if budgets.most != budgets.least or layer.held != budgets.most + 1:
                return False
            prio = self.priority(layer, next_positions, budgets).float()
            fused = kernels.for_tensors(prio)
            if fused is not None:  # the three ops below in one C++ call
                victim = fused.lowest_unprotected(prio, positions, next_positions, budgets.recent)
            else:
                protected = positions >= (next_positions - budgets.recent)[:, None, None]
                # min(...).indices rather than argmin: half the time on CPU for these sizes.
                victim = prio.masked_fill(protected, _PROTECTED).min(dim=-1, keepdim=True).indices
        layer.free(victim)
        return True


@dataclass(frozen=True)
class FullPolicy(KVPolicy):
    """No eviction: the reference every other policy is compared with."""

    name: ClassVar[str] = "full"
    evicts: ClassVar[bool] = False

    def budget_tokens(self, prompt_len: int) -> int:
        return prompt_len

    def retention(self, lengths, device, total_steps):
        return Appending(total_steps)


@dataclass(frozen=True)
class WindowPolicy(KVPolicy):
    """The last ``k`` tokens only."""

    name: ClassVar[str] = "window"

    def priority(self, layer, next_positions, budgets):
        return layer.positions.float()


@dataclass(frozen=True)
class StreamingPolicy(KVPolicy):
    """StreamingLLM (Xiao et al., 2023): 4 attention-sink tokens plus the most recent ``k - 4``."""

    name: ClassVar[str] = "streaming"

    def priority(self, layer, next_positions, budgets):
        pos = layer.positions.float()
        return torch.where((layer.positions >= 0) & (layer.positions < SINK_TOKENS), math.inf, pos)


def _max_pool(scores: torch.Tensor, size: int) -> torch.Tensor:
    """Max over ``size`` neighbouring slots (centred), so a multi-token item is kept or dropped whole."""
    b, h, s = scores.shape
    pooled = F.max_pool1d(scores.reshape(b * h, 1, s), size, stride=1, padding=size // 2)
    return pooled[..., :s].reshape(b, h, s)


@dataclass(frozen=True)
class H2OPolicy(KVPolicy):
    """Heavy hitters (Zhang et al., 2023): accumulated plain attention, plus the recent window.

    Query-aware options, all off by default (the paper):

    * ``observe = W``: the prompt pass scores only each row's last ``W`` queries (SnapKV's
      observation window), so what the question at the end of a prompt asks for wins
      over what hundreds of earlier queries looked at;
    * ``pool = K``: max-pool the prompt scores over ``K`` neighbouring positions, so a
      multi-token item (a number, a name) is kept or dropped whole;
    * ``normalize``: divide each key's score by the number of queries that could see it,
      so early tokens do not win merely by being early.
    """

    observe: int = 0
    pool: int = 1
    normalize: bool = False

    name: ClassVar[str] = "h2o"
    needs_scores: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "observe", require_int("observe", self.observe, 0, 1_000_000))
        object.__setattr__(self, "pool", require_int("pool", self.pool, 1, 1025))
        if not isinstance(self.normalize, bool):
            raise InputError(f"normalize must be true or false, got {self.normalize!r}")

    @property
    def prompt_observe(self) -> int:
        return self.observe

    def options(self) -> list[str]:
        out = [f"observe {self.observe}"] if self.observe else []
        out += [f"pool {self.pool}"] if self.pool > 1 else []
        out += ["normalized"] if self.normalize else []
        return out + super().options()

    def after_prompt(self, layer):
        if self.pool > 1 and layer.scores is not None:
            layer.scores = _max_pool(layer.scores, self.pool)

    def priority(self, layer, next_positions, budgets):
        if not self.normalize:
            return layer.scores
        # Queries that saw position p so far: every later one, except prompt queries left
        # out of the observation window.
        first_query = layer.positions
        if self.observe:
            first_query = torch.maximum(first_query, (budgets.prompt_lengths - self.observe)[:, None, None])
        seen = (next_positions[:, None, None] - first_query).clamp(min=1)
        return layer.scores / seen


@dataclass(frozen=True)
class KeyformerPolicy(H2OPolicy):
    """Keyformer: accumulated ``softmax((z + g) / tau)``, ``g ~ Gumbel(0, 1)``, plus the recent window.

    ``tau`` goes linearly from ``tau_init`` to ``tau_end`` over the generation
    (paper Sec. 3.3). The noise shapes the score only; attention stays exact.
    ``noise=False`` leaves a temperature-scaled H2O (equal to H2O at tau = 1).
    The query-aware options (``observe``, ``pool``, ``normalize``) are H2O's.
    """

    tau_init: float = 1.0
    tau_end: float = 2.0
    noise: bool = True

    name: ClassVar[str] = "keyformer"

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "tau_init", require_float("tau_init", self.tau_init, 0.0, 100.0, lo_open=True))
        object.__setattr__(self, "tau_end", require_float("tau_end", self.tau_end, 0.0, 100.0, lo_open=True))

    def temperature(self, step: int, total_steps: int) -> float:
        return self.tau_init + (self.tau_end - self.tau_init) * step / max(1, total_steps)

    def score_contribution(self, step, total_steps):
        return ScoreContribution(self.temperature(step, total_steps), self.seed if self.noise else None)


@dataclass(frozen=True)
class TOVAPolicy(KVPolicy):
    """TOVA (Oren et al., 2024): keep the slots the *current* query attends to most, averaged over heads.

    Nothing accumulates: each step's attention replaces the scores. After the prompt
    the last prompt query decides. One choice per row, shared by its KV heads.
    """

    name: ClassVar[str] = "tova"
    needs_scores: ClassVar[bool] = True
    accumulates: ClassVar[bool] = False

    @property
    def prompt_observe(self) -> int:
        return 1

    def priority(self, layer, next_positions, budgets):
        return layer.scores.mean(dim=1, keepdim=True)


@dataclass(frozen=True)
class SnapKVPolicy(KVPolicy):
    """SnapKV (Li et al., 2024): after the prompt, keep what its last ``observe`` queries attend to,
    max-pooled over ``pool`` positions; while decoding, the chosen prompt tokens stay and generated
    tokens pass through the recent window (oldest out first). Decode steps compute no scores."""

    observe: int = 32
    pool: int = 7

    name: ClassVar[str] = "snapkv"
    needs_scores: ClassVar[bool] = True
    scores_while_decoding: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "observe", require_int("observe", self.observe, 1, 1_000_000))
        object.__setattr__(self, "pool", require_int("pool", self.pool, 1, 1025))

    @property
    def prompt_observe(self) -> int:
        return self.observe

    def options(self) -> list[str]:
        return [f"observe {self.observe}", f"pool {self.pool}", *super().options()]

    def after_prompt(self, layer):
        if self.pool > 1 and layer.scores is not None:
            layer.scores = _max_pool(layer.scores, self.pool)

    def start_score(self, step, positions):
        # Prompt tokens rank by their observed score (>= 0) above every generated token; among generated
        # tokens the newer ones rank higher. Decode steps add nothing, so a generated token keeps this.
        return None if step == 0 else -1.0 / (2.0 + positions[:, 0].float())

    def priority(self, layer, next_positions, budgets):
        return layer.scores


KV_POLICIES: dict[str, type[KVPolicy]] = {
    cls.name: cls for cls in (FullPolicy, WindowPolicy, StreamingPolicy, H2OPolicy, KeyformerPolicy, TOVAPolicy,
                              SnapKVPolicy)
}


def policy_options(name: str) -> tuple[str, ...]:
    """The method-specific fields of policy ``name`` (beyond budget, recent, seed, evict_every)."""
    common = {f.name for f in dataclasses.fields(KVPolicy)}
    return tuple(f.name for f in dataclasses.fields(KV_POLICIES[name]) if f.name not in common)


def parse_policy_spec(spec: str) -> tuple[str, dict]:
    """``"keyformer:observe=64,pool=7,normalize=1"`` -> ``("keyformer", {"observe": 64, ...})``.

    Lets one run compare the same policy with different options. Values are read as
    numbers (``true``/``false`` also accepted); the policy validates them.
    """
    name, _, rest = str(spec).partition(":")
    options = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise InputError(f"KV policy option {item!r} in {spec!r} is not of the form name=value")
        text = value.strip().lower()
        if text in ("true", "false"):
            options[key.strip()] = text == "true"
            continue
        try:
            number = float(text)
        except ValueError:
            raise InputError(f"KV policy option {key.strip()}={value!r} in {spec!r} is not a number") from None
        options[key.strip()] = int(number) if number.is_integer() and "." not in text else number
    name = name.strip()
    switches = {f.name for f in dataclasses.fields(KV_POLICIES[name]) if isinstance(f.default, bool)} \
        if name in KV_POLICIES else set()
    for key in switches & options.keys():
        if options[key] in (0, 1):
            options[key] = bool(options[key])
    return name, options


def format_policy_spec(name: str, options: dict) -> str:
    """The inverse of ``parse_policy_spec``: ``("keyformer", {"observe": 32})`` -> ``"keyformer:observe=32"``."""
    if not options:
        return name
    return f"{name}:" + ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items())


def make_kv_policy(name: str, budget=0.5, recent: float = 0.3, *, seed: int = 0, evict_every: int = 1,
                   **options) -> KVPolicy:
    """Build a policy by name, validating every parameter.

    ``options`` are method-specific (``tau_init``, ``observe``, ``pool``, ...); ``None``
    means "the method's default". Setting one the method does not have is an error.
    """
    cls = KV_POLICIES.get(name)
    if cls is None:
        raise InputError(f"unknown KV policy {name!r}; choose one of {', '.join(KV_POLICIES)}")
    given = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(given) - set(policy_options(name)))
    if unknown:
        has = ", ".join(policy_options(name)) or "none"
        raise InputError(f"KV policy {name!r} has no option {', '.join(map(repr, unknown))} (its options: {has})")
    return cls(budget=budget, recent=recent, seed=seed, evict_every=evict_every, **given)


@dataclass(frozen=True)
class KVSpec:
    """A KV policy as the CLI, the app and the library ask for it; ``build`` is the one edge that checks it.

    ``budget`` is in the library's one unit (``parse_budget``: a fraction of the prompt
    or a token count); the app converts its percentage and the CLI its text before this.
    ``options`` are the policy's own (``policy_options(name)``), None meaning its default.
    """

    name: str
    budget: float | int = 0.5
    recent: float = 0.3
    seed: int = 0
    evict_every: int = 1
    options: dict = field(default_factory=dict)

    def build(self) -> KVPolicy:
        return make_kv_policy(self.name, self.budget, self.recent, seed=self.seed, evict_every=self.evict_every,
                              **self.options)
