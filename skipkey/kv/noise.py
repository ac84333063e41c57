"""Gumbel noise for Keyformer's scores: counter-based, cheap, and the same for a row alone or batched.

A seeded table of Gumbel(0, 1) draws, indexed by a hash of (seed, layer, query
head, query position) and by each key's position. Noise depends only on
positions, so a row draws the same noise whatever its batch, padding or slot order.
"""

from __future__ import annotations

import functools

import torch

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


NOISE_ROWS, NOISE_COLS = 512, 8192  # the seeded Gumbel table: 16 MB of float32


@functools.lru_cache(maxsize=4)
def noise_table(seed: int, device: str) -> torch.Tensor:
    """``[NOISE_ROWS, 2 * NOISE_COLS]`` Gumbel(0, 1) draws, each row written twice so any run of up to
    ``NOISE_COLS`` columns starting in the first half is one contiguous slice."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 1 << 24, (NOISE_ROWS, NOISE_COLS), generator=generator, dtype=torch.int64)
    table = _gumbel_from_bits(bits)
    return torch.cat([table, table], dim=1).to(device)


def gumbel_noise(seed: int, where, shape) -> torch.Tensor:
    """Gumbel(0, 1) noise for each (layer, KV head, query head, query position, key position).

    Counter-based and cheap: a hash of (seed, layer, head, query position), computed
    once per query, picks a row of a seeded table of Gumbel draws and a rotation of
    it; the key's position indexes into that. The hash runs over queries only, and
    each (query, key) pair costs one add and one gather, so scoring a long prompt
    no longer spends its time drawing noise. Noise depends only on positions: a row
    gets the same noise alone or in a batch, whatever its padding and wherever
    eviction moved its slots. Keys ``NOISE_COLS`` positions apart share a query's draw.
    """
    b, hkv, groups, q, s = shape
    qpos = where.query_positions
    device = qpos.device
    start = query_starts(seed, where.layer, hkv, groups, device, qpos, where.position_limit)  # [B, Hkv, G, q]
    table = noise_table(seed, str(device))
    if where.key_start is not None and s <= NOISE_COLS:
        # Consecutive key positions: each query reads one contiguous run of its doubled row, copied whole
        # (``index_select`` of the flat table's overlapping runs: a row copy each, not a gather per key).
        shift = start % (2 * NOISE_COLS)
        first = start - shift + ((where.key_start[:, None, None, None] + shift) & (NOISE_COLS - 1))
        runs = table.view(-1).unfold(0, s, 1)
        return runs.index_select(0, first.reshape(-1)).view(b, hkv, groups, q, s)
    # Any key positions (a decode step's shuffled slots): the doubled row makes column
    # ``(kpos mod NOISE_COLS) + shift`` the same draw as ``(kpos + shift) mod NOISE_COLS``, so each
    # key costs one mask, one add and one gather.
    kpos = where.key_positions.expand(b, hkv, s)[:, :, None, None, :] & (NOISE_COLS - 1)
    return table.view(-1).index_select(0, (start[..., None] + kpos).reshape(-1)).view(b, hkv, groups, q, s)


QUERY_TABLE_MAX = 1 << 14  # positions whose (row, rotation) are tabulated per layer; later ones are hashed


def query_starts(seed: int, layer: int, hkv: int, groups: int, device, qpos: torch.Tensor,
                  limit: int | None) -> torch.Tensor:
    """Where each query's draws start in the flattened table, ``[B, Hkv, G, q]``: its row times the
    doubled row length plus its rotation, from a hash of (seed, layer, head, position).

    Decode steps look them up in a per-layer table of every position (one gather
    instead of a dozen integer ops per layer and step).
    """
    if limit is not None and limit <= QUERY_TABLE_MAX:
        count = max(1024, 1 << (limit - 1).bit_length())
        return _query_table(seed, layer, hkv, groups, device, count)[:, :, qpos].permute(2, 0, 1, 3)
    return _query_hash(seed, layer, hkv, groups, device, qpos[:, None, None, :])


def _query_hash(seed, layer, hkv, groups, device, qpos):
    query_hash = _mix(_noise_base(seed, layer, hkv, groups, device) + qpos * 0x85EBCA77)
    return (query_hash & (NOISE_ROWS - 1)) * (2 * NOISE_COLS) + (_shr(query_hash, 40) & (NOISE_COLS - 1))


@functools.lru_cache(maxsize=512)
def _query_table(seed, layer, hkv, groups, device, count):
    return _query_hash(seed, layer, hkv, groups, device, torch.arange(count, device=device)[None])[0]  # [Hkv, G, n]


@functools.lru_cache(maxsize=256)
def _noise_base(seed: int, layer: int, hkv: int, groups: int, device) -> torch.Tensor:
    """The per-(seed, layer, query head) part of the noise hash, ``[1, Hkv, G, 1]``: computed once."""
    head = torch.arange(hkv * groups, device=device).view(1, hkv, groups, 1)
    return _mix(_mix(torch.tensor(seed, device=device) * 0x9E3779B1 + layer) + head * 0x632BE5AB)


def clear_tables() -> None:
    """Forget every cached table, so the next draw rebuilds them from ``NOISE_ROWS`` and ``NOISE_COLS`` (for an
    experiment that changes the table's size; the shipped size is what every Keyformer figure was measured with)."""
    noise_table.cache_clear()
    _query_table.cache_clear()


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
