"""SkipKey's Gradio app: the full model and SkipKey side by side, streaming, and why.

``python app.py`` serves it on the embedded model (Gemma 3 270M) at port 7860.
``SKIPKEY_MODELS="facebook/opt-1.3b,Qwen/Qwen2.5-0.5B"`` offers more models
(GPU deployments); ``SKIPKEY_DEVICE_MAP=auto`` (with ``SKIPKEY_MAX_MEMORY`` and
``SKIPKEY_OFFLOAD_DIR``) has accelerate place models larger than the device.
The page only wires ``skipkey.serving.app_logic`` (the controls'
declaration, model cache, request edge, interleaved comparison) and
``skipkey.quality.figures`` to components: ``Handlers`` holds what its events call,
as plain methods, and ``build_demo`` lays the declared controls out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import math
import os
import tempfile
import threading
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple

import gradio as gr

from skipkey.quality import figures

from skipkey.core import kernels
from skipkey.serving.app_logic import (
    CONTROLS,
    DEFAULT_NEW_TOKENS,
    DEFAULT_PROMPT,
    DEFAULT_TARGET,
    MAX_NEW_TOKENS_UI,
    PRESETS,
    PREVIEW_CONTROLS,
    REQUEST_SECONDS_ENV,
    AppLimits,
    Controls,
    ModelCache,
    agreement_summary,
    budget_summary,
    build_request,
    check_prompt,
    compare,
    preset_cost,
    preview_schedule,
    prompt_token_texts,
    prompt_tokens,
    quality_limit,
    recorded_step,
    run_record,
    server_placement,
    shown_options,
    side_metrics,
    target_note,
    thin_history,
)
from skipkey.errors import InputError, ModelLoadError
from skipkey.kv.policies import RECOMMENDED_OPTIONS

log = logging.getLogger("skipkey.app")

try:  # ZeroGPU Spaces attach a GPU to each decorated call; elsewhere this is a no-op.
    import spaces

    gpu = spaces.GPU(duration=120)
except ImportError:
    def gpu(fn):
        return fn

FIGURE_EVERY = 8  # redraw the heatmaps every this many tokens while streaming
FIGURE_INTERVAL = 1.0  # ... and at most this often (s)
TEXT_INTERVAL = 0.1  # stream text at most this often (s)
CONCURRENCY = int(os.environ.get("SKIPKEY_CONCURRENCY", "2"))
QUEUE_SIZE = int(os.environ.get("SKIPKEY_QUEUE_SIZE", "16"))
# A finished run stays in its session for the step slider, bounded in time and in sessions held.
STATE_TTL_S = 900
STATE_SESSIONS = 64
THEME = gr.themes.Soft(primary_hue="blue")
CSS = """
#status {min-height: 1.5em}
.side-text textarea {font-size: 15px !important}
"""

_RETRIEVAL_FILLER = (
    "The town of Ashwick sits in a wide valley where two rivers meet. Its market opens every Thursday, "
    "and farmers bring apples, cheese, wool and honey from the hills around it. The old stone bridge was "
    "rebuilt after the flood of 1887, and the clock on the town hall has run two minutes slow ever since. "
    "Children walk to the school on Mill Lane, and in summer the library moves some of its shelves outside "
    "under the chestnut trees. The bakery on the square is known for its rye bread and its plum cake. "
)
RETRIEVAL_PROMPT = (
    "Read the notes, then answer the question.\n\n"
    "Note 1: The code to open the archive room is 7294.\n\n"
    + "".join(f"Note {i}: {_RETRIEVAL_FILLER}\n\n" for i in range(2, 7))
    + "Question: What is the code to open the archive room?\nAnswer: The code to open the archive room is"
)
# Each example sets every control its method depends on, the other method's switch included, so each shows
# one method at a time. The short prompts run SkipDecode alone at its default target: their KV budget would be
# a few tokens (it is a share of the prompt). In the retrieval prompt the first digit of the code comes from
# the prompt pass; the others need the cache to still hold Note 1. It runs Keyformer alone, with the
# recommended query-aware options (scores from the question's queries, pooled), which keep it; with observe at
# 0 (the paper) it loses all but "7". The tuned weights and the layer policy follow the model, not the example.
_SKIPDECODE_ONLY = dict(max_new_tokens=DEFAULT_NEW_TOKENS, exact=False, skip_on=True, set_by="target speedup",
                        target_speedup=DEFAULT_TARGET, kv_on=False, kv_policy="keyformer", kv_budget_pct=50, kv_recent_pct=30,
                        kv_observe=0, kv_pool=1)
_KEYFORMER_ONLY = dict(max_new_tokens=8, exact=False, skip_on=False, set_by="target speedup", target_speedup=DEFAULT_TARGET,
                       kv_on=True,
                       kv_policy="keyformer", kv_budget_pct=50, kv_recent_pct=10,
                       kv_observe=RECOMMENDED_OPTIONS["observe"], kv_pool=RECOMMENDED_OPTIONS["pool"])
EXAMPLE_SETTINGS: Mapping[str, Mapping[str, object]] = MappingProxyType({
    "Photosynthesis": dict(prompt=DEFAULT_PROMPT, **_SKIPDECODE_ONLY),
    "Story": dict(prompt="Here is a short story about a robot who learns to paint.\n\nOnce upon a time,",
                  **_SKIPDECODE_ONLY),
    "Code": dict(prompt="def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", **_SKIPDECODE_ONLY),
    "Long-context retrieval (eviction matters)": dict(prompt=RETRIEVAL_PROMPT, **_KEYFORMER_ONLY),
})
EXAMPLE_INPUTS = tuple(EXAMPLE_SETTINGS["Photosynthesis"])  # every example sets these controls, in this order
assert all(tuple(settings) == EXAMPLE_INPUTS for settings in EXAMPLE_SETTINGS.values())
EXAMPLE_LABELS = list(EXAMPLE_SETTINGS)
EXAMPLES = [[settings[name] for name in EXAMPLE_INPUTS] for settings in EXAMPLE_SETTINGS.values()]

LEGEND = ("**Reading the numbers.** *Nominal speedup*: the full model's layer runs per token over SkipKey's "
          "(what SkipDecode's schedule promises). *Compute ratio*: the same for all the work a token costs, the "
          "LM head included, which never skips. *Bytes per step*: the full model's weight and KV-cache bytes read "
          "per step over SkipKey's (what bounds decoding on a memory-bound machine). *Measured*: the full "
          "model's median time per token over SkipKey's, both timed in this run, step by step on one device. "
          "Red tokens in SkipKey's text are where it differs from the full model's.")


# -- how each control looks ------------------------------------------------------------------
@dataclass(frozen=True)
class Widget:
    """How one of the ``Controls`` appears on the page.

    ``kind`` names the Gradio component (``textbox``, ``dropdown``, ``number``,
    ``slider``, ``radio``, ``checkbox``) and ``options`` are its keyword arguments
    beyond the range (label, element id, ...); the range and choices come from the
    control's declaration (``app_logic.CONTROLS``). ``panel`` is the part of the page
    it sits in (``prompt``, ``run``, ``skip``, ``kv``); widgets of a panel with the
    same ``row`` sit side by side, rows in increasing order.
    """

    kind: str
    panel: str
    row: int
    options: Mapping = field(default_factory=lambda: MappingProxyType({}))


def _widget(kind: str, panel: str, row: int, **options) -> Widget:
    return Widget(kind, panel, row, MappingProxyType(options))


WIDGETS: Mapping[str, Widget] = MappingProxyType(dict(
    prompt=_widget("textbox", "prompt", 0, label="Prompt", lines=4, max_lines=12, elem_id="prompt"),
    model=_widget("dropdown", "run", 0, label="Model", info="the embedded Gemma 3 270M, or one from SKIPKEY_MODELS"),
    max_new_tokens=_widget("slider", "run", 1, label="max new tokens", elem_id="max_new_tokens"),
    decoding=_widget("radio", "run", 2, label="decoding", elem_id="decoding"),
    temperature=_widget("slider", "run", 2, label="temperature (sampling)", elem_id="temperature"),
    seed=_widget("number", "run", 1, label="seed", precision=0),
    skip_on=_widget("checkbox", "skip", 0, label="on", elem_id="skip_on"),
    layer_policy=_widget("radio", "skip", 0, label="layers",
                         info="top = the paper's; importance = the least important layers, ranked by a prompt "
                              "pass. Choosing a model selects the one its tuned weights were trained with"),
    schedule=_widget("radio", "skip", 2, label="schedule", visible=False),
    set_by=_widget("radio", "skip", 2, label="set by", elem_id="set_by",
                   info="target speedup: the schedule shape measured best for it (python -m skipkey shapes); "
                        "layers: your own shape"),
    b_max=_widget("slider", "skip", 3, label="max layers (b_max)", elem_id="b_max", visible=False),
    b_min=_widget("slider", "skip", 3, label="min layers (b_min)", elem_id="b_min", visible=False),
    horizon=_widget("slider", "skip", 4, label="horizon T (steps)", visible=False),
    warmup=_widget("slider", "skip", 4, label="warm-up layers", visible=False),
    exponent=_widget("slider", "skip", 5, label="power-law exponent", visible=False),
    target_speedup=_widget("slider", "skip", 5, label="target speedup", elem_id="target_speedup"),
    kv_on=_widget("checkbox", "kv", 0, label="on", elem_id="kv_on",
                  info="the budget is a share of the prompt: for long prompts"),
    kv_policy=_widget("radio", "kv", 0, label="policy", elem_id="kv_policy"),
    kv_budget_pct=_widget("slider", "kv", 1, label="KV budget (% of prompt)", elem_id="kv_budget_pct"),
    kv_recent_pct=_widget("slider", "kv", 1, label="recent window (% of budget)", elem_id="kv_recent_pct"),
    tau_init=_widget("slider", "kv", 2, label="tau init (Keyformer)", elem_id="tau_init"),
    tau_end=_widget("slider", "kv", 2, label="tau end (Keyformer)", elem_id="tau_end"),
    kv_observe=_widget("slider", "kv", 3, label="observe W", elem_id="kv_observe",
                       info="h2o/keyformer/snapkv: score the prompt from its last W queries only, where the "
                            "question is (SnapKV's observation window); 0 = every query, the paper"),
    kv_pool=_widget("slider", "kv", 3, label="pool K", elem_id="kv_pool",
                    info="h2o/keyformer/snapkv: max-pool prompt scores over K neighbouring tokens, so a number or "
                         "a name is kept or dropped whole; 1 = off"),
    kv_normalize=_widget("checkbox", "kv", 3, label="normalize", elem_id="kv_normalize",
                         info="h2o/keyformer: divide each score by how many queries could see the token, so early "
                              "tokens do not win just by being early"),
    tuned=_widget("checkbox", "skip", 1, label="tuned weights", elem_id="tuned", interactive=False,
                  info="SkipKey's side runs the model with its SkipDecode LoRA adapter, trained with its layer "
                       "policy and schedule shapes in place (embedded model only); off: the same schedule on the "
                       "original weights"),
    hold=_widget("slider", "skip", 4, label="hold (steps at b_max)", visible=False,
                 info="steps run at b_max before the decay starts; 0 = the paper's"),
    exact=_widget("checkbox", "skip", 6, label="exact (verify with the full model)", elem_id="exact",
                  info="SkipDecode drafts tokens, the full model checks them in one pass: the output is the full "
                       "model's, token for token (greedy; not with KV eviction)"),
    draft_k=_widget("slider", "skip", 6, label="draft length k", elem_id="draft_k",
                    info="tokens drafted per verify step"),
    draft_head=_widget("radio", "skip", 7, label="draft head", elem_id="draft_head",
                       info="the most frequent tokens' rows make each draft step cheaper; verification always "
                            "uses the full head"),
))
assert list(WIDGETS) == list(CONTROLS), "each control has one widget, in the controls' order"
# The options each decoding mode or KV policy may hide (app_logic.shown_options says which apply).
OPTION_CONTROLS = tuple(shown_options(Controls().decoding, Controls().kv_policy))
BUDGET_CONTROLS = ("prompt", "model", "kv_on", "kv_policy", "kv_budget_pct", "kv_recent_pct")
PRESET_CONTROLS = tuple(name for name in CONTROLS if any(name in p.changes for p in PRESETS.values()))


class ComparisonOutputs(NamedTuple):
    """What ``/compare`` updates, in order: the components, or the values a step sends them."""

    status: object
    full_text: object
    full_metrics: object
    skip_text: object
    skip_metrics: object
    skip_html: object
    agreement: object
    layer_plot: object
    acceptance_plot: object  # exact mode: which tokens the draft proposed and the full model kept
    retention_plot: object
    step: object
    skip_diff: object  # SkipKey's text, each token marked where it differs from the full model's
    download: object  # the finished run as a JSON file
    last_run: object  # the session's finished run, for the step slider (not sent to API clients)

    @classmethod
    def status_only(cls, status: str) -> "ComparisonOutputs":
        return cls(status, *(gr.skip(),) * (len(cls._fields) - 1))


class ModelOutputs(NamedTuple):
    """What choosing a model updates: the status and the controls that depend on its size."""

    status: object
    b_max: object
    b_min: object
    warmup: object
    target_speedup: object
    max_new_tokens: object
    tuned: object
    layer_policy: object  # the policy the model's adapter was trained with

    @classmethod
    def status_only(cls, status: str) -> "ModelOutputs":
        return cls(status, *(gr.skip(),) * (len(cls._fields) - 1))


class RunningRequests:
    """Stop events of the requests in flight, per browser session; nothing else is kept."""

    def __init__(self):
        self._events: dict[str, set[threading.Event]] = {}
        self._lock = threading.Lock()

    def add(self, session: str, event: threading.Event) -> None:
        with self._lock:
            self._events.setdefault(session, set()).add(event)

    def remove(self, session: str, event: threading.Event) -> None:
        with self._lock:
            events = self._events.get(session, set())
            events.discard(event)
            if not events:
                self._events.pop(session, None)

    def stop(self, session: str) -> int:
        with self._lock:
            events = list(self._events.get(session, ()))
        for event in events:
            event.set()
        return len(events)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(events) for events in self._events.values())


def _session(request: gr.Request | None) -> str | None:
    return getattr(request, "session_hash", None) if request is not None else None


def _user_error(message: str) -> gr.Error:
    """An error the user can act on: shown in the page and to API clients, not logged as a crash."""
    return gr.Error(message, print_exception=False)


def layer_slider_updates(num_layers: int, warmup: int = 1) -> dict:
    """Slider limits for a model with ``num_layers`` layers (b_max, b_min, warmup, target speedup)."""
    return dict(
        b_max=gr.update(maximum=num_layers, value=num_layers),
        b_min=gr.update(maximum=num_layers, value=max(warmup + 1, (2 * num_layers) // 3)),
        warmup=gr.update(maximum=num_layers - 1, value=min(warmup, num_layers - 1)),
        target_speedup=gr.update(maximum=round(num_layers / (warmup + 1), 2),
                                 value=min(1.5, num_layers / (warmup + 1))),
    )


class Handlers:
    """What the page's events call, as plain methods: tests call them directly, without a browser.

    ``models`` loads and shares the allowed models (tests inject a tiny one);
    ``running`` holds the stop events of the comparisons in flight.
    """

    def __init__(self, models: ModelCache | None = None, *, figure_every: int = FIGURE_EVERY,
                 figure_interval: float = FIGURE_INTERVAL, text_interval: float = TEXT_INTERVAL,
                 limits: AppLimits | None = None, downloads: Path | None = None):
        self.models = models if models is not None else ModelCache()
        self.running = RunningRequests()
        self.figure_every, self.figure_interval, self.text_interval = figure_every, figure_interval, text_interval
        self.limits = limits if limits is not None else AppLimits.from_env()
        self._downloads = downloads  # made on the first download
        self.quality = quality_limit()  # read once: the target note asks on every slider move

    def _wait_for_model(self, model, waiting: Callable[[str], tuple], stop: threading.Event | None = None,
                        tuned: bool = False):
        """Yields ``waiting(status line)`` while ``model`` loads; returns it.

        ``tuned``: the model with its SkipDecode adapter merged instead. Returns None
        when ``stop`` is set first; a load failure is a gr.Error with its one-line reason.
        """
        try:
            future = self.models.tuned_future(model) if tuned else self.models.future(model)
        except InputError as error:
            raise _user_error(str(error)) from None
        started = time.perf_counter()
        while True:
            try:
                return future.result(timeout=1.0)
            except FutureTimeout:
                if stop is not None and stop.is_set():
                    return None
                waited = time.perf_counter() - started
                yield waiting(f"**Merging** the SkipDecode adapter into **{model}**… {waited:.0f} s (once)" if tuned
                              else f"**Loading** model **{model}**… {waited:.0f} s (the embedded model is converted "
                                   "once on first use, about 2 min on a small CPU; later loads take seconds)")
            except (InputError, ModelLoadError) as error:
                raise _user_error(str(error)) from None
            except Exception as error:  # noqa: BLE001 - a load failure must reach the user as one line
                log.exception("loading %s failed", model)
                raise _user_error(f"Could not load model {model!r}: {type(error).__name__}: {error}") from None

    def select_model(self, model):
        """Load the chosen model (with progress); fit the layer sliders, the tuned toggle and the layer
        policy (the one its adapter was trained with) to it."""
        return (yield from status_on_error(self._select_model(model), ModelOutputs.status_only))

    def _select_model(self, model):
        loaded = yield from self._wait_for_model(model, ModelOutputs.status_only)
        L = loaded.num_layers
        has_tuned, policy = self.models.has_tuned(model), self.models.policy(model)
        yield ModelOutputs(
            status=(f"**{model}** ready: {L} layers, context {loaded.context_length} tokens, "
                    f"{loaded.device.type} / {str(loaded.dtype).removeprefix('torch.')}"
                    + (f"; placed by accelerate ({loaded.placement.describe()})" if loaded.placement else "")
                    + ("; SkipDecode-tuned weights available" if has_tuned else "")),
            **layer_slider_updates(L),
            max_new_tokens=gr.update(maximum=min(MAX_NEW_TOKENS_UI, loaded.context_length - 1)),
            tuned=gr.update(interactive=True) if has_tuned else gr.update(interactive=False, value=False),
            layer_policy=gr.update(value=policy) if policy else gr.skip())

    def defaults(self) -> Controls:
        """The page's and the API's defaults: the default model, with its adapter's layer policy."""
        model, page = self.models.default, Controls()
        return dataclasses.replace(page, model=model, layer_policy=self.models.policy(model) or page.layer_policy)

    def schedule_preview(self, controls: Controls):
        """The SkipDecode budget b(t) the sliders describe; never runs the model."""
        loaded = self.models.loaded(controls.model) if isinstance(controls.model, str) else None
        if loaded is None:
            return figures.message_figure("The preview appears once the model is loaded.", 220)
        try:
            schedule, steps = preview_schedule(loaded.num_layers, controls, self.models.shapes(controls.model))
        except InputError as error:
            return figures.message_figure(str(error), 220)
        return figures.schedule_figure(schedule, loaded.num_layers, steps)

    def prompt_summary(self, controls: Controls) -> str:
        """The prompt's token count and the KV budget in tokens, with a warning where the budget is all window."""
        loaded = self.models.loaded(controls.model) if isinstance(controls.model, str) else None
        if loaded is None or not isinstance(controls.prompt, str):
            return "The prompt's token count appears once the model is loaded."
        return budget_summary(prompt_tokens(loaded, controls.prompt), controls)

    def target_note(self, target) -> str:
        """Under the target-speedup slider: where the measured quality falls below its goals."""
        return target_note(target, self.quality)

    def apply_preset(self, name, model):
        """The controls a preset sets, in ``PRESET_CONTROLS`` order, then its expected-cost line.

        The tuned weights stay off for a model without an adapter."""
        preset = PRESETS.get(name)
        if preset is None:
            return (*(gr.skip() for _ in PRESET_CONTROLS), "")
        changes = dict(preset.changes)
        if not self.models.has_tuned(model):
            changes.pop("tuned", None)
        return (*(changes[n] if n in changes else gr.skip() for n in PRESET_CONTROLS), preset_cost(preset))

    @property
    def downloads(self) -> Path:
        """The folder the runs' JSON files are saved in (a fresh temporary one unless given)."""
        if self._downloads is None:
            self._downloads = Path(tempfile.mkdtemp(prefix="skipkey-runs-"))
        return self._downloads

    def save_run(self, full, sk, req) -> Path:
        """The run as a JSON file in this server's download folder; files older than a session's state go."""
        cutoff = time.time() - STATE_TTL_S
        for old in self.downloads.glob("skipkey-run-*.json"):
            with contextlib.suppress(OSError):
                if old.stat().st_mtime < cutoff:
                    old.unlink()
        path = self.downloads / f"skipkey-run-{uuid.uuid4().hex[:12]}.json"
        path.write_text(json.dumps(run_record(full, sk, req), indent=1, allow_nan=False))
        return path

    def compare(self, controls: Controls, request: gr.Request = None):
        """Stream the full model and SkipKey side by side, with metrics and both heatmaps."""
        return (yield from status_on_error(self._compare(controls, request), ComparisonOutputs.status_only))

    def _compare(self, controls: Controls, request: gr.Request = None):
        model = controls.model
        stop = threading.Event()
        session = _session(request)
        if session is not None:
            self.running.add(session, stop)
        try:
            loaded = yield from self._wait_for_model(model, ComparisonOutputs.status_only, stop=stop)
            if loaded is None:
                return
            try:  # all of it before the panes are cleared: a refused request leaves the last run in view
                req = build_request(loaded.num_layers, controls, self.models.shapes(model))
                prompt_count = check_prompt(loaded, req.prompt, req.settings.max_new_tokens, self.limits)
            except InputError as error:
                raise _user_error(str(error)) from None
            tuned_model = None
            if req.tuned:  # a model without an adapter is refused here, with the models that have one
                tuned_model = yield from self._wait_for_model(model, ComparisonOutputs.status_only, stop=stop,
                                                              tuned=True)
                if tuned_model is None:
                    return
            yield ComparisonOutputs(
                status=f"**Generating** with **{model}**: {req.describe()}", full_text="", full_metrics="",
                skip_text="", skip_metrics="", skip_html="", agreement="",
                layer_plot=figures.message_figure("Layer usage appears with the first token."),
                acceptance_plot=figures.message_figure("Acceptance appears in exact mode, once tokens are verified."
                                                       if req.exact else "Exact mode is off: no drafts to verify.",
                                                       120),
                retention_plot=figures.message_figure("Retained tokens appear once the prompt is processed."),
                step=gr.update(visible=False), skip_diff=[], download=None, last_run=None)
            prompt_texts = None
            last_text = last_figure = 0.0
            drawn = 0
            deadline = time.perf_counter() + self.limits.request_seconds
            timed_out = False
            try:
                for full, sk in compare(loaded, req, stop, tuned=tuned_model):
                    if not timed_out and time.perf_counter() > deadline:
                        timed_out = True
                        stop.set()  # both sides end after this step; what they made is kept
                    if prompt_texts is None:
                        prompt_texts = prompt_token_texts(loaded, req.prompt)
                    # Fast devices make tokens faster than a browser can draw them: send text at most
                    # every text_interval s, and figures every few tokens, at most every figure_interval s.
                    now, steps = time.perf_counter(), len(sk.events)
                    redraw = drawn == 0 or (steps - drawn >= self.figure_every
                                            and now - last_figure >= self.figure_interval)
                    if not redraw and now - last_text < self.text_interval:
                        continue
                    if redraw:
                        drawn, last_figure = steps, now
                    last_text = now
                    yield comparison_outputs(full, sk, loaded, prompt_texts, redraw=redraw, final=False)
            except InputError as error:
                raise _user_error(str(error)) from None
            except Exception as error:  # noqa: BLE001 - one failed request must not take the app down
                log.exception("comparison failed")
                raise _user_error(f"Generation failed: {type(error).__name__}: {error}") from None
            if not full.events:
                return
            if timed_out:
                word = (f"Stopped at the time limit of {self.limits.request_seconds:g} s a request "
                        f"({REQUEST_SECONDS_ENV})")
            else:
                word = "Stopped" if sk.stopped else "Done"
            yield comparison_outputs(full, sk, loaded, prompt_texts, redraw=True, final=True)._replace(
                status=f"**{word}**: {len(full.events)} + {len(sk.events)} tokens from a {prompt_count}-token "
                       f"prompt. {req.describe()}.{req.hint()}",
                download=str(self.save_run(full, sk, req)))
        finally:
            stop.set()
            if session is not None:
                self.running.remove(session, stop)

    def stop(self, request: gr.Request = None):
        """Ends both streams of this browser session's running comparison at once."""
        session = _session(request)
        stopped = self.running.stop(session) if session is not None else 0
        return "**Stopped.**" if stopped else gr.skip()


