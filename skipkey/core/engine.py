"""The decode loop: ``prefill``, ``decode_one_token``, ``generate``.

The engine calls the model's decoder layers itself, with a KV cache it owns
(``skipkey.core.cache``), explicit positions and per-layer masks. Two optional,
independent methods plug in:

* a SkipDecode plan decides which layers step ``t`` runs (``E(t)``, nested);
* a KV policy decides which cached tokens each running layer keeps.

``generate`` yields one ``StepEvent`` per produced token; ``skipkey.core.trace``
collects them, and figures and metrics are pure functions of the trace.

Under an accelerate device map (``skipkey.core.offload``) each layer runs on its own
device: the hidden states go there before the layer, and its cache, positions,
masks and scores live there. One device is the usual case and costs nothing extra.
"""

from __future__ import annotations

import dataclasses
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

from skipkey.core.architectures import get_architecture
from skipkey.core.attention import StepState, replay_prompt
from skipkey.core.cache import EMPTY, KVCache
from skipkey.core.gemm import measure_module
from skipkey.core.importance import layer_importance
from skipkey.core.retention import Appending, Retention
from skipkey.config import GenerationSettings, validate_prompt_ids
from skipkey.errors import InputError


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
    # Exact decoding, on each verify step's first token (``skipkey.skipdecode.exact.ExactDecoding.decode``), and
    # when recording on every token: the verify's gap between its two best logits there (``margin``).
    drafted: int | None = None
    accepted: tuple[int, ...] | None = None
    draft_layers: tuple[tuple[int, ...], ...] | None = None
    draft_seconds: float | None = None
    draft_source: str | None = None
    margin: tuple[float, ...] | None = None


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
    """Runs one model with an optional SkipDecode plan and an optional KV policy.

    ``exact`` (an ``ExactDecoding``) makes the plan a draft that the full model verifies: greedy output
    equal to the full model's.
    """

    def __init__(self, loaded, skip=None, kv=None, exact=None):
        self.loaded, self.model = loaded, loaded.model
        self.tokenizer = loaded.tokenizer
        self.arch = get_architecture(loaded.model)
        # The prompt pass, and steps that skip fewer than ``min_skipped`` layers, run these weights; ``arch``'s
        # run the others (they differ only for a skip-only adapter, ``LoadedModel.full_depth``).
        self.full_arch = self.arch if loaded.full_depth is None else get_architecture(loaded.full_depth)
        measure_module(self.full_arch.model.lm_head)  # once per process and head shape: never a timed step's cost
        self.min_skipped = loaded.min_skipped
        self.skip, self.kv = skip, kv
        if skip is not None:
            skip.validate(self.arch.num_layers)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        pad = self.model.generation_config.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.pad_token_id or 0)
        # Where ids go, each layer runs and the head runs (several devices under a device map).
        self.device = self.arch.input_device
        self.layer_devices = tuple(self.arch.layer_device(i) for i in range(self.arch.num_layers))
        self.head_device = self.arch.head_device
        self.exact = exact
        if exact is not None:
            exact.validate(self)

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
    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, state: StepState, retention: Retention,
                measure_importance: bool) -> tuple[torch.Tensor, list[float] | None]:
        """Run the prompt through every layer; return last-position logits (and layer importance).

        Each layer's cache settles (evicts or trims) as soon as the layer has run, so
        the prompt's full keys and values are held for one layer at a time.
        """
        arch = self.full_arch
        rope_pos = positions.clamp(min=0)
        hidden = arch.embed(input_ids, rope_pos)
        layer_kwargs = arch.position_inputs(hidden, rope_pos)
        importance = [] if measure_importance else None
        shared = _OnDevices(state, positions.max(dim=1).values + 1, positions >= 0)
        for idx in range(arch.num_layers):
            layer_state, next_positions, valid = shared.on(self.layer_devices[idx])
            hidden = hidden.to(self.layer_devices[idx])
            out = arch.run_layer(idx, hidden, layer_kwargs[idx], state=layer_state)
            retention.after(state.cache.layers[idx], 0, next_positions)
            if importance is not None:
                importance.append(layer_importance(hidden, out, valid))
            hidden = out
        return arch.head(hidden[:, -1:].to(self.head_device))[:, -1].to(self.device), importance

    def replay_prefill(self, recorded: "PromptPass", state: StepState,
                       retention: Retention) -> tuple[torch.Tensor, list[float] | None]:
        """``prefill`` from a recorded prompt pass: each layer's cache is filled and scored, no layer runs."""
        shared = _OnDevices(state, recorded.positions.max(dim=1).values + 1)
        for idx in range(self.arch.num_layers):
            layer_state, next_positions, _ = shared.on(self.layer_devices[idx])
            replay_prompt(state.cache.layers[idx], idx, recorded.captured[idx], layer_state)
            retention.after(state.cache.layers[idx], 0, next_positions)
        return recorded.logits, list(recorded.importance)

    @torch.inference_mode()
    def prompt_pass(self, prompts) -> "PromptPass":
        """Run the prompt once at full depth and keep what every KV policy starts from.

        The prompt pass is the same whatever the policy (eviction starts after it), so
        an evaluation of many policies and budgets runs it once per prompt and hands
        the result to ``generate(..., prompt_pass=...)``. It holds each layer's prompt
        queries, keys and values: about twice the full prompt cache.
        """
        batch = _Batch.build(self.encode(prompts, 1), self.pad_id, self.device)
        cache = KVCache([info.sliding_window for info in self.arch.layer_info])
        captured: dict[int, tuple] = {}
        dense = bool((batch.positions >= 0).all())
        state = StepState(cache=cache, query_positions=batch.positions, dense=dense, capture=captured)
        retention = Appending(1)
        retention.prepare(cache)
        logits, importance = self.prefill(batch.input_ids, batch.positions, state, retention, True)
        return PromptPass(batch, [captured[i] for i in range(self.arch.num_layers)], logits, tuple(importance))

    def decode_one_token(self, tokens: torch.Tensor, positions: torch.Tensor, layers: Sequence[int],
                         state: StepState, retention: Retention, step: int) -> torch.Tensor:
        """Feed one token per row through ``layers``; a skipped layer is the identity."""
        arch = self.arch if self.arch.num_layers - len(layers) >= self.min_skipped else self.full_arch
        pos = positions[:, None]
        hidden = arch.embed(tokens[:, None], pos)
        layer_kwargs = arch.position_inputs(hidden, pos)
        shared = _OnDevices(state, positions + 1)
        for idx in layers:
            layer_state, next_positions, _ = shared.on(self.layer_devices[idx])
            hidden = arch.run_layer(idx, hidden.to(self.layer_devices[idx]), layer_kwargs[idx], state=layer_state)
            retention.after(state.cache.layers[idx], step, next_positions)
        return arch.head(hidden.to(self.head_device))[:, -1].to(self.device)

    def step_state(self, cache: KVCache, query_positions: torch.Tensor, step: int, total_steps: int,
                   position_limit: int) -> StepState:
        """What the attention function needs for one forward: the cache, the positions, the KV scoring."""
        kv = self.kv
        dense = query_positions.shape[1] == 1 or bool((query_positions >= 0).all())
        if kv is None or not kv.needs_scores:
            return StepState(cache=cache, query_positions=query_positions, dense=dense)
        start = kv.start_score(step, query_positions)
        if step > 0 and not kv.scores_while_decoding:
            return StepState(cache=cache, query_positions=query_positions, dense=dense, start_score=start)
        return StepState(cache=cache, query_positions=query_positions, dense=dense, start_score=start,
                         contribution=kv.score_contribution(step, total_steps),
                         accumulate=kv.accumulates, observe=kv.prompt_observe if step == 0 else 0,
                         position_limit=position_limit)

    # -- loop -------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts, settings: GenerationSettings | None = None, *,
                 stop: threading.Event | None = None, record: bool = False,
                 forced: Sequence[Sequence[int]] | None = None,
                 prompt_pass: "PromptPass | None" = None) -> Iterator[StepEvent]:
        """Yield one ``StepEvent`` per produced token until EOS, ``max_new_tokens`` or ``stop``.

        ``prompt_pass`` (from ``Engine.prompt_pass`` on the same prompts and model)
        starts from that recorded prompt pass instead of running the prompt again.

        ``forced`` (one equal-length token list per row) teacher-forces the output
        through the real cached decode, eviction included, and records each forced
        token's log-probability and the model's own argmax there: that is how
        perplexity and teacher-forced next-token accuracy are measured.
        """
        settings, forced_ids = self._forcing(prompts, settings, forced)
        if self.exact is not None:
            self.exact.check(settings, forced)
        batch = _Batch.build(self.encode(prompts, settings.max_new_tokens), self.pad_id, self.device)
        total_steps = settings.max_new_tokens
        cache, retention = self._storage(batch, total_steps)
        choose = _TokenChooser(settings, forced_ids, batch.input_ids)
        events = _EventBuilder(self, batch.rows, settings, cache, record)
        all_layers = tuple(range(self.arch.num_layers))

        # Token 0: the prompt at full depth.
        started = time.perf_counter()
        needs_importance = self.skip is not None and self.skip.needs_importance
        longest = max(batch.lengths)
        state = self.step_state(cache, batch.positions, 0, total_steps, longest)
        if prompt_pass is not None:
            prompt_pass.check(batch)
            logits, importance = self.replay_prefill(prompt_pass, state, retention)
        else:
            logits, importance = self.prefill(batch.input_ids, batch.positions, state, retention, needs_importance)
        plan = self.skip.plan(self.arch.num_layers, importance) if self.skip is not None else None
        token, scored = choose(0, logits)
        yield events.build(0, token, all_layers, started, scored, importance=importance,
                           prompt_lengths=tuple(batch.lengths))

        if self.exact is not None:
            yield from self.exact.decode(self, cache, events, plan, token, batch, stop)
            cache.layers.clear()
            return
        next_pos = torch.tensor(batch.lengths, device=self.device)
        for step in range(1, total_steps):
            if events.all_finished or (stop is not None and stop.is_set()):
                break
            started = time.perf_counter()
            layers = plan.layer_set(step - 1) if plan is not None else all_layers
            for idx in all_layers:
                if idx not in layers:
                    cache.layers[idx].clear()  # E(t) only shrinks: this layer never runs again
            feed = events.feed(token)
            state = self.step_state(cache, next_pos[:, None], step, total_steps, longest + step)
            logits = self.decode_one_token(feed, next_pos, layers, state, retention, step)
            next_pos = next_pos + 1
            choose.extend(feed)
            token, scored = choose(step, logits)
            yield events.build(step, token, layers, started, scored)
        cache.layers.clear()

    def _storage(self, batch: "_Batch", total_steps: int):
        """The run's cache and what each layer keeps of it (an exact run's verify forward writes k + 1 at once)."""
        windows = [info.sliding_window for info in self.arch.layer_info]
        exact = self.exact
        cache = KVCache(windows) if exact is None else exact.new_cache(windows)
        room = total_steps + (0 if exact is None else exact.lookback)
        retention = Appending(room) if self.kv is None else self.kv.retention(batch.lengths, batch.positions.device,
                                                                              room)
        retention.prepare(cache)
        return cache, retention

    def _forcing(self, prompts, settings: GenerationSettings | None, forced):
        """Settings for the run and the forced tokens as a tensor (teacher forcing), validated."""
        settings = settings or GenerationSettings()
        if forced is None:
            return settings, None
        lengths = {len(f) for f in forced}
        if len(forced) != (1 if isinstance(prompts, str) else len(prompts)) or len(lengths) != 1 or 0 in lengths:
            raise InputError("forced tokens need one non-empty list per prompt, all of the same length")
        settings = GenerationSettings(max_new_tokens=lengths.pop(), ignore_eos=True)
        return settings, torch.tensor(forced, device=self.device)


