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

What a cycle drafts is decided by a pace (``skipkey.skipdecode.drafting``): the
measured pace drafts only what the measured costs and acceptance say will pay, takes
a prompt-lookup proposal (the continuation of an earlier occurrence of the last few
tokens: free to draft) where that is worth more, and falls back to a plain full step
where nothing pays, so a prompt the draft does not suit costs about what the full
model does.

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
import time
import weakref
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from skipkey.config import require_int
from skipkey.core.attention import StepState
from skipkey.core.cache import KVCache
from skipkey.core.gemm import linear_weight_rows
from skipkey.errors import InputError
from skipkey.skipdecode.draft_vocab import DEFAULT_DRAFT_VOCAB, token_ranking
from skipkey.skipdecode.drafting import PACES, Cycle, Experience, PromptLookup

DRAFT_K_CAP = 16  # drafted tokens per verify step; beyond it the acceptance a^k makes more drafting pointless
# A verify forward computes several positions in one matmul and can round a near-tie between the full model's two
# best logits the other way from one position at a time (bfloat16: a logit of ~20 is rounded to 1/8). A divergence
# from the full model where the verify's two best logits were within this is a numerical tie, not a difference.
TIE_TOLERANCE = 0.25


@dataclass(frozen=True)
class ExactDecoding:
    """Greedy decoding whose tokens are the full model's, drafted by the SkipDecode model.

    ``draft_k``: the most tokens the SkipDecode model drafts per verify step
    (1..``DRAFT_K_CAP``). ``pace``: "measured" drafts only what pays (fewer tokens, a
    prompt-lookup proposal or none at all, from the costs and acceptance measured as
    the run goes); "fixed" drafts ``draft_k`` every cycle. ``lookup``: also propose the
    continuation of an earlier occurrence of the text's last tokens (prompt lookup).
    ``draft_vocab``: 0 for the full LM head, else the draft head's rows, the ``N`` most
    frequent tokens (``token_ranking``); None: ``DEFAULT_DRAFT_VOCAB`` rows where the
    model has more tokens than that, else the full head.
    """

    draft_k: int = 3  # chosen on Spec-Bench's validation half (docs/results/exact.md, exact_val_length.json)
    pace: str = "measured"
    lookup: bool = True
    draft_vocab: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "draft_k", require_int("draft k", self.draft_k, 1, DRAFT_K_CAP))
        if self.pace not in PACES:
            raise InputError(f"draft pace must be one of {', '.join(PACES)}, got {self.pace!r}")
        if not isinstance(self.lookup, bool):
            raise InputError(f"lookup must be true or false, got {self.lookup!r}")
        if self.draft_vocab is not None:
            object.__setattr__(self, "draft_vocab", require_int("draft vocab", self.draft_vocab, 0))

    @property
    def lookback(self) -> int:
        """The most tokens a layer ever takes back at once: a verify forward's tokens less the one kept."""
        return max(self.draft_k, LOOKUP_CAP if self.lookup else 0) + 1

    def describe(self) -> str:
        k = f"up to {self.draft_k} drafted, measured pace" if self.pace == "measured" else f"k = {self.draft_k}"
        head = (f", {self.draft_vocab}-token draft head" if self.draft_vocab else "" if self.draft_vocab == 0 else
                f", {DEFAULT_DRAFT_VOCAB}-token draft head where the vocabulary is larger")
        return f"exact (verified), {k}{head}{', prompt lookup' if self.lookup else ''}"

    def label(self) -> str:
        """A table column's name: ``exact k<=4 +lookup``, ``exact k=3, full head``."""
        head = "" if self.draft_vocab is None else ", full head" if self.draft_vocab == 0 else \
            f", {self.draft_vocab // 1024}k head"
        return f"exact k{'<=' if self.pace == 'measured' else '='}{self.draft_k}{' +lookup' if self.lookup else ''}{head}"

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
    def decode(self, engine, cache: KVCache, events, plan, token: torch.Tensor, batch, stop) -> Iterator:
        """Tokens 1.. of ``Engine.generate`` after its prompt pass (``batch``: its prompts), one event per token,
        a verify step at a time.

        A verify step's first event carries ``drafted``, each row's ``accepted``, the
        ``draft_layers`` of each token the SkipDecode model drafted, ``draft_source``
        ("layers", "lookup", or None for a plain step) and ``draft_seconds``; the step's
        time is shared evenly by its tokens.
        """
        total_steps = events.settings.max_new_tokens
        num_layers = engine.full_arch.num_layers
        all_layers = tuple(range(num_layers))
        experience = self._model_state(engine)
        costs = experience.costs
        pace = PACES[self.pace](self.draft_k, PromptLookup() if self.lookup else None, experience, num_layers)
        texts = _Texts(batch, total_steps) if self.lookup else None
        run = _Run(engine, cache, plan, pace)
        next_pos = torch.tensor(batch.lengths, device=token.device)
        step = 1
        while step < total_steps:
            if events.all_finished or (stop is not None and stop.is_set()):
                break
            started = time.perf_counter()
            live = [not done for done in events.finished]
            feed = events.feed(token)
            if texts is not None:
                texts.extend(feed, live)
            depth = len(plan.layer_set(step - 1)) if plan is not None else num_layers
            cap = total_steps - step - 1
            cycle = pace.choose(cap, texts.propose(live, LOOKUP_CAP) if texts is not None else None, depth)
            drafted, draft_layers, probabilities = self._drafts(run, feed, next_pos, step, cycle, live)
            drafting = time.perf_counter()
            greedy, margins = self.verify(engine, cache, torch.cat([feed[:, None], drafted], dim=1), next_pos,
                                          events.record)
            own = accepted_prefix(drafted, greedy[:, :-1])
            shared = int(own[torch.tensor(live, device=own.device)].min()) if any(live) else 0
            cache_rollback(cache, drafted.shape[1] - shared)
            costs.observe_verify(drafted.shape[1] + 1, time.perf_counter() - drafting)
            if draft_layers:
                costs.observe_draft(round(np.mean([len(x) for x in draft_layers])),
                                    (drafting - started) / len(draft_layers))
            pace.observe(cycle, probabilities, shared)
            count = shared + 1
            seconds = (time.perf_counter() - started) / count
            for i in range(count):
                event = events.build(step + i, greedy[:, i], all_layers, started)
                extra = dict(drafted=drafted.shape[1], accepted=tuple(own.tolist()), draft_layers=draft_layers,
                             draft_seconds=drafting - started,
                             draft_source=None if cycle.source == "plain" else cycle.source) if i == 0 else {}
                margin = None if margins is None else tuple(margins[:, i].tolist())
                yield dataclasses.replace(event, seconds=seconds, margin=margin, **extra)
                if events.all_finished:
                    return
            token = greedy[:, shared]
            next_pos = next_pos + count
            step += count

    def _drafts(self, run: "_Run", feed, next_pos, step: int, cycle: Cycle, live: list[bool]):
        """The cycle's drafted tokens ``[B, k]``, the layer set of each SkipDecode-drafted one, and their draft
        probabilities (the lowest of the live rows')."""
        if cycle.source == "lookup":
            return torch.tensor(cycle.tokens, dtype=torch.long, device=feed.device), (), []
        if cycle.source == "layers":
            return self.draft(run, feed, next_pos, step, cycle, live)
        return torch.empty(feed.shape[0], 0, dtype=torch.long, device=feed.device), (), []

    @staticmethod
    def draft(run: "_Run", token, positions, step: int, cycle: Cycle, live: list[bool]
              ) -> tuple[torch.Tensor, tuple[tuple[int, ...], ...], list[float]]:
        """Up to ``cycle.count`` greedy tokens from the SkipDecode model, its cache entries taken back afterwards;
        the pace may stop it earlier. Token ``step + j`` is fed through ``E(step + j - 1)``, as plain SkipDecode
        would. Where the cycle carries a lookup proposal (``cycle.tokens``) and the draft so far is its start, the
        rest of the proposal is taken as the draft's continuation, at no cost (the two agree: copying goes on)."""
        engine, cache, plan, k = run.engine, run.cache, run.plan, cycle.count
        head = _ENGINE_HEADS[engine]  # chosen by ``decode`` before its first draft
        num_layers = engine.full_arch.num_layers
        written = [0] * num_layers
        drafted, layer_sets, probabilities = [], [], []
        rows = torch.tensor(live, device=token.device)
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
            token, confidence = head(arch, hidden[:, -1])
            drafted.append(token)
            layer_sets.append(layers)
            probabilities.append(float(confidence[rows].min()) if bool(rows.any()) else 1.0)
            rest = _confirmed_rest(cycle.tokens, drafted, rows)
            if rest is not None:
                drafted += list(rest.T)
                break
            if j + 1 < k and not run.pace.keep_drafting(j + 1, probabilities[-1]):
                break
        for layer, count in zip(cache.layers, written):
            layer.rollback(count)
        return torch.stack(drafted, dim=1), tuple(layer_sets), probabilities

    @staticmethod
    def verify(engine, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, margins: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The full model over ``tokens`` ([B, q], the first at ``positions``) in one forward: its greedy
        token after each, ``[B, q]``, and (with ``margins``) the gap between its two best logits there. Writes
        every layer's keys and values of all ``q``."""
        arch = engine.full_arch
        pos = positions[:, None] + torch.arange(tokens.shape[1], device=positions.device)
        hidden = arch.embed(tokens, pos)
        layer_kwargs = arch.position_inputs(hidden, pos)
        state = StepState(cache=cache, query_positions=pos, dense=True)
        for idx in range(arch.num_layers):
            hidden = arch.run_layer(idx, hidden, layer_kwargs[idx], state=state)
        logits = arch.head(hidden)
        if not margins:
            return logits.argmax(dim=-1), None
        top = logits.topk(2, dim=-1).values  # the token stays argmax's (on an exact tie, the first, as generate's)
        return logits.argmax(dim=-1), (top[..., 0] - top[..., 1]).cpu()

    def draft_rows(self, vocab: int) -> int:
        """The draft head's rows for a model of ``vocab`` tokens (0: the full head)."""
        if self.draft_vocab is None:
            return DEFAULT_DRAFT_VOCAB if vocab > DEFAULT_DRAFT_VOCAB else 0
        return self.draft_vocab

    def _model_state(self, engine) -> Experience:
        """The engine's draft head and what the pace has measured, kept once per model, not per engine (the page
        builds an engine per request): the head's ranking and rows are no step's cost, and what the pace measured
        carries over to the model's next request."""
        heads = _HEADS.setdefault(engine.model, {})
        rows = self.draft_rows(engine.full_arch.model.lm_head.weight.shape[0])
        if rows not in heads:
            heads[rows] = DraftHead(self._draft_ids(engine), engine.head_device)
        _ENGINE_HEADS[engine] = heads[rows]
        return _EXPERIENCE.setdefault(engine.model, Experience())

    def _draft_ids(self, engine) -> torch.Tensor | None:
        vocab = engine.full_arch.model.lm_head.weight.shape[0]
        rows = self.draft_rows(vocab)
        if rows == 0:
            return None
        ranking = token_ranking(engine.tokenizer, vocab)
        eos = [t for t in sorted(engine.eos_ids) if 0 <= t < vocab]
        ids = list(dict.fromkeys(eos + ranking))[:rows]  # the draft can always end a text
        return torch.tensor(sorted(ids), dtype=torch.long)


LOOKUP_CAP = 8  # the most tokens a prompt-lookup proposal puts into one verify forward


@dataclass(frozen=True)
class _Run:
    """What every cycle of one exact run shares: the engine, its cache, the SkipDecode plan and the pace."""

    engine: object
    cache: KVCache
    plan: object
    pace: object
_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # per model: its draft heads by row count
_ENGINE_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # the draft head each engine drafts with
_EXPERIENCE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # per model: measured costs and acceptance


def engine_experience(engine) -> Experience:
    """What the exact runs on ``engine``'s model have measured so far (costs, calibration, acceptance), kept per
    model: for instruments (experiments/exact_costs.py); empty before the model's first exact run."""
    return _EXPERIENCE.get(engine.model) or Experience()


def wrap_draft_head(engine, wrapper):
    """Replace ``engine``'s draft head (built by its first exact run) by ``wrapper(head)``; returns the new head.

    For instruments that time or record the draft's head (experiments/tree_gain.py), never for serving.
    """
    if _ENGINE_HEADS.get(engine) is None:
        raise ValueError("the engine has no draft head yet: run one exact generation first")
    old = _ENGINE_HEADS[engine]
    heads = _HEADS[engine.model]
    new = heads[next(rows for rows, head in heads.items() if head is old)] = _ENGINE_HEADS[engine] = wrapper(old)
    return new


def _confirmed_rest(proposal: tuple[tuple[int, ...], ...], drafted: list[torch.Tensor], live: torch.Tensor
                    ) -> torch.Tensor | None:
    """The rest of a lookup ``proposal`` (``[B, n]``) where every live row's draft so far is its start, else None."""
    if not proposal or len(proposal[0]) <= len(drafted):
        return None
    guess = torch.tensor(proposal, dtype=torch.long, device=drafted[0].device)
    so_far = torch.stack(drafted, dim=1)
    if not bool((so_far == guess[:, :len(drafted)]).all(dim=1)[live].all()):
        return None
    return guess[:, len(drafted):]


class _Texts:
    """Each row's tokens so far (prompt and output), where prompt lookup searches."""

    def __init__(self, batch, new_tokens: int):
        width = batch.input_ids.shape[1]
        ids = batch.input_ids.cpu().numpy()
        self.tokens = [np.concatenate([ids[r, width - n:], np.zeros(new_tokens, dtype=ids.dtype)])
                       for r, n in enumerate(batch.lengths)]
        self.length = list(batch.lengths)
        self.lookup = PromptLookup()

    def extend(self, fed: torch.Tensor, live: list[bool]) -> None:
        """Append the token each live row is fed next (the last one emitted)."""
        for r, token in enumerate(fed.tolist()):
            if live[r] and self.length[r] < len(self.tokens[r]):
                self.tokens[r][self.length[r]] = token
                self.length[r] += 1

    def propose(self, live: list[bool], count: int) -> list[tuple[tuple[int, ...], int]]:
        """Every row's lookup proposal; a finished row takes the first live row's (it is fed padding anyway)."""
        own = [self.lookup.propose(t[:n], count) if alive else None
               for t, n, alive in zip(self.tokens, self.length, live)]
        first = next((p for p in own if p is not None), ((), 0))
        return [first if p is None else p for p in own]


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
    """The draft's LM head: the model's own, or only the rows of ``ids`` (FR-Spec's reduced vocabulary)."""

    def __init__(self, ids: torch.Tensor | None, device):
        self.ids = None if ids is None else ids.to(device)
        # per LM head module (the tuned model's or the full one's), so an engine per request adds nothing
        self.rows: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __call__(self, arch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's draft token and its draft probability (over the head's rows), for ``hidden`` ``[B, D]``."""
        if self.ids is None:
            logits = arch.head(hidden[:, None])[:, -1]
        else:
            weight, bias = self._rows(arch)
            logits = arch.cap_logits(linear_weight_rows(weight, bias, arch.norm(hidden)).float())
        best = logits.argmax(dim=-1)
        top = logits.gather(1, best[:, None])[:, 0]
        return best if self.ids is None else self.ids[best], torch.exp(top - torch.logsumexp(logits, dim=-1))

    def _rows(self, arch):
        head = arch.model.lm_head
        found = self.rows.get(head)
        if found is None:
            found = self.rows[head] = (head.weight[self.ids].contiguous(),
                                       None if head.bias is None else head.bias[self.ids].contiguous())
        return found


__all__ = ["DRAFT_K_CAP", "LOOKUP_CAP", "TIE_TOLERANCE", "DraftHead", "ExactDecoding", "accepted_prefix", "cache_rollback"]