def status_on_error(stream, status_only: Callable[[str], tuple]):
    """A handler's updates; on a gr.Error, one more setting the status line to it, then the error itself.

    The page shows both, and the status no longer says "Loading" or "Generating".
    """
    try:
        return (yield from stream)
    except gr.Error as error:
        yield status_only(f"**Refused:** {error.message}")
        raise


def option_visibility(decoding, kv_policy):
    """Show only the options the decoding mode and the KV policy use, in ``OPTION_CONTROLS`` order."""
    shown = shown_options(decoding, kv_policy)
    return tuple(gr.update(visible=shown[name]) for name in OPTION_CONTROLS)


def schedule_controls(schedule, set_by):
    """Show the controls the chosen mode and schedule use: a target speedup alone (the measured-best shape
    does the rest), or the schedule's kind, warm-up, b_max, b_min, horizon, hold and exponent."""
    by_layers = set_by != "target speedup"
    return (gr.update(visible=by_layers),
            gr.update(visible=by_layers and schedule != "constant"),
            gr.update(visible=by_layers,
                      label="layers (constant)" if schedule == "constant" else "min layers (b_min)"),
            gr.update(visible=by_layers and schedule != "constant"),
            gr.update(visible=by_layers),
            gr.update(visible=by_layers and schedule != "constant"),
            gr.update(visible=by_layers and schedule == "power"),
            gr.update(visible=not by_layers))


