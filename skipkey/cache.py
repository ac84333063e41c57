"""The engine-owned KV cache: one ``LayerCache`` per decoder layer.

Each layer holds its keys and values *with the original position of every slot*
(``positions``, -1 for an empty slot), so attention masks are built from
positions rather than from slot indices. That is what lets a layer's cache be
evicted (Keyformer), trimmed to a sliding window (Gemma 3) or dropped whole
(SkipDecode) while every mask stays right. Slots stay in position order.

Shapes: keys/values ``[B, Hkv, S, D]``; positions and scores ``[B, Hp, S]``
where ``Hp`` is 1 while all KV heads hold the same positions and ``Hkv`` once a
per-head policy has evicted.
"""

from __future__ import annotations

import torch

EMPTY = -1


class LayerCache:
    """Keys, values, their positions and (for scoring policies) accumulated scores."""

    __slots__ = ("keys", "values", "positions", "scores", "window", "dense")

    def __init__(self, window: int | None):
        self.window = window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        # True when every slot is filled, so a decode query may attend to all of them
        # without a mask (the fast path that also matches ``generate`` bit for bit).
        self.dense = True

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, dense: bool):
        """Add new slots; ``positions`` is ``[B, q]`` (EMPTY for padding)."""
        new_pos = positions[:, None, :]
        if self.keys is None:
            self.keys, self.values, self.positions = keys, values, new_pos
            self.dense = dense
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
            if self.positions.shape[1] != 1:
                new_pos = new_pos.expand(-1, self.positions.shape[1], -1)
            self.positions = torch.cat([self.positions, new_pos], dim=2)
            self.dense = self.dense and dense
        if self.scores is not None:
            new_scores = torch.zeros(self.positions.shape[0], self.scores.shape[1], keys.shape[2],
                                     device=keys.device, dtype=self.scores.dtype)
            self.scores = torch.cat([self.scores, new_scores], dim=2)
        return self.keys, self.values

    def ensure_scores(self):
        if self.scores is None and self.positions is not None:
            self.scores = torch.zeros(self.positions.shape, device=self.positions.device, dtype=torch.float32)

    def clear(self):
        self.keys = self.values = self.positions = self.scores = None
        self.dense = True

    def trim_to_window(self, next_positions: torch.Tensor):
        """Drop slots that no future query can see through the sliding window.

        ``next_positions`` [B] is each row's next query position. While every slot
        of every head holds the same positions in order, the rows advance in lock
        step and the last ``window - 1`` slots are exactly the visible ones.
        """
        if self.window is None or self.keys is None or self.keys.shape[2] <= self.window - 1:
            return
        if self.positions.shape[1] != 1 or not self.dense:
            return self.keep_where(self.positions > (next_positions[:, None, None] - self.window))
        keep = self.window - 1
        self.keys = self.keys[:, :, -keep:]
        self.values = self.values[:, :, -keep:]
        self.positions = self.positions[:, :, -keep:]
        if self.scores is not None:
            self.scores = self.scores[:, :, -keep:]

    def keep_where(self, keep: torch.Tensor):
        """Keep the slots where ``keep`` ([B, Hp, S], bool) is true, compacted to the right."""
        counts = keep.sum(-1)
        size = int(counts.max())
        # Kept slots rank above all others, and among themselves by slot (= position) order.
        slot = torch.arange(keep.shape[-1], device=keep.device)
        rank = slot + keep.long() * keep.shape[-1]
        idx = rank.topk(size, dim=-1).indices.sort(dim=-1).values
        self.gather(idx, kept_valid=keep.gather(-1, idx))
        self.dense = bool((counts == size).all())

    def gather(self, idx: torch.Tensor, kept_valid: torch.Tensor | None = None):
        """Reorder/select slots by ``idx`` [B, Hp, K]; per-head ``idx`` makes the cache per-head."""
        b, hkv, _, d = self.keys.shape
        if idx.shape[1] == 1:
            kv_idx = idx[..., None].expand(b, hkv, idx.shape[-1], d)
        else:
            kv_idx = idx[..., None].expand(-1, -1, -1, d)
        self.keys = self.keys.gather(2, kv_idx)
        self.values = self.values.gather(2, kv_idx)
        positions = self.positions.expand(b, idx.shape[1], -1).gather(-1, idx)
        if kept_valid is not None:
            positions = torch.where(kept_valid, positions, EMPTY)
        self.positions = positions
        if self.scores is not None:
            self.scores = self.scores.expand(b, idx.shape[1], -1).gather(-1, idx)


class KVCache:
    """Per-layer caches, called by the model's own attention modules through ``update``."""

    def __init__(self, windows: list[int | None]):
        self.layers = [LayerCache(w) for w in windows]
        # Positions of the tokens being fed in this forward, set by the engine.
        self.pending_positions: torch.Tensor | None = None
        self.pending_dense = True

    # transformers' attention modules call this with the new, rotated keys.
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.layers[layer_idx].append(key_states, value_states, self.pending_positions, self.pending_dense)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def lengths(self) -> tuple[int, ...]:
        return tuple(len(layer) for layer in self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return len(self.layers[layer_idx])
