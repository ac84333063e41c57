"""The engine-owned KV cache: one ``LayerCache`` per decoder layer.

Each layer holds its keys and values *with the original position of every slot*
(``positions``, EMPTY = -1 for a free slot), so attention masks are built from
positions rather than from slot indices. That is what lets a layer's cache be
evicted (Keyformer), trimmed to a sliding window (Gemma 3) or dropped whole
(SkipDecode) while every mask stays right.

Storage never copies the cache on a decode step. The prompt pass keeps the
prompt's own key/value tensors; right after it, ``settle`` moves what the layer
keeps into a buffer preallocated for the rest of the run. From then on:

* an *appending* layer (no eviction) writes each new token at the next slot.
  Slots stay in position order, so a decode step reads exactly the tensor
  ``generate`` would (bit for bit). A sliding-window layer reads the view of its
  last ``window`` slots and, when its buffer is full, moves its last
  ``window - 1`` slots to the front: one copy every ``window`` steps;
* an *evicting* layer (capacity = budget + eviction interval) writes each new
  token into a slot that eviction freed, per row and KV head (``scatter_``).
  Slots then stop being in position order; nothing depends on that order.

Shapes: keys/values ``[B, Hkv, C, D]``; positions and scores ``[B, Hp, C]``
where ``Hp`` is 1 while all KV heads hold the same positions and ``Hkv`` once a
per-head policy has evicted.
"""

from __future__ import annotations

import torch

from skipkey.core import kernels

EMPTY = -1
_NONE = torch.empty(0)  # "no scores" for the fused kernel


