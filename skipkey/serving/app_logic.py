"""What the app does, without the page: the model cache, the request edge, the comparison.

``app.py`` only wires these to Gradio components. Everything here is plain
Python, so tests call it directly with a tiny model.

* ``ModelCache`` loads each allowed model once (in the background, so the page
  can show progress) and hands the same ``LoadedModel`` to every request; the
  same for a model's SkipDecode-tuned copy, where an adapter was trained for it.
* ``Controls`` declares the controls once: each field is a control, in the
  order of the ``/compare`` API's parameters, with its default and its range.
  ``app.py`` adds how each looks (``app.WIDGETS``) and names the API from it;
  tests build it. Presets and examples are ``Controls`` values too.
* ``AppLimits`` are the server's own caps (prompt tokens, seconds a request),
  from the environment; ``check_prompt`` refuses a prompt before anything runs.
* ``build_request`` is the edge: raw ``Controls`` (from the page or from any API
  client) become one frozen ``ComparisonRequest``, or an ``InputError`` that
  says what is allowed. The ranges are the library's own checks.
* ``compare`` runs the full model and SkipKey interleaved step by step on one
  device, each side timed by its own steps only, and yields both traces.
* ``side_metrics`` / ``agreement_summary`` turn traces into the text under each column.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Iterator, Mapping, Sequence

from skipkey.core.architectures import get_architecture
from skipkey.config import GenerationSettings, decode_steps
from skipkey.core.engine import Engine
from skipkey.errors import InputError, ModelLoadError
from skipkey.kv.policies import KV_POLICIES, RECOMMENDED_OPTIONS, KVPolicy, KVSpec, make_kv_policy, policy_options
from skipkey.core.loading import EMBEDDED, LoadedModel
from skipkey.skipdecode.adapter import adapter_schedule, load_tuned, read_metadata
from skipkey.quality.metrics import (Acceptance, Compute, Speed, Transfer, acceptance, agreement, compute, jsonable, kv_share, memory, rouge_l,
                                     speed, trace_record, traffic, transfer)
from skipkey.core.offload import Placement, make_placement
from skipkey.skipdecode.schedules import SCHEDULE_KINDS
from skipkey.skipdecode.plan import LAYER_POLICIES, SkipDecode, SkipDecodeSpec
from skipkey.skipdecode.exact import DRAFT_K_CAP, ExactDecoding
from skipkey.core.trace import Trace, lockstep

MODELS_ENV = "SKIPKEY_MODELS"
# A model larger than the server's device: placed by accelerate (see skipkey.core.offload.make_placement).
DEVICE_MAP_ENV, MAX_MEMORY_ENV, OFFLOAD_DIR_ENV = "SKIPKEY_DEVICE_MAP", "SKIPKEY_MAX_MEMORY", "SKIPKEY_OFFLOAD_DIR"
DECODING = ("greedy", "sample")
SET_BY = ("layers", "target speedup")
# The KV registry's policies, newest method first ("full" is the left column, not a choice).
KV_CHOICES = tuple(name for name in reversed(KV_POLICIES) if name != "full")
# The embedded model answers it right, full and at 1.5x tuned alike (the screenshot: the page at its defaults).
DEFAULT_PROMPT = "Photosynthesis is the process by which plants"
DEFAULT_NEW_TOKENS = 48  # light enough that the embedded model answers within seconds on a small CPU
DEFAULT_TARGET = 1.5  # SkipDecode's default nominal speedup (README, "SkipDecode fine-tuning": the frontier)
MAX_NEW_TOKENS_UI = 512
# Exact SkipDecode's draft head: the full LM head, or the rows of the most frequent tokens
# (skipkey.skipdecode.exact.DRAFT_VOCAB_FILE ranks them for the embedded model's tokenizer).
DRAFT_VOCAB_TOKENS = 32768
DRAFT_HEADS: Mapping[str, int] = MappingProxyType({"full head": 0,
                                                   f"{DRAFT_VOCAB_TOKENS:,} most frequent tokens": DRAFT_VOCAB_TOKENS})
DEFAULT_DRAFT_K = 3

Loader = Callable[[str], LoadedModel]
Tuner = Callable[[LoadedModel, Path], LoadedModel]
# The SkipDecode LoRA adapter committed for the embedded model (python -m skipkey finetune).
EMBEDDED_ADAPTER = Path(__file__).resolve().parents[2] / "assets" / "skipdecode-lora"


def allowed_models(env: str | None = None) -> tuple[str, ...]:
    """The embedded model first, then the comma-separated ids in ``$SKIPKEY_MODELS`` (GPU deployments)."""
    text = os.environ.get(MODELS_ENV, "") if env is None else env
    extra = [name.strip() for name in text.split(",") if name.strip()]
    return tuple(dict.fromkeys([EMBEDDED, *extra]))


def placement_options(env: Mapping[str, str] | None = None) -> dict:
    """``load_model``'s placement arguments: ``$SKIPKEY_DEVICE_MAP``, ``_MAX_MEMORY``, ``_OFFLOAD_DIR``."""
    env = os.environ if env is None else env
    return dict(device_map=env.get(DEVICE_MAP_ENV) or None, max_memory=env.get(MAX_MEMORY_ENV) or None,
                offload_dir=env.get(OFFLOAD_DIR_ENV) or None)


def server_placement(env: Mapping[str, str] | None = None) -> Placement | None:
    """The server's placement, checked: an InputError saying which variable is wrong, or None (whole models)."""
    options = placement_options(env)
    try:
        return make_placement(**options)
    except InputError as error:
        raise InputError(f"{error} (from {DEVICE_MAP_ENV}, {MAX_MEMORY_ENV}, {OFFLOAD_DIR_ENV})") from None