@dataclass(frozen=True)
class _Batch:
    """Left-padded prompts: ids, positions (EMPTY at padding) and each row's length."""

    input_ids: torch.Tensor  # [B, W]
    positions: torch.Tensor  # [B, W]
    lengths: list[int]

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @classmethod
    def build(cls, prompt_ids: list[list[int]], pad_id: int, device) -> "_Batch":
        rows, width = len(prompt_ids), max(len(p) for p in prompt_ids)
        input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
        positions = torch.full((rows, width), EMPTY, dtype=torch.long)
        for r, ids in enumerate(prompt_ids):
            input_ids[r, width - len(ids):] = torch.tensor(ids)
            positions[r, width - len(ids):] = torch.arange(len(ids))
        return cls(input_ids.to(device), positions.to(device), [len(p) for p in prompt_ids])


@dataclass(frozen=True)
class PromptPass:
    """A recorded prompt pass (``Engine.prompt_pass``): per layer (queries, keys, values, scale)."""

    batch: _Batch
    captured: list[tuple]
    logits: torch.Tensor
    importance: tuple[float, ...]

    def check(self, batch: _Batch) -> None:
        if batch.lengths != self.batch.lengths or not torch.equal(batch.input_ids, self.batch.input_ids):
            raise InputError("the recorded prompt pass is for other prompts")

    @property
    def positions(self) -> torch.Tensor:
        return self.batch.positions