def retention_at_step(state, step):
    """The retention heatmap after any step of the last run (the slider under it)."""
    if not state:
        return figures.message_figure("Generate first; then pick a step here.")
    trace, prompt_texts = state
    wanted = int(step) if isinstance(step, (int, float)) and math.isfinite(step) else len(trace.events) - 1
    return figures.retention_figure(trace, recorded_step(trace, wanted), position_texts=prompt_texts)


def comparison_outputs(full, sk, loaded, prompt_texts, *, redraw: bool, final: bool) -> ComparisonOutputs:
    """The outputs for the two traces so far (figures only when ``redraw``); the status is left as it is."""
    skip = gr.skip()
    if final and sk.events:
        last = len(sk.events) - 1
        step_update = gr.update(visible=True, minimum=0, maximum=max(1, last), value=last, interactive=last > 0)
        state = (thin_history(sk), prompt_texts)
    else:
        step_update, state = skip, skip
    return ComparisonOutputs(
        status=skip, full_text=full.text(), full_metrics=side_metrics(full).markdown(), skip_text=sk.text(),
        skip_metrics=side_metrics(sk, full).markdown(), skip_html=figures.layers_html(sk),
        agreement=agreement_summary(full, sk, loaded.tokenizer, final=final),
        layer_plot=figures.layer_usage_figure(sk) if redraw else skip,
        acceptance_plot=figures.acceptance_figure(sk) if redraw else skip,
        retention_plot=figures.retention_figure(sk, position_texts=prompt_texts) if redraw else skip,
        step=step_update, skip_diff=figures.token_diff(full, sk, pending=not final), download=skip, last_run=state)


