"""What each layer's cache keeps once the layer has run: the interface the engine calls, and its default.

A KV policy hands the engine its own retention (``KVPolicy.retention``, in
``skipkey.kv.budgets``); without one every layer appends like ``model.generate``,
and a sliding-window layer keeps only what its window still shows.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Retention(Protocol):
    """Sized once per run; ``after`` runs once per layer and step, right after the layer ran."""

    def prepare(self, cache) -> None:
        """Before the prompt: mark which layers' tokens are scored (``LayerCache.scored``)."""

    def after(self, layer, step: int, next_positions: torch.Tensor) -> None:
        """Settle ``layer``'s cache after step ``step`` (0: the prompt); ``next_positions`` [B] on its device."""


class Appending:
    """No eviction: every layer appends (room for every token still to come); a sliding layer trims to its window."""

    def __init__(self, total_steps: int):
        self.spare = total_steps

    def prepare(self, cache) -> None:
        for layer in cache.layers:
            layer.scored = False

    def after(self, layer, step: int, next_positions: torch.Tensor) -> None:
        if layer.keys is not None:
            layer.trim_to_window(self.spare)
