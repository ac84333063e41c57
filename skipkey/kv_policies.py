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

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from skipkey.config import require_float, require_int
from skipkey.errors import InputError

SINK_TOKENS = 4  # StreamingLLM's attention sinks


def parse_budget(value) -> float | int:
    """A fraction of the prompt in (0, 1], or a whole number of tokens above 1."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise InputError(f"KV budget must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"KV budget must be a number, got {value!r}")
    if 0 < value <= 1:
        return float(value)
    if value > 1 and float(value).is_integer():
        return int(value)
    raise InputError(f"KV budget {value} is invalid: use a fraction of the prompt in (0, 1] (0.5 = half) "
                     f"or a whole number of tokens above 1 (e.g. 256)")


@dataclass(frozen=True)
class KVPolicy:
    """Budget ``k`` per row, layer and KV head: ``round(rho * P)`` or an absolute count.

    ``recent`` is the share of ``k`` reserved for the most recent tokens (``w = round(r * k)``).
    """

    budget: float | int = 0.5
    recent: float = 0.3
    seed: int = 0

    name: ClassVar[str] = ""
    needs_scores: ClassVar[bool] = False
    evicts: ClassVar[bool] = True

    def __post_init__(self):
        object.__setattr__(self, "budget", parse_budget(self.budget))
        object.__setattr__(self, "recent", require_float("KV recent-window share", self.recent, 0.0, 1.0))
        object.__setattr__(self, "seed", require_int("seed", self.seed, 0, 2**63 - 1))

    def budget_tokens(self, prompt_len: int) -> int:
        if isinstance(self.budget, int):
            return self.budget
        return max(1, round(self.budget * prompt_len))

    def recent_tokens(self, budget: int) -> int:
        return round(self.recent * budget)

    def describe(self) -> str:
        size = f"{self.budget:.0%} of prompt" if isinstance(self.budget, float) else f"{self.budget} tokens"
        return f"{self.name} ({size}, recent {self.recent:.0%})"

    def priority(self, layer) -> torch.Tensor:
        """[B, 1 or Hkv, S]: higher is kept first (the recent window is always kept)."""
        raise NotImplementedError

    def contribution(self, logits: torch.Tensor, step: int, total_steps: int, where) -> torch.Tensor:
        """Score added by each query: ``logits`` [B, Hkv, G, q, S] (-inf where masked)."""
        raise NotImplementedError

    def evict(self, layer, budgets: list[int], next_positions: torch.Tensor) -> None:
        """Keep, per row and head, the recent window plus the top-priority slots, ``budgets[row]`` in all.

        Sliding-window layers first drop what their window no longer shows, so they
        hold the smaller of their window and the budget.
        """
        size = len(layer)
        window = layer.window
        if size <= min(budgets) and (window is None or size <= window - 1):
            return
        rows = layer.keys.shape[0]
        prio = self.priority(layer)
        heads = max(prio.shape[1], layer.positions.shape[1])
        positions = layer.positions.expand(rows, heads, size)
        prio = prio.expand(rows, heads, size).float()
        valid = positions >= 0
        if window is not None:
            valid &= positions > (next_positions[:, None, None] - window)
        device = positions.device
        k = torch.tensor(budgets, device=device)[:, None, None]
        w = torch.tensor([self.recent_tokens(b) for b in budgets], device=device)[:, None, None]
        newest_rank = valid.flip(-1).cumsum(-1).flip(-1)  # 1 = newest valid slot
        recent = valid & (newest_rank <= w)
        prio = torch.where(recent, math.inf, torch.where(valid, prio, -math.inf))
        # The physical size is what the fullest row and head really keeps: a sliding-window
        # layer may hold fewer valid slots than the budget, and its cache must shrink to that.
        keep_count = min(max(budgets), int(valid.sum(-1).max()))
        values, idx = prio.topk(keep_count, dim=-1)
        ok = (torch.arange(keep_count, device=device) < k) & (values > -math.inf)
        idx, order = idx.sort(dim=-1)  # back to position order
        ok = ok.gather(-1, order)
        layer.gather(idx, kept_valid=ok)
        layer.dense = bool(ok.all())


@dataclass(frozen=True)
class FullPolicy(KVPolicy):
    """No eviction: the reference every other policy is compared with."""

    name: ClassVar[str] = "full"
    evicts: ClassVar[bool] = False

    def budget_tokens(self, prompt_len: int) -> int:
        return prompt_len


@dataclass(frozen=True)
class WindowPolicy(KVPolicy):
    """The last ``k`` tokens only."""

    name: ClassVar[str] = "window"

    def priority(self, layer):
        return layer.positions.float()


@dataclass(frozen=True)
class StreamingPolicy(KVPolicy):
    """StreamingLLM: 4 attention-sink tokens plus the most recent ``k - 4``."""

    name: ClassVar[str] = "streaming"

    def priority(self, layer):
        pos = layer.positions.float()
        return torch.where((layer.positions >= 0) & (layer.positions < SINK_TOKENS), math.inf, pos)


@dataclass(frozen=True)
class H2OPolicy(KVPolicy):
    """Heavy hitters: accumulated plain attention, plus the recent window."""

    name: ClassVar[str] = "h2o"
    needs_scores: ClassVar[bool] = True

    def priority(self, layer):
        return layer.scores

    def contribution(self, logits, step, total_steps, where):
        return torch.softmax(logits, dim=-1)


@dataclass(frozen=True)
class KeyformerPolicy(H2OPolicy):
    """Keyformer: accumulated ``softmax((z + g) / tau)``, ``g ~ Gumbel(0, 1)``, plus the recent window.

    ``tau`` goes linearly from ``tau_init`` to ``tau_end`` over the generation
    (paper Sec. 3.3). The noise shapes the score only; attention stays exact.
    ``noise=False`` leaves a temperature-scaled H2O (equal to H2O at tau = 1).
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

    def contribution(self, logits, step, total_steps, where):
        if self.noise:
            logits = logits + gumbel_noise(self.seed, where, logits.shape)
        return torch.softmax(logits / self.temperature(step, total_steps), dim=-1)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 (wrapping arithmetic): a counter-based hash."""
    x = x ^ _shr(x, 30)
    x = x * -4658895280553007687  # 0xbf58476d1ce4e5b9 as a signed int64
    x = x ^ _shr(x, 27)
    x = x * -7723592293110705685  # 0x94d049bb133111eb
    return x ^ _shr(x, 31)


def gumbel_noise(seed: int, where, shape) -> torch.Tensor:
    """Gumbel(0, 1) noise for each (layer, KV head, query head, query position, key position).

    A counter-based draw keyed by the seed: a row gets the same noise alone or in a
    batch, whatever its padding and wherever eviction moved its slots.
    """
    b, hkv, groups, q, s = shape
    device = where.query_positions.device
    head = torch.arange(hkv * groups, device=device).view(1, hkv, groups, 1, 1)
    base = _mix(_mix(torch.tensor(seed, device=device) * 0x9E3779B1 + where.layer) + head * 0x632BE5AB)
    # One mixing round over an odd-weighted sum of the two positions: this line runs over
    # every (query, key) pair of a long prompt, so it is kept to a single round.
    key = _mix(base + where.query_positions[:, None, None, :, None] * 0x85EBCA77
               + where.key_positions.expand(b, hkv, s)[:, :, None, None, :] * 0xC2B2AE3D)
    return _gumbel_from_bits(_shr(key, 40))


_TOP_UNIFORM = 1.0 - 2.0 ** -24  # the largest float32 below 1


def _gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) from 24 random bits, finite for every input.

    ``(bits + 0.5) / 2**24`` lies strictly inside (0, 1), but in float32 the top
    value rounds to exactly 1.0, where ``-log(-log(u))`` is +inf: one such entry
    turns a softmax row into NaN and, summed into the scores, a whole head's
    eviction into garbage. Long prompts score millions of pairs, so it happens.
    """
    uniform = ((bits.float() + 0.5) / float(1 << 24)).clamp_(max=_TOP_UNIFORM)
    return -torch.log(-torch.log(uniform))


POLICIES: dict[str, type[KVPolicy]] = {
    cls.name: cls for cls in (FullPolicy, WindowPolicy, StreamingPolicy, H2OPolicy, KeyformerPolicy)
}


def make_kv_policy(name: str, budget=0.5, recent: float = 0.3, *, tau_init: float = 1.0, tau_end: float = 2.0,
                   seed: int = 0) -> KVPolicy:
    """Build a policy by name, validating every parameter."""
    cls = POLICIES.get(name)
    if cls is None:
        raise InputError(f"unknown KV policy {name!r}; choose one of {', '.join(POLICIES)}")
    if cls is KeyformerPolicy:
        return cls(budget=budget, recent=recent, seed=seed, tau_init=tau_init, tau_end=tau_end)
    return cls(budget=budget, recent=recent, seed=seed)
