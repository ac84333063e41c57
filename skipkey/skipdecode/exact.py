"""Exact SkipDecode: the skip schedule drafts, the full model verifies (self-speculative decoding).

LayerSkip (arXiv 2404.16710), Draft & Verify (arXiv 2309.08168) and SWIFT draft with
a cheaper pass of the same weights. Here the draft is the SkipDecode model: step
``t``'s layer set ``E(t)`` (a skipped layer is the identity), the tuned adapter's
weights where the engine uses them, and optionally a reduced-vocabulary head (the
rows of the ``N`` most frequent tokens, FR-Spec, arXiv 2502.14856). The full model
(every layer, the full head) then runs once over the last accepted token and the
``k`` drafted ones; each row keeps the longest drafted prefix its greedy tokens
agree with, plus the full model's own next token. Under greedy decoding the output
is the full model's.

The cache (*our choice*). The draft's keys and values at a layer come from hidden
states the skipped layers never touched, so they are not the full model's. The
draft writes them into the same in-place cache, the drafted positions are rolled
back by length, and the verify forward writes the full model's for all ``k + 1``
positions; the rejected suffix is then rolled back too. Every verified token thus
has every layer's keys and values, the draft attends to the full model's keys of
all verified tokens, SkipDecode's nesting is not needed and no layer is freed.

Batches (*our choice*). A cycle emits, for every row, as many tokens as the row
that accepted the fewest: its accepted prefix plus the full model's next token. A
row that agreed further gets the same tokens (its drafts equal the full model's up
to there), so the rows stay aligned by one shared length and the output is exact;
the work a longer-agreeing row did past the minimum is verified again next cycle.

Refused: KV eviction (an evicting layer's choice depends on each step's scores and
evicted tokens never come back, so a rejected draft would change what the full
model keeps), sampling (this module implements greedy acceptance only) and teacher
forcing (nothing to draft).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from skipkey.config import require_float, require_int
from skipkey.core.attention import StepState
from skipkey.core.cache import KVCache
from skipkey.errors import InputError
from skipkey.quality.prompts import training_prompts, training_text

DRAFT_K_CAP = 16  # drafted tokens per verify step; beyond it the acceptance a^k makes more drafting pointless
MAX_PAUSE = 16  # adaptive k: the most plain (undrafted) steps between probes after rejected drafts
# The draft head's rows where none is named: the fastest measured on the embedded model (docs/results/exact.md).
DEFAULT_DRAFT_VOCAB = 32768
DRAFT_VOCAB_FILE = Path(__file__).resolve().parents[2] / "assets" / "skipdecode-lora" / "draft_vocab.json"
# The corpus token frequencies are counted on: seeded windows of the offline training text
# (Python's help topics and standard-library source) plus the adapter's training prompts.
VOCAB_CORPUS = {"windows": 2048, "tokens_per_window": 256, "prompts": 2048, "seed": 7}


@dataclass(frozen=True)
class ExactDecoding:
    """Greedy decoding whose tokens are the full model's, drafted by the SkipDecode model.

    ``draft_k``: tokens drafted per verify step (1..``DRAFT_K_CAP``), the most when
    adaptive. ``adaptive``: 0 for a fixed ``k``; else a probability in (0, 1): a
    cycle stops drafting after a token whose draft probability falls below it, and
    the draft length grows after fully accepted cycles, shrinks to what was accepted
    and pauses drafting (probing again after a doubling wait) after a cycle that
    accepted nothing, so speed does not fall much below the full model's.
    ``draft_vocab``: 0 for the full LM head, else the draft head's rows, the ``N``
    most frequent tokens (``token_ranking``); None: ``DEFAULT_DRAFT_VOCAB`` rows where the
    model has more tokens than that, else the full head.
    """

    draft_k: int = 3  # the fastest measured on the embedded model (docs/results/exact.md)
    adaptive: float = 0.0
    draft_vocab: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "draft_k", require_int("draft k", self.draft_k, 1, DRAFT_K_CAP))
        adaptive = require_float("adaptive draft threshold", self.adaptive, 0.0, 1.0)
        if adaptive == 1.0:
            raise InputError("adaptive draft threshold must be in [0, 1) (0 = fixed k), got 1.0")
        object.__setattr__(self, "adaptive", adaptive)
        if self.draft_vocab is not None:
            object.__setattr__(self, "draft_vocab", require_int("draft vocab", self.draft_vocab, 0))

    @property
    def lookback(self) -> int:
        """The most tokens a layer ever takes back at once: a verify forward's ``k + 1`` less the one kept."""
        return self.draft_k + 1

    def describe(self) -> str:
        k = f"adaptive k <= {self.draft_k} (p >= {self.adaptive:g})" if self.adaptive else f"k = {self.draft_k}"
        head = (f", {self.draft_vocab}-token draft head" if self.draft_vocab else "" if self.draft_vocab == 0 else
                f", {DEFAULT_DRAFT_VOCAB}-token draft head where the vocabulary is larger")
        return f"exact (verified), {k}{head}"

    # -- the edge ----------------------------------------------------------------
    def validate(self, engine) -> None:
        """Refuse what cannot be exact for ``engine``'s model and methods (once, when the engine is built)."""
        vocab = engine.full_arch.model.lm_head.weight.shape[0]
        if self.draft_vocab is not None and self.draft_vocab > vocab:
            raise InputError(f"draft vocab must be in 0..{vocab} (0 = the full head; the model has {vocab} tokens), "
                             f"got {self.draft_vocab}")
        if engine.kv is not None and engine.kv.evicts:
            raise InputError(f"exact decoding cannot be combined with KV eviction ({engine.kv.describe()}): an "
                             "evicted token never comes back, so a rejected draft would change what the full model "
                             "keeps; use kv policy 'full' or turn exact off")
        devices = {*engine.layer_devices, engine.head_device, engine.device}
        if len(devices) > 1:
            raise InputError("exact decoding runs on one device; this model is placed across "
                             f"{', '.join(sorted(map(str, devices)))}")

    @staticmethod
    def check(settings, forced) -> None:
        """Refuse a request exact decoding does not serve (once, when ``generate`` starts)."""
        if settings.do_sample:
            raise InputError("exact decoding is greedy only: turn sampling off (do_sample=False) or turn exact off")
        if forced is not None:
            raise InputError("exact decoding drafts the model's own tokens; teacher forcing has none to draft")

    def new_cache(self, windows: list[int | None]) -> KVCache:
        return KVCache.verifying(windows, self.lookback)

    # -- the loop ----------------------------------------------------------------
    def decode(self, engine, cache: KVCache, events, plan, token: torch.Tensor, next_pos: torch.Tensor,
               total_steps: int, stop) -> Iterator:
        """Tokens 1.. of ``Engine.generate`` after its prompt pass: one event per token, a verify step at a time.

        A verify step's first event carries ``drafted``, each row's ``accepted``, the
        ``draft_layers`` of each drafted token and ``draft_seconds``; the step's time is
        shared evenly by its tokens.
        """
        num_layers = engine.full_arch.num_layers
        all_layers = tuple(range(num_layers))
        head = _HEADS.get(engine)
        if head is None:  # once per engine: the ranking and the head's rows are not part of any step's cost
            head = _HEADS[engine] = DraftHead(self._draft_ids(engine), engine.head_device)
        length = DraftLength(self.draft_k, self.adaptive > 0)
        step = 1
        while step < total_steps:
            if events.all_finished or (stop is not None and stop.is_set()):
                break
            started = time.perf_counter()
            live = torch.tensor([not done for done in events.finished], device=token.device)
            feed = events.feed(token)
            k = min(length.next(), total_steps - step - 1)
            drafted, draft_layers = self.draft(engine, cache, feed, next_pos, plan, step, k, live)
            draft_seconds = time.perf_counter() - started
            greedy = self.verify(engine, cache, torch.cat([feed[:, None], drafted], dim=1), next_pos)
            own = accepted_prefix(drafted, greedy[:, :-1])
            shared = int(own[live].min()) if bool(live.any()) else 0
            cache_rollback(cache, drafted.shape[1] - shared)
            length.update(drafted.shape[1], shared)
            count = shared + 1
            seconds = (time.perf_counter() - started) / count
            for i in range(count):
                event = events.build(step + i, greedy[:, i], all_layers, started)
                extra = dict(drafted=drafted.shape[1], accepted=tuple(own.tolist()), draft_layers=draft_layers,
                             draft_seconds=draft_seconds) if i == 0 else {}
                yield dataclasses.replace(event, seconds=seconds, **extra)
                if events.all_finished:
                    return
            token = greedy[:, shared]
            next_pos = next_pos + count
            step += count

    def draft(self, engine, cache: KVCache, token, positions, plan, step: int, k: int,
              live: torch.Tensor) -> tuple[torch.Tensor, tuple[tuple[int, ...], ...]]:
        """Up to ``k`` greedy tokens from the SkipDecode model, its cache entries taken back afterwards.

        Token ``step + j`` is fed through ``E(step + j - 1)``, as plain SkipDecode would.
        """
        head = _HEADS[engine]  # made by ``decode`` before its first draft
        num_layers = engine.full_arch.num_layers
        written = [0] * num_layers
        drafted, layer_sets = [], []
        for j in range(k):
            layers = plan.layer_set(step + j - 1) if plan is not None else tuple(range(num_layers))
            arch = engine.arch if num_layers - len(layers) >= engine.min_skipped else engine.full_arch
            pos = (positions + j)[:, None]
            hidden = arch.embed(token[:, None], pos)
            layer_kwargs = arch.position_inputs(hidden, pos)
            state = StepState(cache=cache, query_positions=pos, dense=True)
            for idx in layers:
                hidden = arch.run_layer(idx, hidden, layer_kwargs[idx], state=state)
                written[idx] += 1
            token, confidence = head(arch, hidden[:, -1], want_confidence=self.adaptive > 0)
            drafted.append(token)
            layer_sets.append(layers)
            if self.adaptive and bool((confidence < self.adaptive)[live].any()):
                break
        for layer, count in zip(cache.layers, written):
            layer.rollback(count)
        empty = torch.empty(token.shape[0], 0, dtype=torch.long, device=token.device)
        return (torch.stack(drafted, dim=1) if drafted else empty), tuple(layer_sets)

    @staticmethod
    def verify(engine, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The full model over ``tokens`` ([B, q], the first at ``positions``) in one forward: its greedy
        token after each, ``[B, q]``. Writes every layer's keys and values of all ``q``."""
        arch = engine.full_arch
        pos = positions[:, None] + torch.arange(tokens.shape[1], device=positions.device)
        hidden = arch.embed(tokens, pos)
        layer_kwargs = arch.position_inputs(hidden, pos)
        state = StepState(cache=cache, query_positions=pos, dense=True)
        for idx in range(arch.num_layers):
            hidden = arch.run_layer(idx, hidden, layer_kwargs[idx], state=state)
        return arch.head(hidden).argmax(dim=-1)

    def draft_rows(self, vocab: int) -> int:
        """The draft head's rows for a model of ``vocab`` tokens (0: the full head)."""
        if self.draft_vocab is None:
            return DEFAULT_DRAFT_VOCAB if vocab > DEFAULT_DRAFT_VOCAB else 0
        return self.draft_vocab

    def _draft_ids(self, engine) -> torch.Tensor | None:
        vocab = engine.full_arch.model.lm_head.weight.shape[0]
        rows = self.draft_rows(vocab)
        if rows == 0:
            return None
        ranking = token_ranking(engine.tokenizer, vocab)
        eos = [t for t in sorted(engine.eos_ids) if 0 <= t < vocab]
        ids = list(dict.fromkeys(eos + ranking))[:rows]  # the draft can always end a text
        return torch.tensor(sorted(ids), dtype=torch.long)


_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # each engine's draft head, built on first use


def accepted_prefix(drafted: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading drafted tokens equal the full model's greedy tokens there (``[B]``)."""
    if drafted.shape[1] == 0:
        return torch.zeros(drafted.shape[0], dtype=torch.long, device=drafted.device)
    return (drafted == greedy).long().cumprod(dim=1).sum(dim=1)


def cache_rollback(cache: KVCache, count: int) -> None:
    """Take back every layer's last ``count`` tokens (the verify forward wrote them all)."""
    for layer in cache.layers:
        layer.rollback(count)
        layer.trim_to_window(0)  # settled: a sliding layer holds its window again


class DraftHead:
    """The draft's LM head: the model's own, or only the rows of ``ids`` (FR-Spec's reduced vocabulary).

    The reduced head omits Gemma's final-logit soft cap: a monotone map, so the draft
    token is the same; only the adaptive threshold sees uncapped probabilities.
    """

    def __init__(self, ids: torch.Tensor | None, device):
        self.ids = None if ids is None else ids.to(device)
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # per architecture (tuned or full)

    def __call__(self, arch, hidden: torch.Tensor, want_confidence: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's draft token and (when wanted) its draft probability, for ``hidden`` ``[B, D]``."""
        if self.ids is None:
            logits = arch.head(hidden[:, None])[:, -1]
        else:
            weight, bias = self._rows(arch)
            logits = torch.nn.functional.linear(arch.norm(hidden), weight, bias).float()
        best = logits.argmax(dim=-1)
        token = best if self.ids is None else self.ids[best]
        if not want_confidence:
            return token, None
        top = logits.gather(1, best[:, None])[:, 0]
        return token, torch.exp(top - torch.logsumexp(logits, dim=-1))

    def _rows(self, arch):
        found = self.rows.get(id(arch))
        if found is None:
            head = arch.model.lm_head
            found = self.rows[id(arch)] = (head.weight[self.ids].contiguous(),
                                           None if head.bias is None else head.bias[self.ids].contiguous())
        return found


class DraftLength:
    """Tokens the next cycle drafts: always ``cap`` when fixed; else adapted to what was accepted."""

    def __init__(self, cap: int, adaptive: bool):
        self.cap, self.adaptive = cap, adaptive
        self.now = cap
        self.wait = 0  # plain steps left before drafting again
        self.pause = 1  # the next wait after a rejected probe (doubles up to MAX_PAUSE)

    def next(self) -> int:
        if not self.adaptive:
            return self.cap
        if self.wait > 0:
            self.wait -= 1
            return 0
        return self.now

    def update(self, drafted: int, accepted: int) -> None:
        if not self.adaptive or drafted == 0:
            return
        if accepted == drafted:
            self.now, self.pause = min(self.cap, self.now + 1), 1
        elif accepted == 0:
            self.now, self.wait, self.pause = 1, self.pause, min(2 * self.pause, MAX_PAUSE)
        else:
            self.now = min(self.cap, accepted + 1)


# -- the draft vocabulary ------------------------------------------------------------------------------
def tokenizer_digest(tokenizer, ids: Sequence[int]) -> str:
    """Identifies a ranking's tokens: the SHA-256 of their strings, so a file never serves another tokenizer."""
    return hashlib.sha256("\n".join(map(str, tokenizer.convert_ids_to_tokens(list(ids)))).encode()).hexdigest()


def count_ranking(tokenizer, vocab_size: int, corpus: dict = VOCAB_CORPUS) -> list[int]:
    """Every token id, most frequent first on the offline corpus (ties and unseen tokens by id)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    half = corpus["tokens_per_window"] // 2
    for ids in training_text(tokenizer, corpus["windows"], half, half, seed=corpus["seed"]):
        np.add.at(counts, np.asarray([t for t in ids if t < vocab_size], dtype=np.int64), 1)
    for prompt in training_prompts(corpus["prompts"], seed=corpus["seed"]):
        ids = [t for t in tokenizer(prompt, add_special_tokens=False)["input_ids"] if t < vocab_size]
        np.add.at(counts, np.asarray(ids, dtype=np.int64), 1)
    return np.argsort(-counts, kind="stable").tolist()


def write_ranking(path: Path, tokenizer, vocab_size: int, keep: int) -> dict:
    """Count the ranking and store its first ``keep`` ids with what identifies them (the shipped file)."""
    ids = count_ranking(tokenizer, vocab_size)[:keep]
    record = {"format": "skipkey-draft-vocab/1", "vocab_size": vocab_size, "corpus": VOCAB_CORPUS,
              "tokens_sha256": tokenizer_digest(tokenizer, ids), "ids": ids}
    Path(path).write_text(json.dumps(record, separators=(",", ":")) + "\n")
    return record


def shipped_ranking(tokenizer, vocab_size: int, path: Path = DRAFT_VOCAB_FILE) -> list[int] | None:
    """The stored ranking's ids when it is for this tokenizer and vocabulary (else None)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    ids = record.get("ids", [])
    if record.get("vocab_size") != vocab_size or record.get("tokens_sha256") != tokenizer_digest(tokenizer, ids):
        return None
    return ids


_RANKINGS: dict[tuple[int, str], list[int]] = {}


def token_ranking(tokenizer, vocab_size: int) -> list[int]:
    """Every token id, most frequent first: the shipped file's order, then the rest by id.

    Without a file for this tokenizer (tiny test models, other models) the frequencies
    are counted once per tokenizer and process (seconds).
    """
    key = (vocab_size, tokenizer_digest(tokenizer, range(min(vocab_size, len(tokenizer), 1024))))
    if key not in _RANKINGS:
        shipped = shipped_ranking(tokenizer, vocab_size)
        if shipped is not None:
            rest = sorted(set(range(vocab_size)) - set(shipped))
            _RANKINGS[key] = shipped + rest
        else:
            _RANKINGS[key] = count_ranking(tokenizer, vocab_size)
    return _RANKINGS[key]


__all__ = ["DRAFT_K_CAP", "DRAFT_VOCAB_FILE", "DraftHead", "DraftLength", "ExactDecoding", "accepted_prefix",
           "count_ranking", "shipped_ranking", "token_ranking", "write_ranking"]
