"""The decode loop: ``prefill``, ``decode_one_token``, ``generate``.

The engine calls the model's decoder layers itself, with a KV cache it owns
(``skipkey.cache``), explicit positions and per-layer masks. Two optional,
independent methods plug in:

* a SkipDecode plan decides which layers step ``t`` runs (``E(t)``, nested);
* a KV policy decides which cached tokens each running layer keeps.

``generate`` yields one ``StepEvent`` per produced token; ``skipkey.trace``
collects them, and figures and metrics are pure functions of the trace.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from skipkey.architectures import get_architecture
from skipkey.attention import StepState
from skipkey.cache import EMPTY, KVCache
from skipkey.config import GenerationSettings, validate_prompt_ids
from skipkey.errors import InputError
from skipkey.schedules import layer_importance


@dataclass(frozen=True)
class StepEvent:
    """One produced token per row, and what it cost.

    ``layers`` are the decoder layers run to produce this token: all of them for
    token 0 (the prompt pass), ``E(t)`` for token ``t + 1``. ``kept`` (when
    recording) holds, per layer, the original positions its cache keeps after this
    step, as int32 ``[B, Hp, S]`` (-1 = empty slot), or None for a freed layer.
    """

    step: int
    tokens: tuple[int, ...]
    texts: tuple[str, ...]
    finished: tuple[bool, ...]
    layers: tuple[int, ...]
    seconds: float
    kv_bytes: int
    cache_lengths: tuple[int, ...]
    kept: tuple[np.ndarray | None, ...] | None = None
    importance: tuple[float, ...] | None = None  # measured at prefill when a plan asked for it
    prompt_lengths: tuple[int, ...] | None = None  # on the first event only
    logprobs: tuple[float, ...] | None = None  # of the forced tokens, when teacher forcing
    greedy: tuple[int, ...] | None = None  # the model's own argmax where a token was forced


def logits_processors(settings: GenerationSettings) -> LogitsProcessorList:
    """transformers' own warpers, so every side of a comparison samples the same way."""
    procs = LogitsProcessorList()
    if settings.do_sample:
        if settings.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(settings.temperature))
        if settings.top_k > 0:
            procs.append(TopKLogitsWarper(settings.top_k))
        if settings.top_p < 1.0:
            procs.append(TopPLogitsWarper(settings.top_p))
    return procs


class _Detokenizer:
    """Incremental text per row that never emits half a multi-byte character."""

    def __init__(self, tokenizer, rows: int):
        self.tokenizer = tokenizer
        self.ids: list[list[int]] = [[] for _ in range(rows)]
        self.emitted = [""] * rows

    def push(self, row: int, token: int) -> str:
        self.ids[row].append(token)
        text = self.tokenizer.decode(self.ids[row], skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.emitted[row]):
            return ""
        delta, self.emitted[row] = text[len(self.emitted[row]):], text
        return delta