class _OnDevices:
    """What every layer of one forward shares (engine state, next positions, valid tokens), per device.

    The copy for a device is made when the first layer there runs, once per forward,
    not once per layer; on the device the forward started on it is the original.
    """

    def __init__(self, state: StepState, next_positions: torch.Tensor, valid: torch.Tensor | None = None):
        self.copies = {next_positions.device: (state, next_positions, valid)}

    def on(self, device: torch.device) -> tuple[StepState, torch.Tensor, torch.Tensor | None]:
        found = self.copies.get(device)
        if found is None:
            state, next_positions, valid = next(iter(self.copies.values()))
            found = self.copies[device] = (
                dataclasses.replace(state, query_positions=state.query_positions.to(device),
                                    start_score=None if state.start_score is None else state.start_score.to(device)),
                next_positions.to(device), None if valid is None else valid.to(device))
        return found


class _TokenChooser:
    """Each row's next token: the model's choice (greedy or sampled) or, when teacher forcing, the forced one."""

    def __init__(self, settings: GenerationSettings, forced_ids: torch.Tensor | None, prompt_ids: torch.Tensor):
        self.settings = settings
        self.forced_ids = forced_ids
        self.processors = logits_processors(settings)
        self.history = prompt_ids  # what the warpers may look at (penalties would need it)
        self.generator = torch.Generator(device=prompt_ids.device).manual_seed(settings.seed)

    def extend(self, fed: torch.Tensor) -> None:
        if self.processors:
            self.history = torch.cat([self.history, fed[:, None]], dim=1)

    def __call__(self, step: int, logits: torch.Tensor):
        """``(tokens, scored)``; ``scored`` = (log-probabilities of the forced tokens, the argmax) or None."""
        if self.forced_ids is not None:
            token = self.forced_ids[:, step]
            logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, token[:, None])[:, 0]
            return token, (tuple(logprobs.tolist()), tuple(logits.argmax(dim=-1).tolist()))
        if not self.settings.do_sample:
            return logits.argmax(dim=-1), None
        probs = torch.softmax(self.processors(self.history, logits), dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1), None


