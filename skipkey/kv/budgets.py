"""The KV budget's one unit (``parse_budget``), budgets per row, and the retention an evicting policy hands the engine (``KVPolicy.retention``).

Storage is sized here, once: an evicting layer holds its budget plus the
eviction interval (the slots the next tokens are written into); an appending
layer (one the budget never binds) holds the prompt plus every token still to come.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from skipkey.config import is_int
from skipkey.errors import InputError


def parse_budget(value) -> float | int:
    """The one unit of a KV budget: a fraction of the prompt (a float in (0, 1]) or a token count (an int above 1).

    Text (the CLI's) is read as an int where it is one (``"256"``), else as a float. A
    whole float above 1 is refused rather than read as tokens: ``2.0`` is what a
    percentage of 200 becomes, never a count. The int 1 is the whole prompt.
    """
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text) if text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            raise InputError(f"KV budget must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (numbers.Real)) or not math.isfinite(value):
        raise InputError(f"KV budget must be a number, got {value!r}")
    if 0 < value <= 1:
        return float(value)
    if is_int(value) and value > 1:
        return int(value)
    raise InputError(f"KV budget {value} is invalid: use a fraction of the prompt in (0, 1] (0.5 = half) "
                     f"or a whole number of tokens above 1 (e.g. 256)")


@dataclass(frozen=True)
class Budgets:
    """Per row of a batch: slots to keep, how many of them are the recent window, and the prompt length."""

    keep: torch.Tensor  # [B]
    recent: torch.Tensor  # [B]
    prompt_lengths: torch.Tensor  # [B]

    @classmethod
    def for_prompts(cls, policy, lengths: list[int], device) -> "Budgets":
        keep = [policy.budget_tokens(n) for n in lengths]
        return cls(torch.tensor(keep, device=device), torch.tensor([policy.recent_tokens(k) for k in keep],
                                                                  device=device),
                   torch.tensor(lengths, device=device), max(keep), min(keep))

    most: int  # the largest and smallest budget in the batch, as Python ints (no device sync)
    least: int


class Evicting:
    """An evicting policy's retention (``skipkey.core.retention.Retention``): each layer keeps its budget.

    A layer the budget never binds (a sliding window smaller than every budget, or a
    budget above the whole run) appends like full mode, and nothing scores its tokens.
    """

    def __init__(self, policy, lengths: list[int], device, total_steps: int):
        self.policy = policy
        self.spare = total_steps  # appending layers: room for every new token
        self.longest = max(lengths) + total_steps
        self.lengths = lengths
        self.budgets = Budgets.for_prompts(policy, lengths, device)
        self.most = self.budgets.most
        self.on_device = {device: self.budgets}

    def limit(self, layer) -> int:
        """The most tokens ``layer`` can ever hold for a query: its window, or the whole run."""
        return self.longest if layer.window is None else layer.window - 1

    def prepare(self, cache) -> None:
        for layer in cache.layers:
            layer.scored = self.budgets.least < self.limit(layer)

    def after(self, layer, step: int, next_positions: torch.Tensor) -> None:
        if layer.keys is None:
            return
        if not layer.scored:
            layer.trim_to_window(self.spare)
            return
        tokens = min(self.most, self.limit(layer))
        every = self.policy.evict_every
        budgets = self.on_device.get(next_positions.device)
        if budgets is None:  # each layer's device has its own copy
            budgets = self.on_device[next_positions.device] = Budgets.for_prompts(
                self.policy, self.lengths, next_positions.device)
        self.policy.evict(layer, budgets, next_positions, capacity=tokens + every, due=step % every == 0)