# -- the page ----------------------------------------------------------------------------------
COMPONENTS = {"textbox": gr.Textbox, "dropdown": gr.Dropdown, "number": gr.Number, "slider": gr.Slider,
              "radio": gr.Radio, "checkbox": gr.Checkbox}


def control_panel(panel: str, defaults: Controls, overrides: dict[str, dict]) -> dict[str, gr.components.Component]:
    """The components of one panel, row by row: each control's widget (``WIDGETS``) with its declared range
    (``CONTROLS``), valued ``defaults``."""
    made = {}
    names = [name for name, widget in WIDGETS.items() if widget.panel == panel]
    for row in sorted({WIDGETS[name].row for name in names}):
        in_row = [name for name in names if WIDGETS[name].row == row]
        with gr.Row() if len(in_row) > 1 else contextlib.nullcontext():
            for name in in_row:
                widget = WIDGETS[name]
                options = {"value": getattr(defaults, name), **CONTROLS[name].bounds(), **widget.options,
                           **overrides.get(name, {})}
                if "choices" in options:
                    options["choices"] = list(options["choices"])
                made[name] = COMPONENTS[widget.kind](**options)
    return made


def controls_function(method: Callable, names: tuple[str, ...], *, request: bool = False,
                      defaults: Controls | None = None) -> Callable:
    """``method(Controls[, request])`` as a function of the controls ``names``, one argument each.

    Gradio passes one value per input component and names the API's parameters
    after the function's signature, so the signature is built from the same names;
    an argument left out takes its value from ``defaults`` (default: ``Controls()``).
    """
    defaults = defaults if defaults is not None else Controls()
    params = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=getattr(defaults, name))
              for name in names]
    if request:
        params.append(inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                        annotation=gr.Request))
    signature = inspect.Signature(params)

    def arguments(args, kwargs) -> tuple:
        values = signature.bind(*args, **kwargs).arguments
        req = values.pop("request", None)
        return (Controls(**values), req) if request else (Controls(**values),)

    if inspect.isgeneratorfunction(method):
        def function(*args, **kwargs):
            return (yield from method(*arguments(args, kwargs)))
    else:
        def function(*args, **kwargs):
            return method(*arguments(args, kwargs))
    function.__name__ = method.__name__
    function.__doc__ = method.__doc__
    function.__signature__ = signature
    function.__annotations__ = {"request": gr.Request} if request else {}
    return function