class _EventBuilder:
    """Turns each step's tokens into a ``StepEvent``: text deltas, finished rows, what the caches keep."""

    def __init__(self, engine: Engine, rows: int, settings: GenerationSettings, cache: KVCache, record: bool):
        self.pad_id, self.eos_ids, self.settings, self.cache, self.record = (engine.pad_id, engine.eos_ids, settings,
                                                                             cache, record)
        self.detok = _Detokenizer(engine.tokenizer, rows)
        self.finished = [False] * rows

    @property
    def all_finished(self) -> bool:
        return all(self.finished)

    def feed(self, token: torch.Tensor) -> torch.Tensor:
        """The tokens to feed next: a finished row gets padding."""
        if not any(self.finished):
            return token
        return torch.where(torch.tensor(self.finished, device=token.device), self.pad_id, token)

    def build(self, step: int, token: torch.Tensor, layers: tuple[int, ...], started: float, scored=None, *,
              importance=None, prompt_lengths=None) -> StepEvent:
        tokens, texts = token.tolist(), []
        for r, done in enumerate(self.finished):
            if done:
                tokens[r] = self.pad_id
                texts.append("")
                continue
            texts.append(self.detok.push(r, tokens[r]))
            if tokens[r] in self.eos_ids and not self.settings.ignore_eos:
                self.finished[r] = True
        kept = None
        if self.record:
            kept = tuple(None if (k := layer.kept_positions()) is None else k.to(torch.int32).cpu().numpy()
                         for layer in self.cache.layers)
        return StepEvent(step=step, tokens=tuple(tokens), texts=tuple(texts), finished=tuple(self.finished),
                         layers=layers, seconds=time.perf_counter() - started, kv_bytes=self.cache.nbytes,
                         cache_lengths=self.cache.lengths(), kept=kept,
                         importance=tuple(importance) if importance is not None else None,
                         prompt_lengths=prompt_lengths, logprobs=scored[0] if scored else None,
                         greedy=scored[1] if scored else None)


__all__ = ["Engine", "InputError", "PromptPass", "StepEvent", "logits_processors"]