def default_adapters() -> dict[str, Path]:
    """Model name -> SkipDecode adapter directory, for the adapters that are present.

    None under a device map: an adapter is merged into a copy of the whole model.
    """
    if server_placement() is not None:
        return {}
    return {EMBEDDED: EMBEDDED_ADAPTER} if EMBEDDED_ADAPTER.is_dir() else {}


def default_loader(name: str) -> LoadedModel:
    from skipkey.core.loading import load_model

    return load_model(name, progress=True, **placement_options())


class ModelCache:
    """Each allowed model is loaded once, on a background thread, and then shared.

    A failed load is not cached: the next request tries again (the hub may be back).
    Only names on the allow-list are ever loaded, whatever a client sends. A model
    with an adapter in ``adapters`` also has a tuned copy (``tuned_future``), made
    once from the loaded model; it shares every tensor the adapter leaves alone.
    """

    def __init__(self, loader: Loader = default_loader, allowed: Sequence[str] | None = None,
                 adapters: dict[str, Path] | None = None, tuner: Tuner = load_tuned):
        self._loader, self._tuner = loader, tuner
        self.allowed = tuple(allowed) if allowed is not None else allowed_models()
        if not self.allowed:
            raise InputError("no model is allowed: the allow-list is empty")
        self.adapters = dict(default_adapters() if adapters is None else adapters)
        self._schedules: dict[str, tuple[str, dict] | None] = {}
        self._futures: dict[tuple[str, bool], Future] = {}
        self._lock = threading.Lock()

    @property
    def default(self) -> str:
        return self.allowed[0]

    def check(self, name) -> str:
        if not isinstance(name, str) or name not in self.allowed:
            raise InputError(f"model {name!r} is not offered here; choose one of: {', '.join(self.allowed)} "
                             f"(the server's {MODELS_ENV} sets the list)")
        return name

    def has_tuned(self, name) -> bool:
        return isinstance(name, str) and name in self.adapters

    def _schedule(self, name) -> tuple[str, dict] | None:
        """(layer policy, shape table) ``name``'s adapter was trained with; None without a readable one."""
        if not self.has_tuned(name):
            return None
        if name not in self._schedules:  # read once: the schedule preview asks on every slider move
            try:
                self._schedules[name] = adapter_schedule(read_metadata(self.adapters[name]))
            except (InputError, ModelLoadError):
                self._schedules[name] = None  # loading the tuned copy will say what is wrong with the adapter
        return self._schedules[name]

    def shapes(self, name) -> dict | None:
        """The schedule-shape table ``name``'s adapter was trained with (None: no adapter, or none recorded).

        A target speedup uses it whether tuning is on or off, so the two differ in weights only.
        """
        schedule = self._schedule(name)
        return schedule[1] if schedule else None

    def policy(self, name) -> str | None:
        """The layer policy ``name``'s adapter was trained with (None: no adapter): the page selects it."""
        schedule = self._schedule(name)
        return schedule[0] if schedule else None

    def check_tuned(self, name) -> str:
        name = self.check(name)
        if name not in self.adapters:
            offered = ", ".join(self.adapters) or "no model on this server"
            raise InputError(f"model {name!r} has no SkipDecode-tuned adapter here; tuned weights exist for: "
                             f"{offered} (turn 'tuned weights' off)")
        return name

    def future(self, name) -> Future:
        """A future for the loaded model; starts loading it unless it is loaded or loading."""
        return self._start(self.check(name), tuned=False)

    def tuned_future(self, name) -> Future:
        """A future for the model with its SkipDecode adapter merged (loads the base first if needed)."""
        return self._start(self.check_tuned(name), tuned=True)

    def _start(self, name: str, tuned: bool) -> Future:
        with self._lock:
            future = self._futures.get((name, tuned))
            if future is None or (future.done() and future.exception() is not None):
                future = self._futures[(name, tuned)] = Future()
                threading.Thread(target=self._load, args=(name, tuned, future),
                                 name=f"load {name}{' tuned' if tuned else ''}", daemon=True).start()
        return future

    def loaded(self, name) -> LoadedModel | None:
        """The model if it is already loaded, else None (never waits)."""
        future = self._futures.get((name, False))
        if future is None or not future.done() or future.exception() is not None:
            return None
        return future.result()

    def get(self, name, timeout: float | None = None) -> LoadedModel:
        return self.future(name).result(timeout)

    def _load(self, name: str, tuned: bool, future: Future) -> None:
        try:
            if tuned:
                loaded = self._tuner(self.future(name).result(), self.adapters[name])
            else:
                loaded = self._loader(name)
            get_architecture(loaded.model)  # registers SkipKey's attention once, before requests share it
        except BaseException as error:  # noqa: BLE001 - handed to every waiting request
            future.set_exception(error)
        else:
            future.set_result(loaded)


# -- the controls, declared once ----------------------------------------------------------
@dataclass(frozen=True)
class Control:
    """What serving knows of one of the ``Controls``: its range or choices, and whether it shapes the schedule.

    ``minimum``/``maximum``/``step`` bound a number, ``choices`` a choice (None: not
    bounded here; ``build_request`` and the library check every value anyway).
    ``preview``: the schedule preview redraws when it changes. How a control looks
    (widget, label, panel) is the page's business: ``app.WIDGETS``.
    """

    minimum: float | None = None
    maximum: float | None = None
    step: float | None = None
    choices: tuple[str, ...] | None = None
    preview: bool = False

    def bounds(self) -> dict:
        """The range as keyword arguments (``minimum``, ``maximum``, ``step``, ``choices``), only those set."""
        given = dict(minimum=self.minimum, maximum=self.maximum, step=self.step, choices=self.choices)
        return {key: value for key, value in given.items() if value is not None}