class LayerCache:
    """Keys, values, their positions and (for scoring policies) accumulated scores."""

    __slots__ = ("keys", "values", "positions", "scores", "window", "used", "held", "dense", "reuse",
                 "settled", "full_from", "free_slot", "scored", "lookback")

    def __init__(self, window: int | None):
        self.window = window
        self.scored = True  # a KV policy's budget binds here: score and evict (else append, like full mode)
        self.lookback = 0  # slots a sliding layer's move keeps beyond its window, so they can be rolled back
        self.clear()

    def clear(self):
        """Release everything (a layer SkipDecode no longer runs)."""
        self.keys = self.values = self.positions = self.scores = None
        self.used = 0  # slots [0, used) have been written; EMPTY ones among them are free
        self.held = 0  # the most tokens any row and head keeps for later queries
        # True when every slot a query reads holds a token it may see, so attention needs no mask
        # (the fast path that also matches ``generate`` bit for bit).
        self.dense = True
        self.reuse = False  # evicting: new tokens go into freed slots
        self.settled = False  # storage is the preallocated buffer (after the prompt pass)
        # Evicting layers: the fewest tokens any row and head holds; every slot is full at that count.
        self.full_from = 0
        self.free_slot = None  # [B, Hp, 1]: the slot each row and head freed last, if one each

    def __len__(self) -> int:
        return self.held

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _slot_bytes(self) -> int:
        b, hkv, _, d = self.keys.shape
        return 2 * b * hkv * d * self.keys.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the tokens this layer keeps (what a budget bounds)."""
        return 0 if self.keys is None else self.held * self._slot_bytes()

    # -- what attention reads ----------------------------------------------------
    def visible(self) -> slice:
        """Slots the current query reads: an appending sliding layer reads only its last ``window``."""
        if self.window is not None and not self.reuse and self.settled:
            return slice(max(0, self.used - self.window), self.used)
        return slice(0, self.used)

    def visible_positions(self) -> torch.Tensor:
        return self.positions[..., self.visible()]

    # -- writing -------------------------------------------------------------------
    def write(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, dense: bool,
              start_score: torch.Tensor | None = None):
        """Store new tokens (``positions`` [B, q], EMPTY for padding); return the keys and values to attend.

        ``start_score`` ([B] float32) is the score each row's new token starts with (default 0).
        """
        if self.keys is None:
            # The prompt pass: keep its tensors as they are; ``settle`` sizes the storage afterwards.
            self.keys, self.values, self.positions = keys, values, positions[:, None, :].clone()
            self.used = self.held = keys.shape[2]
            self.dense = dense
            return keys, values
        q = keys.shape[2]
        if self.reuse and q == 1:
            self._write_into_free_slot(keys, values, positions, start_score)
        else:
            self._append(keys, values, positions, dense, start_score)
        view = self.visible()
        return self.keys[:, :, view], self.values[:, :, view]

    def _write_into_free_slot(self, keys, values, positions, start_score):
        """Evicting layers: the next unused slot while there is one, else a slot eviction freed."""
        if self.used < self.capacity:
            self._store_next(keys, values, positions, start_score)
        else:
            slot = self.free_slot if self.free_slot is not None else \
                self.positions.argmin(dim=-1, keepdim=True)  # [B, Hp, 1]: EMPTY (capacity keeps one)
            self.free_slot = None
            fused = kernels.for_tensors(self.keys)
            if fused is not None:  # the writes below in one C++ call
                fused.write_slot(self.keys, self.values, self.positions,
                                 self.scores if self.scores is not None else _NONE, slot, keys, values,
                                 positions.reshape(-1), start_score if start_score is not None else _NONE)
            else:
                self._write_slot(slot, keys, values, positions, start_score)
        self.held += 1
        self.full_from += 1
        self.dense = self.full_from >= self.used

    def _write_slot(self, slot, keys, values, positions, start_score=None):
        """One slot per row and KV head. index_put_, not scatter_: CPU scatter_ copies a whole bfloat16
        tensor (250 us for a 2 MB layer), which is what this storage exists to avoid."""
        b, hkv, capacity, d = self.keys.shape
        heads = torch.arange(b * hkv, device=slot.device)
        where = (heads, slot.expand(b, hkv, 1).reshape(-1))
        self.keys.view(b * hkv, capacity, d).index_put_(where, keys.reshape(b * hkv, d))
        self.values.view(b * hkv, capacity, d).index_put_(where, values.reshape(b * hkv, d))
        self.positions.scatter_(-1, slot, positions[:, None, :].expand_as(slot))
        if self.scores is not None:
            where = slot.expand(b, self.scores.shape[1], 1)
            if start_score is None:
                self.scores.scatter_(-1, where, 0.0)
            else:
                self.scores.scatter_(-1, where, start_score[:, None, None].expand(where.shape).to(self.scores.dtype))

    def _append(self, keys, values, positions, dense, start_score=None):
        q = keys.shape[2]
        if self.used + q > self.capacity:
            self._make_room(q)
        self._store_next(keys, values, positions, start_score)
        self.held += q
        self.dense = self.dense and dense

    def _store_next(self, keys, values, positions, start_score=None):
        """Write ``q`` new tokens into the next unused slots (a slice assignment: no copy of the cache)."""
        end = self.used + keys.shape[2]
        self.keys[:, :, self.used:end] = keys
        self.values[:, :, self.used:end] = values
        self.positions[:, :, self.used:end] = positions[:, None, :]
        if self.scores is not None:
            self.scores[:, :, self.used:end] = 0.0 if start_score is None else start_score[:, None, None]
        self.used = end

    def _make_room(self, q: int):
        """Appending layer out of slots: a sliding layer moves its window to the front, others grow."""
        if self.window is not None and not self.reuse:
            keep = min(self.used, self.window - 1 + self.lookback)
            lo = self.used - keep
            if keep + q <= self.capacity and lo >= keep:  # source and destination do not overlap
                self.keys[:, :, :keep].copy_(self.keys[:, :, lo:self.used])
                self.values[:, :, :keep].copy_(self.values[:, :, lo:self.used])
                self.positions[..., :keep].copy_(self.positions[..., lo:self.used])
                if self.scores is not None:
                    self.scores[..., :keep].copy_(self.scores[..., lo:self.used])
                self.used = keep
                return
        self._resize(max(2 * self.capacity, self.used + q))

    def _resize(self, capacity: int, keep: slice | None = None):
        """Move slots ``keep`` (default: all written) into fresh storage of ``capacity`` slots."""
        keep = keep or slice(0, self.used)
        count = keep.stop - keep.start
        b, hkv, _, d = self.keys.shape
        keys = self.keys.new_zeros(b, hkv, capacity, d)
        values = self.values.new_zeros(b, hkv, capacity, d)
        keys[:, :, :count] = self.keys[:, :, keep]
        values[:, :, :count] = self.values[:, :, keep]
        positions = self.positions.new_full((b, self.positions.shape[1], capacity), EMPTY)
        positions[..., :count] = self.positions[..., keep]
        if self.scores is not None:
            scores = self.scores.new_zeros(b, self.scores.shape[1], capacity)
            scores[..., :count] = self.scores[..., keep]
            self.scores = scores
        self.keys, self.values, self.positions = keys, values, positions
        self.used = count

    def ensure_scores(self):
        if self.scores is None and self.positions is not None:
            self.scores = torch.zeros(self.positions.shape, device=self.positions.device, dtype=torch.float32)

    # -- after a step --------------------------------------------------------------------
    def trim_to_window(self, spare: int):
        """Appending layers: keep what the next query can see; settle into storage with ``spare`` free slots.

        A sliding layer keeps its last ``window - 1`` slots (rows advance in lock step and
        slots are in position order, so those are exactly the visible ones).
        """
        if self.window is not None:
            self.held = min(self.held, self.window - 1)
        if self.settled:
            return
        if self.window is not None:
            keep = min(self.used, self.window - 1)
            self._resize(keep + min(spare, self.window), slice(self.used - keep, self.used))
        else:
            self._resize(self.used + spare)
        self.settled = True

    def keep_only(self, keep: torch.Tensor, held: int, fewest: int, capacity: int):
        """Evicting layers: free every slot where ``keep`` ([B, H, used], bool) is false.

        ``held``/``fewest`` are the most/fewest tokens a row and head keeps. After the
        prompt the kept slots move into storage of ``capacity`` slots (one gather);
        on decode steps freed slots are only marked EMPTY, for the next token to reuse.
        """
        heads = keep.shape[1]
        if self.positions.shape[1] != heads:
            b = keep.shape[0]
            self.positions = self.positions.expand(b, heads, -1).contiguous()
            if self.scores is not None:
                self.scores = self.scores.expand(b, heads, -1).contiguous()
        live = self.positions[..., :self.used]
        live.masked_fill_(~keep, EMPTY)
        self.free_slot = None
        self.held, self.full_from = held, fewest
        if not self.settled:
            self._compact(keep, held, capacity)
            self.settled = self.reuse = True
        self.dense = fewest >= self.used

    def free(self, slot: torch.Tensor):
        """Free one slot per row and head (``slot`` [B, H, 1]); the next token is written there."""
        heads = slot.shape[1]
        if self.positions.shape[1] != heads:
            self.positions = self.positions.expand(slot.shape[0], heads, -1).contiguous()
        self.positions.scatter_(-1, slot, EMPTY)
        self.free_slot = slot
        self.held -= 1
        self.full_from -= 1
        self.dense = False

    def _compact(self, keep: torch.Tensor, held: int, capacity: int):
        """Gather the kept slots (per row and head) to the front of fresh storage, in position order."""
        slot = torch.arange(keep.shape[-1], device=keep.device)
        rank = slot + keep.long() * keep.shape[-1]  # kept slots first, each group in slot order
        idx = rank.topk(held, dim=-1).indices.sort(dim=-1).values  # [B, H, held]
        b, hkv, _, d = self.keys.shape
        heads = idx.shape[1]
        kv_idx = (idx if heads == hkv else idx.expand(b, hkv, held))[..., None].expand(b, hkv, held, d)
        keys = self.keys.new_zeros(b, hkv, capacity, d)
        values = self.values.new_zeros(b, hkv, capacity, d)
        keys[:, :, :held] = self.keys.gather(2, kv_idx)
        values[:, :, :held] = self.values.gather(2, kv_idx)
        positions = self.positions.new_full((b, heads, capacity), EMPTY)
        positions[..., :held] = self.positions.gather(-1, idx)
        if self.scores is not None:
            scores = self.scores.new_zeros(b, heads, capacity)
            scores[..., :held] = self.scores.gather(-1, idx)
            self.scores = scores
        self.keys, self.values, self.positions = keys, values, positions
        self.used = held

    def rollback(self, count: int):
        """Appending layers: take back the last ``count`` tokens written, by length (no copies).

        Their slots are marked EMPTY and written again by the next tokens. Exact as long
        as no move to the front (``_make_room``) has dropped a slot since those tokens
        were written: ``VerifyingLayerCache`` keeps enough slack for that.
        """
        if count <= 0 or self.keys is None:
            return
        if self.reuse or count > self.used:
            raise ValueError(f"cannot roll back {count} of {self.used} slots of an evicting layer" if self.reuse
                             else f"cannot roll back {count} tokens: the layer holds {self.used} slots")
        self.used -= count
        self.positions[..., self.used:self.used + count] = EMPTY
        self.held = max(0, self.held - count)

    def kept_positions(self) -> torch.Tensor | None:
        """Positions kept for later queries, ``[B, Hp, held]`` in position order (EMPTY first where a row
        or head keeps fewer): the same whatever slots they sit in."""
        if self.positions is None:
            return None
        # An appending sliding layer's stale slots are older than every kept one, so they sort out.
        kept = self.positions[..., :self.used]
        return kept.sort(dim=-1).values[..., kept.shape[-1] - self.held:]


class VerifyingLayerCache(LayerCache):
    """An appending layer whose newest tokens can be taken back: self-speculative decoding.

    A verify forward feeds ``q`` tokens at once. In a sliding layer the first of them
    needs the ``window - 1`` tokens before it, so ``q + window - 1`` slots are visible
    (the mask, built from positions, keeps each query inside its own window). A move
    to the front keeps ``window - 1 + lookback`` slots, so rolling back up to
    ``lookback`` tokens never reaches a slot the move dropped.
    """

    __slots__ = ("fed",)

    def __init__(self, window: int | None, lookback: int):
        super().__init__(window)
        self.lookback = lookback
        self.fed = 1  # tokens in the forward that wrote last

    def write(self, keys, values, positions, dense, start_score=None):
        self.fed = keys.shape[2]
        return super().write(keys, values, positions, dense, start_score)

    def visible(self) -> slice:
        if self.window is not None and self.settled:
            return slice(max(0, self.used - self.window + 1 - self.fed), self.used)
        return slice(0, self.used)


class KVCache:
    """Per-layer caches, written by SkipKey's attention function (``skipkey.core.attention``)."""

    def __init__(self, windows: list[int | None]):
        self.layers = [LayerCache(w) for w in windows]

    @classmethod
    def verifying(cls, windows: list[int | None], lookback: int) -> "KVCache":
        """Appending caches that can take back up to ``lookback`` tokens per layer (``VerifyingLayerCache``)."""
        cache = cls([])
        cache.layers = [VerifyingLayerCache(w, lookback) for w in windows]
        return cache

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def lengths(self) -> tuple[int, ...]:
        return tuple(len(layer) for layer in self.layers)