class Engine:
    """Runs one model with an optional SkipDecode plan and an optional KV policy."""

    def __init__(self, loaded, skip=None, kv=None):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.arch = get_architecture(loaded.model)
        self.skip = skip
        self.kv = kv
        if skip is not None:
            skip.validate(self.arch.num_layers)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        pad = self.model.generation_config.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.pad_token_id or 0)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- input ----------------------------------------------------------------
    def encode(self, prompts: Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = []
        for p in prompts:
            if isinstance(p, str):
                ids.append(self.tokenizer(p, add_special_tokens=True)["input_ids"] if p.strip() else [])
            else:
                ids.append([int(t) for t in p])
        validate_prompt_ids(ids, self.loaded.context_length, max_new_tokens)
        return ids

    # -- phases -----------------------------------------------------------------
    def prefill(self, cache: KVCache, input_ids: torch.Tensor, positions: torch.Tensor, state: StepState,
                measure_importance: bool) -> tuple[torch.Tensor, list[float] | None]:
        """Run the prompt through every layer; return last-position logits (and layer importance)."""
        arch = self.arch
        rope_pos = positions.clamp(min=0)
        hidden = arch.embed(input_ids, rope_pos)
        layer_kwargs = arch.position_inputs(hidden, rope_pos)
        importance = [] if measure_importance else None
        valid = positions >= 0
        for idx in range(arch.num_layers):
            out = arch.run_layer(idx, hidden, layer_kwargs[idx], cache=cache, state=state)
            if importance is not None:
                importance.append(layer_importance(hidden, out, valid))
            hidden = out
        return arch.head(hidden[:, -1:])[:, -1], importance

    def decode_one_token(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                         layers: Sequence[int], state: StepState) -> torch.Tensor:
        """Feed one token per row through ``layers``; a skipped layer is the identity."""
        arch = self.arch
        pos = positions[:, None]
        hidden = arch.embed(tokens[:, None], pos)
        layer_kwargs = arch.position_inputs(hidden, pos)
        for idx in layers:
            hidden = arch.run_layer(idx, hidden, layer_kwargs[idx], cache=cache, state=state)
        return arch.head(hidden)[:, -1]

    def _select(self, logits: torch.Tensor, history: torch.Tensor, processors, settings, generator):
        if not settings.do_sample:
            return logits.argmax(dim=-1)
        scores = processors(history, logits)
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)

    # -- loop -------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts, settings: GenerationSettings | None = None, *,
                 stop: threading.Event | None = None, record: bool = False,
                 forced: Sequence[Sequence[int]] | None = None) -> Iterator[StepEvent]:
        """Yield one ``StepEvent`` per produced token until EOS, ``max_new_tokens`` or ``stop``.

        ``forced`` (one equal-length token list per row) teacher-forces the output
        through the real cached decode, eviction included, and records each forced
        token's log-probability and the model's own argmax there: that is how
        perplexity and teacher-forced next-token accuracy are measured.
        """
        settings = settings or GenerationSettings()
        if forced is not None:
            lengths = {len(f) for f in forced}
            if len(forced) != (1 if isinstance(prompts, str) else len(prompts)) or len(lengths) != 1 or 0 in lengths:
                raise InputError("forced tokens need one non-empty list per prompt, all of the same length")
            settings = GenerationSettings(max_new_tokens=lengths.pop(), ignore_eos=True)
            forced_ids = torch.tensor(forced, device=self.device)
        prompt_ids = self.encode(prompts, settings.max_new_tokens)
        device, arch = self.device, self.arch
        rows, width = len(prompt_ids), max(len(p) for p in prompt_ids)
        prompt_lens = [len(p) for p in prompt_ids]

        input_ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        positions = torch.full((rows, width), EMPTY, dtype=torch.long)
        for r, ids in enumerate(prompt_ids):
            input_ids[r, width - len(ids):] = torch.tensor(ids)
            positions[r, width - len(ids):] = torch.arange(len(ids))
        input_ids, positions = input_ids.to(device), positions.to(device)

        cache = KVCache([info.sliding_window for info in arch.layer_info])
        kv = self.kv
        budgets = [kv.budget_tokens(n) for n in prompt_lens] if kv is not None else None
        generator = torch.Generator(device=device).manual_seed(settings.seed)
        total_steps = settings.max_new_tokens
        processors = logits_processors(settings)
        detok = _Detokenizer(self.tokenizer, rows)
        finished = [False] * rows
        all_layers = tuple(range(arch.num_layers))

        def state_for(step: int, query_positions: torch.Tensor) -> StepState:
            contribution = None
            if kv is not None and kv.needs_scores:
                def contribution(logits, where, step=step):
                    return kv.contribution(logits, step, total_steps, where)
            return StepState(cache=cache, query_positions=query_positions, contribution=contribution)

        def choose(step, logits):
            if forced is None:
                return self._select(logits, history, processors, settings, generator), None
            token = forced_ids[:, step]
            logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, token[:, None])[:, 0]
            return token, (tuple(logprobs.tolist()), tuple(logits.argmax(dim=-1).tolist()))

        def finish_step(step, token_tensor, layers, started, importance=None, lengths=None, scored=None):
            tokens = token_tensor.tolist()
            texts = []
            for r in range(rows):
                if finished[r]:
                    tokens[r] = self.pad_id
                    texts.append("")
                    continue
                texts.append(detok.push(r, tokens[r]))
                if tokens[r] in self.eos_ids and not settings.ignore_eos:
                    finished[r] = True
            kept = None
            if record:
                kept = tuple(None if layer.positions is None else layer.positions.to(torch.int32).cpu().numpy()
                             for layer in cache.layers)
            return StepEvent(step=step, tokens=tuple(tokens), texts=tuple(texts), finished=tuple(finished),
                             layers=layers, seconds=time.perf_counter() - started, kv_bytes=cache.nbytes,
                             cache_lengths=cache.lengths(), kept=kept,
                             importance=tuple(importance) if importance is not None else None,
                             prompt_lengths=lengths, logprobs=scored[0] if scored else None,
                             greedy=scored[1] if scored else None)

        # Token 0: the prompt at full depth.
        started = time.perf_counter()
        cache.pending_positions, cache.pending_dense = positions, bool((positions >= 0).all())
        plan_needs_importance = self.skip is not None and self.skip.needs_importance
        logits, importance = self.prefill(cache, input_ids, positions, state_for(0, positions), plan_needs_importance)
        plan = self.skip.plan(arch.num_layers, importance) if self.skip is not None else None
        next_pos = torch.tensor(prompt_lens, device=device)
        self._shrink(cache, all_layers, budgets, next_pos)
        history = input_ids
        token, scored = choose(0, logits)
        yield finish_step(0, token, all_layers, started, importance, tuple(prompt_lens), scored)

        for t in range(total_steps - 1):
            if all(finished) or (stop is not None and stop.is_set()):
                break
            started = time.perf_counter()
            layers = plan.layer_set(t) if plan is not None else all_layers
            for idx in all_layers:
                if cache.layers[idx].keys is not None and idx not in layers:
                    cache.layers[idx].clear()  # E(t) only shrinks: this layer never runs again
            feed = torch.where(torch.tensor(finished, device=device), self.pad_id, token)
            cache.pending_positions, cache.pending_dense = next_pos[:, None], True
            logits = self.decode_one_token(cache, feed, next_pos, layers, state_for(t + 1, next_pos[:, None]))
            next_pos = next_pos + 1
            self._shrink(cache, layers, budgets, next_pos)
            if processors:
                history = torch.cat([history, feed[:, None]], dim=1)
            token, scored = choose(t + 1, logits)
            yield finish_step(t + 1, token, layers, started, scored=scored)
        cache.layers.clear()

    def _shrink(self, cache: KVCache, layers: Sequence[int], budgets, next_positions: torch.Tensor):
        """Trim sliding windows and evict to the KV budget, for the layers that just ran."""
        for idx in layers:
            layer = cache.layers[idx]
            if layer.keys is None:
                continue
            if budgets is not None and self.kv.evicts:
                self.kv.evict(layer, budgets, next_positions)
            else:
                layer.trim_to_window(next_positions)


__all__ = ["Engine", "InputError", "StepEvent", "logits_processors"]