def _control(default, *, preview: bool = False, **bounds):
    return field(default=default, metadata={"control": Control(preview=preview, **bounds)})


@dataclass(frozen=True)
class Controls:
    """The raw values of the page's controls, which are also ``/compare``'s parameters, in this order.

    Raw: as the page or an API client sends them (6.0 for 6, a string for a
    number); ``build_request`` checks them. Defaults are the page's, except that
    the page selects the layer policy the default model's adapter was trained
    with (``app.Handlers.defaults``). To add a control, add a field here (it
    appears in the API), a widget for it in ``app.WIDGETS`` (it appears on the
    page), and read it in ``build_request``.
    """

    prompt: str = _control(DEFAULT_PROMPT)
    model: str = _control(EMBEDDED, preview=True)
    max_new_tokens: int = _control(DEFAULT_NEW_TOKENS, preview=True, minimum=1, maximum=MAX_NEW_TOKENS_UI, step=1)
    decoding: str = _control("greedy", choices=DECODING)
    temperature: float = _control(0.8, minimum=0.05, maximum=2.0, step=0.05)
    seed: int = _control(0, minimum=0)
    skip_on: bool = _control(True)
    layer_policy: str = _control("top", preview=True, choices=LAYER_POLICIES)
    schedule: str = _control("linear", preview=True, choices=SCHEDULE_KINDS)
    set_by: str = _control("target speedup", preview=True, choices=SET_BY)
    b_max: int = _control(18, preview=True, minimum=2, maximum=64, step=1)
    b_min: int = _control(12, preview=True, minimum=2, maximum=64, step=1)
    horizon: int = _control(DEFAULT_NEW_TOKENS, preview=True, minimum=0, maximum=MAX_NEW_TOKENS_UI, step=1)
    warmup: int = _control(1, preview=True, minimum=0, maximum=63, step=1)
    exponent: float = _control(2.0, preview=True, minimum=0.25, maximum=4.0, step=0.25)
    target_speedup: float = _control(DEFAULT_TARGET, preview=True, minimum=1.0, maximum=32.0, step=0.05)
    kv_on: bool = _control(False)
    kv_policy: str = _control("keyformer", choices=KV_CHOICES)
    kv_budget_pct: float = _control(50, minimum=1, maximum=100, step=1)
    kv_recent_pct: float = _control(30, minimum=0, maximum=100, step=1)
    tau_init: float = _control(1.0, minimum=0.1, maximum=5.0, step=0.1)
    tau_end: float = _control(2.0, minimum=0.1, maximum=5.0, step=0.1)
    kv_observe: int = _control(0, minimum=0, maximum=512, step=1)
    kv_pool: int = _control(1, minimum=1, maximum=15, step=2)
    kv_normalize: bool = _control(False)
    tuned: bool = _control(True)
    hold: int = _control(0, preview=True, minimum=0, maximum=MAX_NEW_TOKENS_UI, step=1)
    exact: bool = _control(False)
    draft_k: int = _control(DEFAULT_DRAFT_K, minimum=1, maximum=DRAFT_K_CAP, step=1)
    draft_head: str = _control("full head", choices=tuple(DRAFT_HEADS))


CONTROLS: Mapping[str, Control] = MappingProxyType({f.name: f.metadata["control"] for f in fields(Controls)})
PREVIEW_CONTROLS = tuple(name for name, control in CONTROLS.items() if control.preview)


@dataclass(frozen=True)
class ComparisonRequest:
    """One validated comparison: the prompt, how to decode, and SkipKey's two methods."""

    model: str
    prompt: str
    settings: GenerationSettings
    skip: SkipDecode | None
    kv: KVPolicy | None
    tuned: bool = False  # SkipKey's side decodes with the model's SkipDecode-tuned weights
    exact: ExactDecoding | None = None  # SkipDecode drafts, the full model verifies: the full model's tokens

    def hint(self) -> str:
        """What to try next, where the request shows one of the product's own additions."""
        if self.kv is not None and self.kv.name in ("h2o", "keyformer") and self.kv.prompt_observe:
            return (f" Set **observe** to 0 to see the paper's {self.kv.name}: it scores the prompt from every "
                    f"query and can drop what the question asks for.")
        return ""

    def describe(self) -> str:
        parts = [self.skip.describe() if self.skip else "no layer skipping",
                 f"KV {self.kv.describe()}" if self.kv else "full KV cache"]
        if self.exact:
            parts.insert(1, self.exact.describe())
        if self.tuned:
            parts.append("SkipDecode-tuned weights")
        return "; ".join(parts)


def _whole(value):
    """Sliders and JSON clients send 6.0 for 6; the library's checks want integers."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def _number(value):
    """A numeric string from an API client as a number; anything else unchanged for the checks to refuse."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{name} must be true or false, got {value!r}")
    return value


