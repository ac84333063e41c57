"""How much each decoder layer changes the hidden state: what the ``importance`` layer ranking measures.

It lives in the core because it reads hidden states, which only the engine sees
(at prefill, when a SkipDecode plan asks for it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from skipkey.errors import InputError


def layer_importance(
    inputs: torch.Tensor, outputs: torch.Tensor, mask: torch.Tensor | None = None
) -> float:
    """Mean over tokens of ``1 - cos(layer input, layer output)`` for one layer.

    ``inputs`` and ``outputs`` are the hidden states ``[B, S, H]`` before and after
    the layer; ``mask`` ``[B, S]`` is nonzero for the tokens to count (e.g. the
    attention mask, to leave out padding). Near 0, the layer is close to the
    identity that skipping it puts in its place.
    """
    if inputs.dim() != 3 or inputs.shape != outputs.shape:
        raise InputError(
            f"inputs and outputs must both be [batch, seq, hidden], got "
            f"{tuple(inputs.shape)} and {tuple(outputs.shape)}"
        )
    change = 1.0 - F.cosine_similarity(inputs.float(), outputs.float(), dim=-1)
    if mask is None:
        return change.mean().item()
    if mask.shape != change.shape:
        raise InputError(
            f"mask must be [batch, seq] = {tuple(change.shape)}, got {tuple(mask.shape)}"
        )
    counted = mask.bool()
    if not counted.any():
        raise InputError("mask selects no tokens; at least one is needed")
    return change[counted].mean().item()