def build_demo(handlers: Handlers | None = None, *, concurrency_limit: int = CONCURRENCY,
               max_size: int = QUEUE_SIZE) -> gr.Blocks:
    """The page: the ``Controls`` laid out by panel, wired to ``handlers`` (default: the allowed models)."""
    handlers = handlers if handlers is not None else Handlers()
    defaults = handlers.defaults()
    shown = shown_options(defaults.decoding, defaults.kv_policy)
    overrides = {"model": dict(choices=list(handlers.models.allowed)),
                 **{name: dict(visible=shown[name]) for name in OPTION_CONTROLS}}
    with gr.Blocks(title="SkipKey: faster decoding, and why") as demo:
        gr.Markdown("# SkipKey\nThe full model and SkipKey decode the same prompt, interleaved step by step on "
                    "one device. **SkipDecode** runs fewer layers per token (early exit, nested layer sets); "
                    "**Keyformer** keeps only a budget of key tokens in the KV cache. The heatmaps show which "
                    "layers produced each token and which tokens each layer still remembers.")
        status = gr.Markdown("Loading the model…", label="status", elem_id="status")
        with gr.Row():
            with gr.Column(scale=3):
                c = control_panel("prompt", defaults, overrides)
                prompt_info = gr.Markdown(elem_id="prompt_info")
                with gr.Row():
                    generate_btn = gr.Button("Generate", variant="primary", elem_id="generate")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
            with gr.Column(scale=2):
                c |= control_panel("run", defaults, overrides)
        with gr.Row():
            preset = gr.Radio(list(PRESETS), value=None, label="Presets", elem_id="preset", scale=2)
            preset_note = gr.Markdown("Pick a preset: each sets one method at its recommended setting and says "
                                      "what it is expected to cost.", elem_id="preset_cost")
        with gr.Row():
            with gr.Column():
                with gr.Accordion("SkipDecode: fewer layers per token", open=True):
                    c |= control_panel("skip", defaults, overrides)
                    target_md = gr.Markdown(handlers.target_note(defaults.target_speedup), elem_id="target_note")
                    preview = gr.Plot(label="schedule preview", elem_id="schedule_preview")
            with gr.Column():
                with gr.Accordion("KV cache: keep a budget of key tokens", open=True):
                    c |= control_panel("kv", defaults, overrides)
                gr.Examples(EXAMPLES, inputs=[c[name] for name in EXAMPLE_INPUTS], example_labels=EXAMPLE_LABELS,
                            label="Example prompts")
        with gr.Row(equal_height=False):
            with gr.Column():
                full_text = gr.Textbox(label="Full model", lines=8, max_lines=16, interactive=False,
                                       elem_id="full_text", elem_classes="side-text")
                full_metrics = gr.Markdown(label="full model metrics", elem_id="full_metrics")
            with gr.Column():
                skip_text = gr.Textbox(label="SkipKey", lines=8, max_lines=16, interactive=False,
                                       elem_id="skip_text", elem_classes="side-text")
                skip_diff = gr.HighlightedText(label="SkipKey against the full model", elem_id="skip_diff",
                                               combine_adjacent=False, show_legend=True,
                                               color_map={figures.DIFFERS: "red"})
                skip_metrics = gr.Markdown(label="SkipKey metrics", elem_id="skip_metrics")
        agreement_md = gr.Markdown(label="agreement", elem_id="agreement")
        with gr.Row():
            gr.Markdown(LEGEND, elem_id="legend")
            download = gr.DownloadButton("Download this run (JSON)", value=None, elem_id="download", scale=0)
        skip_html = gr.HTML(label="SkipKey text by layers used", elem_id="skip_layers")
        layer_plot = gr.Plot(label="Layer usage", elem_id="layer_plot")
        acceptance_plot = gr.Plot(label="Exact mode: accepted drafts", elem_id="acceptance_plot")
        retention_plot = gr.Plot(label="Retained tokens", elem_id="retention_plot")
        step = gr.Slider(0, 1, value=1, step=1, label="retention after step", visible=False, elem_id="step")
        last_run = gr.State(None, time_to_live=STATE_TTL_S)  # this session's last run, for the step slider
        assert set(c) == set(CONTROLS), f"controls without a panel: {set(CONTROLS) - set(c)}"

        outputs = ComparisonOutputs(status, full_text, full_metrics, skip_text, skip_metrics, skip_html,
                                    agreement_md, layer_plot, acceptance_plot, retention_plot, step, skip_diff,
                                    download, last_run)
        # preprocess=False: raw values reach the one edge (build_request), which checks them all,
        # also for API clients whose values no slider bounds.
        compare_fn = controls_function(handlers.compare, tuple(CONTROLS), request=True, defaults=defaults)
        run = generate_btn.click(gpu(compare_fn), [c[name] for name in CONTROLS], list(outputs), api_name="compare",
                                 preprocess=False, concurrency_id="model", concurrency_limit=concurrency_limit,
                                 show_progress="minimal")
        stop_btn.click(handlers.stop, None, status, cancels=[run], queue=False, api_name="stop",
                       api_visibility="undocumented")
        preview_fn = controls_function(handlers.schedule_preview, PREVIEW_CONTROLS, defaults=defaults)
        preview_inputs = [c[name] for name in PREVIEW_CONTROLS]
        summary_fn = controls_function(handlers.prompt_summary, BUDGET_CONTROLS, defaults=defaults)
        summary_inputs = [c[name] for name in BUDGET_CONTROLS]
        model_outputs = list(ModelOutputs(status, *(c[name] for name in ModelOutputs._fields[1:])))
        (c["model"].change(handlers.select_model, c["model"], model_outputs, api_name="select_model",
                           concurrency_id="model", concurrency_limit=concurrency_limit, preprocess=False,
                           show_progress="hidden")
         .then(preview_fn, preview_inputs, preview, api_name="preview_after_model_change",
               api_visibility="private", preprocess=False)
         .then(summary_fn, summary_inputs, prompt_info, api_visibility="private", preprocess=False))
        (demo.load(handlers.select_model, c["model"], model_outputs, api_name="load_default_model",
                   api_visibility="private", preprocess=False, show_progress="hidden")
         .then(preview_fn, preview_inputs, preview, api_name="preview_after_load",
               api_visibility="private", preprocess=False)
         .then(summary_fn, summary_inputs, prompt_info, api_visibility="private", preprocess=False))
        gr.on([component.change for name, component in zip(PREVIEW_CONTROLS, preview_inputs) if name != "model"],
              preview_fn, preview_inputs, preview, api_name="schedule_preview", preprocess=False, queue=False,
              show_progress="hidden", trigger_mode="always_last")
        gr.on([c[name].change for name in BUDGET_CONTROLS if name != "model"], summary_fn, summary_inputs,
              prompt_info, api_visibility="private", preprocess=False, queue=False, show_progress="hidden",
              trigger_mode="always_last")
        gr.on([c["schedule"].change, c["set_by"].change], schedule_controls, [c["schedule"], c["set_by"]],
              [c[name] for name in ("schedule", "b_max", "b_min", "horizon", "warmup", "hold", "exponent",
                                    "target_speedup")],
              queue=False,
              api_visibility="private")
        gr.on([c["decoding"].change, c["kv_policy"].change], option_visibility, [c["decoding"], c["kv_policy"]],
              [c[name] for name in OPTION_CONTROLS], queue=False, api_visibility="private", show_progress="hidden")
        c["target_speedup"].change(handlers.target_note, c["target_speedup"], target_md, queue=False,
                                   api_visibility="private", show_progress="hidden", trigger_mode="always_last")
        preset.input(handlers.apply_preset, [preset, c["model"]], [*(c[name] for name in PRESET_CONTROLS),
                                                                   preset_note],
                     queue=False, api_visibility="private", show_progress="hidden")
        step.release(retention_at_step, [last_run, step], retention_plot, api_visibility="private",
                     show_progress="hidden")

    demo.queue(max_size=max_size, default_concurrency_limit=concurrency_limit)
    return demo


def launch(demo: gr.Blocks, **kwargs):
    """Launch with the app's look; never a share link."""
    kwargs.setdefault("theme", THEME)
    kwargs.setdefault("css", CSS)
    kwargs.setdefault("ssr_mode", False)
    kwargs.setdefault("state_session_capacity", STATE_SESSIONS)
    kwargs["share"] = False
    return demo.launch(**kwargs)


def main() -> None:
    logging.basicConfig()  # warnings and errors; request failures are logged with their traceback
    try:  # a bad placement variable or limit stops the server at start, saying which
        server_placement()
        limits = AppLimits.from_env()
    except InputError as error:
        raise SystemExit(f"error: {error}") from None
    models = ModelCache()
    models.future(models.default)  # start loading now: the first request should not wait from scratch
    kernels.build_in_background()  # and compiling the fused CPU kernels, where a compiler is installed
    launch(build_demo(Handlers(models, limits=limits)))


if __name__ == "__main__":
    main()