def _choice(name: str, value, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise InputError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _percent(value):
    value = _number(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value / 100
    return value


def _budget_percent(value):
    """The app's KV budget, a percentage of the prompt, as the library's fraction; above 100 is refused
    (as a fraction it would be a whole number, which the library reads as a token count)."""
    value = _number(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 100:
        raise InputError(f"KV budget must be in (0, 100] % of the prompt, got {value}")
    return _percent(value)


def build_request(num_layers: int, controls: Controls, shapes: dict | None = None) -> ComparisonRequest:
    """The edge: raw control values -> a frozen ``ComparisonRequest``, or an ``InputError``.

    Ranges are checked by the library (``GenerationSettings``, ``SkipDecodeSpec``,
    ``KVSpec``); here only the app's own choices (on/off, greedy/sample,
    layers/target) and the unit conversions (% -> fraction, 6.0 -> 6).
    For a constant schedule ``b_min`` is its number of layers. A target speedup takes
    the measured-best shape: ``shapes`` (the model's adapter's table, so that tuned and
    untuned weights run the same schedule) or ``schedules.MEASURED_SHAPES``.
    """
    c = controls
    if not isinstance(c.prompt, str):
        raise InputError(f"prompt must be text, got {type(c.prompt).__name__}")
    sample = _choice("decoding", c.decoding, DECODING) == "sample"
    seed = _whole(_number(c.seed))
    settings = GenerationSettings(max_new_tokens=_whole(_number(c.max_new_tokens)), do_sample=sample,
                                  temperature=_number(c.temperature), seed=seed)
    skip = None
    if _flag("SkipDecode on/off", c.skip_on):
        gen_len = decode_steps(settings.max_new_tokens)
        common = dict(kind=c.schedule, policy=c.layer_policy, warmup=_whole(_number(c.warmup)),
                      exponent=_number(c.exponent))
        if _choice("set SkipDecode by", c.set_by, SET_BY) == "target speedup":
            policy = _choice("layers", c.layer_policy, LAYER_POLICIES)
            spec = SkipDecodeSpec(target=_number(c.target_speedup), policy=policy, shapes=shapes)
        elif c.schedule == "constant":
            spec = SkipDecodeSpec(layers=_whole(_number(c.b_min)), **common)
        else:
            spec = SkipDecodeSpec(b_max=_whole(_number(c.b_max)), b_min=_whole(_number(c.b_min)),
                                  horizon=_whole(_number(c.horizon)), hold=_whole(_number(c.hold)), **common)
        skip = spec.build(num_layers, gen_len)
    kv = None
    if _flag("KV eviction on/off", c.kv_on):
        try:
            options = dict(tau_init=_number(c.tau_init), tau_end=_number(c.tau_end),
                           observe=_whole(_number(c.kv_observe)), pool=_whole(_number(c.kv_pool)),
                           normalize=_flag("normalize", c.kv_normalize))
            # Each method takes its own options; the page shows them all.
            known = policy_options(c.kv_policy) if c.kv_policy in KV_POLICIES else ()
            kv = KVSpec(c.kv_policy, _budget_percent(c.kv_budget_pct), _percent(c.kv_recent_pct), seed=seed,
                        options={k: v for k, v in options.items() if k in known}).build()
        except InputError as error:
            raise InputError(f"{error} (the app's KV budget and recent window are in %: 50 means 0.5)") from None
    return ComparisonRequest(model=c.model, prompt=c.prompt, settings=settings, skip=skip, kv=kv,
                             tuned=_flag("tuned weights on/off", c.tuned), exact=exact_decoding(c, skip, kv, sample))


def exact_decoding(c: Controls, skip: SkipDecode | None, kv: KVPolicy | None, sample: bool) -> ExactDecoding | None:
    """The exact-mode controls as an ``ExactDecoding`` (None when off), or an InputError saying why not."""
    if not _flag("exact on/off", c.exact):
        return None
    if skip is None:
        raise InputError("exact mode drafts with SkipDecode's layers: turn SkipDecode on (or turn exact off)")
    if kv is not None and kv.evicts:
        raise InputError(f"exact mode cannot be combined with KV eviction ({kv.describe()}): an evicted token "
                         "never comes back, so a rejected draft would change what the full model keeps; turn KV "
                         "eviction off (or turn exact off)")
    if sample:
        raise InputError("exact mode is greedy only: it keeps a draft where it equals the full model's greedy "
                         "token; set decoding to greedy (or turn exact off)")
    head = _choice("draft head", c.draft_head, tuple(DRAFT_HEADS))
    return ExactDecoding(_whole(_number(c.draft_k)), draft_vocab=DRAFT_HEADS[head])


def preview_schedule(num_layers: int, controls: Controls, shapes: dict | None = None):
    """The schedule the controls describe and its decode steps, through the same edge as a run.

    Only the ``preview`` controls count: the rest are set so that nothing else is checked.
    """
    request = build_request(num_layers, dataclasses.replace(
        controls, prompt="", decoding="greedy", temperature=1.0, seed=0, skip_on=True, kv_on=False,
        tuned=False, exact=False), shapes)
    return request.skip.schedule, decode_steps(request.settings.max_new_tokens)


def prompt_token_texts(loaded: LoadedModel, prompt: str) -> list[str]:
    """Each prompt token as text, as the engine encodes the prompt (the retention heatmap's labels)."""
    ids = loaded.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    return [loaded.tokenizer.decode([i]) for i in ids]


FULL_LABEL, SKIPKEY_LABEL = "Full model", "SkipKey"


def compare(loaded: LoadedModel, request: ComparisonRequest, stop: threading.Event | None = None,
            tuned: LoadedModel | None = None) -> Iterator[tuple[Trace, Trace]]:
    """Full model and SkipKey, interleaved one step each on the same device.

    The full side always runs ``loaded``; SkipKey's side runs ``tuned`` (the
    same model with its SkipDecode adapter merged) when the request asks for it.

    Alternating ``next()`` on the two generators keeps both under the same machine
    load, and each side's timings are its own steps only (``StepEvent.seconds``).
    Which side steps first changes from round to round (``trace.step_order``): work
    that lands right after an update (the browser redrawing the page on this
    machine) then falls on both sides alike.
    Yields the two (growing) traces after every pair of steps. ``stop`` ends both;
    closing this generator closes both engine loops, which frees their caches.
    """
    if request.tuned and tuned is None:
        raise InputError("this request asks for the tuned weights: pass the tuned model")
    full = Engine(loaded)
    accelerated = Engine(tuned if request.tuned else loaded, skip=request.skip, kv=request.kv, exact=request.exact)
    traces = (Trace.for_engine(full, FULL_LABEL), Trace.for_engine(accelerated, SKIPKEY_LABEL))
    # Only SkipKey's kept positions are drawn; the full model's would cost memory for nothing.
    streams = [full.generate([request.prompt], request.settings, stop=stop, record=False),
               accelerated.generate([request.prompt], request.settings, stop=stop, record=True)]
    try:
        for _ in lockstep(streams, traces):
            yield traces
        for trace in traces:
            trace.stopped = stop is not None and stop.is_set()
        yield traces
    finally:
        for stream in streams:
            stream.close()


HISTORY_STEPS = 128  # steps whose kept positions a finished run holds for the step slider


def thin_history(trace: Trace, steps: int = HISTORY_STEPS) -> Trace:
    """A copy of ``trace`` holding kept positions for at most ``steps`` evenly spaced steps and the last.

    What a session keeps after its run, for the retention slider: bounded whatever the run's length.
    """
    n = len(trace.events)
    stride = max(1, math.ceil(n / steps))
    keep = set(range(0, n, stride)) | {n - 1}
    events = [e if i in keep or e.kept is None else dataclasses.replace(e, kept=None)
              for i, e in enumerate(trace.events)]
    return dataclasses.replace(trace, events=events)


def recorded_step(trace: Trace, step: int) -> int:
    """The latest step at or before ``step`` (clamped to the run) whose kept positions are held."""
    step = min(max(0, step), len(trace.events) - 1)
    while step > 0 and trace.events[step].kept is None:
        step -= 1
    return step


# -- what the page shows ----------------------------------------------------------
def _fmt(value: float | None, pattern: str, missing: str = "–") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return pattern.format(value)


@dataclass(frozen=True)
class SideMetrics:
    """The numbers under one column: the metrics' records, plus the KV share and the measured speedup."""

    speed: Speed
    kv_mb: float
    kv_percent: float
    compute: Compute | None = None  # SkipKey's side only
    measured_speedup: float | None = None
    traffic_ratio: float | None = None  # the full model's bytes read per step over SkipKey's
    moved: Transfer | None = None  # where a device map offloads weights
    verified: Acceptance | None = None  # exact mode: the drafts' acceptance and tokens per verify step

    def markdown(self) -> str:
        s = self.speed
        lines = [
            f"**{_fmt(s.tokens_per_s, '{:.1f}')}** tokens/s · **{_fmt(s.ms_per_token_p50, '{:.0f}')}** ms/token "
            f"· first token **{_fmt(s.ttft_s, '{:.2f}')}** s",
            f"KV cache **{_fmt(self.kv_mb, '{:.2f}')}** MB ({_fmt(self.kv_percent, '{:.0f}')}% of full)",
        ]
        if self.compute is not None:
            lines.append(f"**{_fmt(self.compute.mean_layers, '{:.1f}')}** layers/token · nominal speedup "
                         f"**{_fmt(self.compute.nominal_speedup, '{:.2f}')}x** · compute ratio "
                         f"**{_fmt(self.compute.compute_ratio, '{:.2f}')}x** · bytes per step "
                         f"**{_fmt(self.traffic_ratio, '{:.2f}')}x** · measured "
                         f"**{_fmt(self.measured_speedup, '{:.2f}')}x**")
        if self.moved is not None:
            lines.append(f"weights moved **{_fmt(self.moved.bytes_per_step / 2**20, '{:.0f}')}** MiB/token"
                         + (f" · transfer ratio **{_fmt(self.moved.transfer_ratio, '{:.2f}')}x**"
                            if self.compute is not None else ""))
        if self.verified is not None:
            lines.append(f"exact: **{_fmt(self.verified.tokens_per_verify_step, '{:.2f}')}** tokens per verify step "
                         f"· acceptance **{_fmt(self.verified.acceptance, '{:.0%}')}** of "
                         f"{self.verified.drafted} drafted tokens")
        return "  \n".join(lines)


def side_metrics(trace: Trace, reference: Trace | None = None) -> SideMetrics:
    """``reference`` (the full model's trace) makes this the SkipKey side: shares and speedups."""
    timing = speed(trace)
    held = memory(trace).kv_bytes_final
    if reference is None:
        return SideMetrics(timing, held / 1e6, 100.0 if trace.events else float("nan"), moved=transfer(trace))
    ref_timing = speed(reference)
    measured = (ref_timing.ms_per_token_p50 / timing.ms_per_token_p50
                if timing.decode_tokens and ref_timing.decode_tokens else float("nan"))
    ours, theirs = traffic(trace), traffic(reference)
    return SideMetrics(timing, held / 1e6, 100.0 * kv_share(trace, reference), compute=compute(trace),
                       measured_speedup=measured, moved=transfer(trace), verified=acceptance(trace),
                       traffic_ratio=theirs.total / ours.total if ours and theirs else None)


def agreement_summary(full: Trace, accelerated: Trace, tokenizer=None, final: bool = False) -> str:
    """Token agreement and the first divergence (over the tokens both sides have while streaming);
    ROUGE-L of the texts once both are done."""
    reference, candidate = full.tokens(), accelerated.tokens()
    if not final:
        shared = min(len(reference), len(candidate))
        reference, candidate = reference[:shared], candidate[:shared]
    match = agreement(reference, candidate)
    text = f"**Agreement:** {match.matching:.0%} of {max(len(reference), len(candidate))} tokens match"
    i = match.first_divergence
    if i is None:
        text += " · no divergence"
    else:
        text += f" · first divergence at token {i}"
        if tokenizer is not None and i < min(len(reference), len(candidate)):
            text += f" ({tokenizer.decode([reference[i]])!r} vs {tokenizer.decode([candidate[i]])!r})"
    if final:
        text += f" · ROUGE-L **{rouge_l(full.text(), accelerated.text()):.2f}**"
    return text


def side_record(trace: Trace, reference: Trace | None = None) -> dict:
    """One column of a run as plain data: its text, its numbers (``side_metrics``) and its trace."""
    numbers = dataclasses.asdict(side_metrics(trace, reference))
    return dict(label=trace.label, text=trace.text(), tokens=trace.tokens(), metrics=jsonable(numbers),
                trace=trace_record(trace))


def run_record(full: Trace, accelerated: Trace, request: ComparisonRequest) -> dict:
    """The whole run as JSON-ready data: what was asked, both texts, their metrics, their agreement and traces.

    What the page's "download this run" button saves; ``json.dumps(..., allow_nan=False)`` takes it as is.
    """
    match = agreement(full.tokens(), accelerated.tokens())
    return dict(model=request.model, prompt=request.prompt, settings=request.describe(),
                generation=jsonable(dataclasses.asdict(request.settings)), stopped=accelerated.stopped,
                full=side_record(full), skipkey=side_record(accelerated, full),
                agreement=dict(jsonable(match.as_dict()), rouge_l=rouge_l(full.text(), accelerated.text())))


# -- the server's own limits --------------------------------------------------------------
MAX_PROMPT_TOKENS_ENV, REQUEST_SECONDS_ENV = "SKIPKEY_MAX_PROMPT_TOKENS", "SKIPKEY_REQUEST_SECONDS"


@dataclass(frozen=True)
class AppLimits:
    """What one request may ask of this server, whatever the model allows.

    ``max_prompt_tokens``: a longer prompt is refused before anything runs (the
    prompt pass is the request's largest single cost). ``request_seconds``: a run
    still going after this long is stopped, and says so. Both from the
    environment (``from_env``), so a shared Space can be tighter than a laptop.
    """

    max_prompt_tokens: int = 8192
    request_seconds: float = 600.0

    def __post_init__(self):
        if isinstance(self.max_prompt_tokens, bool) or not isinstance(self.max_prompt_tokens, int) \
                or not 1 <= self.max_prompt_tokens <= 10**7:
            raise InputError(f"the prompt-token cap must be an integer in 1..10000000, "
                             f"got {self.max_prompt_tokens!r}")
        seconds = self.request_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 86400:
            raise InputError(f"the request time limit must be a number of seconds in (0, 86400], got {seconds!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "AppLimits":
        """``$SKIPKEY_MAX_PROMPT_TOKENS`` and ``$SKIPKEY_REQUEST_SECONDS`` (unset: the defaults)."""
        env = os.environ if env is None else env
        given = {}
        for name, variable, parse in (("max_prompt_tokens", MAX_PROMPT_TOKENS_ENV, int),
                                      ("request_seconds", REQUEST_SECONDS_ENV, float)):
            text = (env.get(variable) or "").strip()
            if text:
                try:
                    given[name] = parse(text)
                except ValueError:
                    raise InputError(f"{variable}={text!r} is not a number") from None
        try:
            return cls(**given)
        except InputError as error:
            raise InputError(f"{error} (from {MAX_PROMPT_TOKENS_ENV}, {REQUEST_SECONDS_ENV})") from None


def check_prompt(loaded: LoadedModel, prompt, max_new_tokens: int, limits: AppLimits) -> int:
    """The prompt's token count, or an InputError: empty, over the model's context, or over the server's cap.

    Tokenised as the engine does (``Engine.encode``), so the count is the one the run will see.
    """
    if not isinstance(prompt, str):
        raise InputError(f"prompt must be text, got {type(prompt).__name__}")
    count = len(Engine(loaded).encode([prompt], max_new_tokens)[0])
    if count > limits.max_prompt_tokens:
        raise InputError(f"the prompt has {count} tokens; this server takes at most {limits.max_prompt_tokens} "
                         f"(allowed: 1..{limits.max_prompt_tokens} prompt tokens, set by {MAX_PROMPT_TOKENS_ENV})")
    return count


def prompt_tokens(loaded: LoadedModel, prompt: str) -> int:
    """How many tokens ``prompt`` is, as the engine encodes it (0 for an empty one)."""
    return len(loaded.tokenizer(prompt, add_special_tokens=True)["input_ids"]) if prompt.strip() else 0


def budget_summary(prompt_token_count: int, controls: Controls) -> str:
    """The prompt's size, and what the KV controls keep of it in tokens, with a warning where that is nothing useful.

    Under a budget of ``k`` tokens the newest ``w`` always stay (the recent window) and the
    policy's scores choose the other ``k - w``; a budget no larger than its window leaves the
    scores nothing to choose (and a short prompt a budget of a few tokens).
    """
    text = f"Prompt: **{prompt_token_count}** tokens"
    if controls.kv_on is not True or prompt_token_count == 0:
        return text + " · full KV cache"
    try:
        policy = make_kv_policy(controls.kv_policy, _budget_percent(controls.kv_budget_pct),
                                _percent(controls.kv_recent_pct))
    except InputError as error:
        return f"{text} · KV: {error}"
    keep = policy.budget_tokens(prompt_token_count)
    recent = min(keep, policy.recent_tokens(keep))
    text += (f" · KV budget **{keep}** tokens: the newest **{recent}** (recent window) plus **{keep - recent}** "
             f"chosen by {policy.name}")
    if keep - recent < 1 and policy.name != "window":
        text += (f"  \n⚠ The budget keeps no more than its recent window: {policy.name}'s scores choose nothing "
                 f"here, so this runs as a sliding window. Raise the budget or lower the recent window.")
    return text


def shown_options(decoding, kv_policy) -> dict[str, bool]:
    """Which option controls apply to the chosen decoding and KV policy (the page hides the rest)."""
    known = set(policy_options(kv_policy)) if kv_policy in KV_POLICIES else set()
    return dict(temperature=decoding == "sample", tau_init="tau_init" in known, tau_end="tau_end" in known,
                kv_observe="observe" in known, kv_pool="pool" in known, kv_normalize="normalize" in known)


# -- what the measured results say ----------------------------------------------------------
RESULTS_DIR = Path(__file__).resolve().parents[2] / "assets" / "results"
SKIP_QUALITY_FILE = "eval_tuned.json"  # the tuned adapter on held-out prompts (README, "SkipDecode fine-tuning")
KV_QUALITY_FILE = "eval_kv_quality_query_aware.json"  # Keyformer at 50%, as the paper and query-aware
EXACT_BENCH_FILE = "exact_b1.json"  # exact SkipDecode beside the full model at batch 1 (bench --exact)
# The SkipDecode quality goals at each target (README, "Against the goals"): measure -> (at least?, bound).
QUALITY_GOALS: Mapping[float, Mapping[str, tuple[bool, float]]] = MappingProxyType({
    1.5: MappingProxyType(dict(next_token_accuracy=(True, 0.75), ppl_of_full_continuations=(False, 3.0),
                               rouge_l=(True, 0.55), first_divergence_median=(True, 12))),
    2.0: MappingProxyType(dict(next_token_accuracy=(True, 0.60), ppl_of_full_continuations=(False, 5.0),
                               rouge_l=(True, 0.45), first_divergence_median=(True, 8))),
})
MEASURE_NAMES = dict(next_token_accuracy="next-token accuracy", ppl_of_full_continuations="PPL",
                     rouge_l="ROUGE-L", first_divergence_median="first divergence")


def read_results(name: str, results_dir: Path | None = None) -> dict | None:
    """A results file of ``assets/results`` (None where it is missing or unreadable: the page says so)."""
    path = (RESULTS_DIR if results_dir is None else results_dir) / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tuned_rows(results: dict) -> list[dict]:
    """The tuned adapter's rows at each target, in the layer policy it was trained with, lowest target first."""
    policy = results.get("adapter", {}).get("schedule", {}).get("policy")
    rows = [row for row in results.get("tuned", ()) if row.get("target") is not None
            and row.get("policy") == policy and row.get("label", "").endswith("tuned")]
    return sorted(rows, key=lambda row: row["target"])


def goal_misses(row: dict) -> list[str]:
    """The goals ``row`` misses, as text: the goals of the highest goal target at or below its target
    (below every goal target: the lowest's)."""
    at = max((t for t in QUALITY_GOALS if t <= row["target"]), default=min(QUALITY_GOALS))
    misses = []
    for measure, (at_least, bound) in QUALITY_GOALS[at].items():
        value = row.get(measure)
        if value is None or (value < bound if at_least else value > bound):
            misses.append(f"{MEASURE_NAMES[measure]} {_fmt(value, '{:.3g}')} {'<' if at_least else '>'} {bound:g}")
    return misses


@dataclass(frozen=True)
class QualityLimit:
    """The highest measured target up to which the tuned model meets its quality goals, and the first one past it."""

    target: float
    past: float | None  # the first measured target that misses a goal (None: none measured misses)
    misses: tuple[str, ...]  # what it misses
    source: str  # the results file


def quality_limit(results_dir: Path | None = None, name: str = SKIP_QUALITY_FILE) -> QualityLimit | None:
    """Where the SkipDecode quality table stops meeting its goals (None: no table to read)."""
    results = read_results(name, results_dir)
    rows = tuned_rows(results) if results else []
    if not rows:
        return None
    limit = None
    for row in rows:
        misses = goal_misses(row)
        if misses:
            return QualityLimit(limit if limit is not None else 1.0, row["target"], tuple(misses), name)
        limit = row["target"]
    return QualityLimit(limit, None, (), name)


def target_note(target, limit: QualityLimit | None) -> str:
    """The line under the target-speedup slider: a warning past the measured quality limit."""
    if limit is None:
        return ""
    value = _number(target)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return ""
    if limit.past is not None and value > limit.target:
        return (f"⚠ Past **{limit.target:g}x** the tuned model falls below its quality goals (at {limit.past:g}x: "
                f"{'; '.join(limit.misses)}; `{limit.source}`).")
    return f"Up to **{limit.target:g}x** the tuned model meets its quality goals (`{limit.source}`)."


# -- presets --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Preset:
    """A named setting of the controls, and where its expected cost was measured.

    ``changes`` are the controls it sets (every one its method depends on, the other
    method's switch included); ``skip_target`` / ``kv_row`` name the measured rows its
    cost line quotes (a target of the tuned table, a row label of the KV table).
    """

    name: str
    changes: Mapping[str, object]
    skip_target: float | None = None
    kv_row: str | None = None
    exact: ExactDecoding | None = None  # verified: its cost line quotes the exact bench's speed, not quality


_SKIP_ONLY = dict(skip_on=True, set_by="target speedup", tuned=True, kv_on=False, exact=False)
_EXACT = ExactDecoding(DEFAULT_DRAFT_K)
_EXACT_ON = dict(_SKIP_ONLY, target_speedup=2.0, exact=True, decoding="greedy", draft_k=_EXACT.draft_k,
                 draft_head=next(name for name, rows in DRAFT_HEADS.items() if rows == _EXACT.draft_vocab))
_KEYFORMER = dict(kv_on=True, kv_policy="keyformer", kv_budget_pct=50, kv_recent_pct=30)
_QUERY_AWARE = dict(kv_observe=RECOMMENDED_OPTIONS["observe"], kv_pool=RECOMMENDED_OPTIONS["pool"])
_QUERY_AWARE_ROW = "keyformer:" + ",".join(f"{k}={v}" for k, v in RECOMMENDED_OPTIONS.items()) + " 50%"
PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in (
    Preset("SkipDecode 1.5x (tuned)", MappingProxyType(dict(_SKIP_ONLY, target_speedup=1.5)), skip_target=1.5),
    Preset("SkipDecode 2x (tuned)", MappingProxyType(dict(_SKIP_ONLY, target_speedup=2.0)), skip_target=2.0),
    Preset("SkipDecode exact (verified)", MappingProxyType(_EXACT_ON), skip_target=2.0, exact=_EXACT),
    Preset("Keyformer 50% (query-aware)",
           MappingProxyType(dict(_KEYFORMER, **_QUERY_AWARE, skip_on=False, exact=False)), kv_row=_QUERY_AWARE_ROW),
    Preset("Keyformer 50% (paper)",
           MappingProxyType(dict(_KEYFORMER, kv_observe=0, kv_pool=1, skip_on=False, exact=False)),
           kv_row="keyformer 50%"),
    Preset("both", MappingProxyType(dict(_SKIP_ONLY, **_KEYFORMER, **_QUERY_AWARE, target_speedup=1.5)),
           skip_target=1.5, kv_row=_QUERY_AWARE_ROW),
)})


def _quality_text(row: dict, full: dict | None) -> str:
    reference = f" (full {full['ppl_of_full_continuations']:.2f})" if full else ""
    return (f"next-token accuracy {row['next_token_accuracy']:.2f}, PPL {row['ppl_of_full_continuations']:.2f}"
            f"{reference}, ROUGE-L {row['rouge_l']:.2f}")


def exact_cost(exact: ExactDecoding, results_dir: Path | None = None) -> str:
    """What exact mode costs: nothing in quality; its speed quoted from the exact bench's row for ``exact``."""
    results = read_results(EXACT_BENCH_FILE, results_dir)
    rows = [r for r in (results or {}).get("exact", ()) if r.get("exact") == exact.describe()]
    text = f"the full model's own tokens (greedy, every draft verified); {exact.describe()}: "
    if not rows:
        return text + f"speed not measured yet (`{EXACT_BENCH_FILE}`)"
    row = rows[0]
    return text + (f"measured **{_fmt(row.get('speedup_vs_full'), '{:.2f}')}x** the full model's speed, "
                   f"acceptance {_fmt(row.get('acceptance'), '{:.0%}')}, "
                   f"{_fmt(row.get('tokens_per_verify_step'), '{:.2f}')} tokens per verify step at batch "
                   f"{results.get('batch', 1)} (`{EXACT_BENCH_FILE}`)")


def preset_cost(preset: Preset, results_dir: Path | None = None) -> str:
    """One line: what the preset is expected to cost in quality, quoted from the measured rows it names."""
    if preset.exact is not None:
        return "Expected cost: " + exact_cost(preset.exact, results_dir) + "."
    parts = []
    if preset.skip_target is not None:
        results = read_results(SKIP_QUALITY_FILE, results_dir)
        rows = [r for r in tuned_rows(results) if r["target"] == preset.skip_target] if results else []
        full = next((r for r in results.get("tuned", ()) if r.get("policy") == "full"), None) if results else None
        target = preset.skip_target
        parts.append(f"SkipDecode at a nominal {target:g}x (layer runs per token cut {target:g}x); "
                     + (f"{_quality_text(rows[0], full)} on {results['prompts']} held-out prompts "
                        f"(`{SKIP_QUALITY_FILE}`)" if rows else f"not measured in `{SKIP_QUALITY_FILE}`"))
    if preset.kv_row is not None:
        results = read_results(KV_QUALITY_FILE, results_dir)
        table = results.get("kv_agreement", ()) if results else ()
        rows = [r for r in table if r.get("label") == preset.kv_row]
        full = next((r for r in table if r.get("policy") == "full"), None)
        parts.append(f"KV cache held to {preset.changes['kv_budget_pct']}% of the prompt; "
                     + (f"{_quality_text(rows[0], full)} on {results['prompts']} prompts of "
                        f"{results['kv_prompt_tokens']} tokens (`{KV_QUALITY_FILE}`)" if rows
                        else f"not measured in `{KV_QUALITY_FILE}`"))
    if preset.skip_target is not None and preset.kv_row is not None:
        parts.append("each measured alone")
    return "Expected cost: " + " · ".join(parts) + "."
