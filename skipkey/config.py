"""Frozen, validated request settings: the edge where bad input is refused.

Every public entry point (library, CLI, app) builds these; the engine trusts
them. Messages name the problem and the allowed range.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from skipkey.errors import InputError

MAX_NEW_TOKENS_CAP = 2048  # documented cap: enough for every benchmark, bounded memory per request
MAX_BATCH = 64


def is_int(value: object) -> bool:
    """An integer (numpy's too), not a bool: True is an int to Python, never a count here."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def require_int(name: str, value, lo: int, hi: int | None = None, *, exact: bool = False, lo_is: str = "",
                hi_is: str = "") -> int:
    """``value`` as an int in [lo, hi], or an InputError that names the allowed range.

    Sliders and JSON clients send 6.0 for 6, so a whole float passes, unless
    ``exact`` (the schedules' own parameters, typed by the library). ``lo_is`` and
    ``hi_is`` say where a bound comes from, e.g. " (warmup + 1)"; ``exact`` checks
    word their message as "an integer from lo to hi", the others as "in lo..hi".
    """
    whole = (not exact and isinstance(value, float) and math.isfinite(value) and value.is_integer())
    if (is_int(value) or whole) and lo <= value and (hi is None or value <= hi):
        return int(value)
    if exact:
        allowed = f"an integer >= {lo}{lo_is}" if hi is None else f"an integer from {lo}{lo_is} to {hi}{hi_is}"
        raise InputError(f"{name} must be {allowed}, got {value!r}")
    if not (is_int(value) or whole):
        raise InputError(f"{name} must be a whole number, got {value!r}")
    allowed = f"{lo}{lo_is}..{hi}{hi_is}" if hi is not None else f">= {lo}{lo_is}"
    raise InputError(f"{name} must be in {allowed}, got {int(value)}")


def decode_steps(max_new_tokens: int) -> int:
    """Decode steps a SkipDecode schedule covers: token 0 comes from the prompt pass, the rest from steps.

    At least 1, so a schedule is defined even for a single new token.
    """
    return max(1, max_new_tokens - 1)


def require_float(name: str, value, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """``value`` as a finite float in [lo, hi] (or (lo, hi] with ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if value < lo or value > hi or (lo_open and value == lo):
        raise InputError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")
    return value


@dataclass(frozen=True)
class GenerationSettings:
    """How tokens are chosen; identical for both sides of a comparison."""

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False  # benchmarks: always produce max_new_tokens

    def __post_init__(self):
        object.__setattr__(self, "max_new_tokens",
                           require_int("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS_CAP))
        if not isinstance(self.do_sample, bool):
            raise InputError(f"do_sample must be true or false, got {self.do_sample!r}")
        object.__setattr__(self, "temperature", require_float("temperature", self.temperature, 0.0, 10.0,
                                                              lo_open=True))
        object.__setattr__(self, "top_k", require_int("top_k", self.top_k, 0, 100_000))
        object.__setattr__(self, "top_p", require_float("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        object.__setattr__(self, "seed", require_int("seed", self.seed, 0, 2**63 - 1))


def validate_prompt_ids(prompt_ids: list[list[int]], context_length: int, max_new_tokens: int) -> None:
    """Refuse empty prompts and prompts that leave no room for the new tokens."""
    if not prompt_ids:
        raise InputError("no prompt given: pass at least one prompt")
    if len(prompt_ids) > MAX_BATCH:
        raise InputError(f"batch of {len(prompt_ids)} prompts is too large; allowed 1..{MAX_BATCH}")
    if max_new_tokens >= context_length:
        raise InputError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's context of "
                         f"{context_length} tokens; allowed: 1..{context_length - 1}")
    for i, ids in enumerate(prompt_ids):
        which = f"prompt {i + 1}" if len(prompt_ids) > 1 else "the prompt"
        if len(ids) == 0:
            raise InputError(f"{which} is empty: enter some text")
        if len(ids) + max_new_tokens > context_length:
            raise InputError(
                f"{which} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds the model's "
                f"context of {context_length} tokens (allowed: at most {context_length - max_new_tokens} prompt tokens)")
